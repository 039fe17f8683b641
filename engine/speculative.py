"""Speculative decoding: drafts from the MTP layer, verified by the main model, kept only where
they pay.

A round at position P with the token t about to be fed:

    drafts d1..dk   = the MTP layer's greedy choices, chained (model.mtp)
    rows            = [t, d1, .., dk] at P .. P+k, verified in one layer-major pass (Session.verify)
    row i's logits  = exactly those of a plain step on it (model.forward)
    accepted        = while the token row i picks (greedy: its argmax; sampling: accept_draft)
                      is the draft d_{i+1}; the first row that disagrees gives its own pick
    commit          = the accepted rows and the one after them are the session's; the other rows'
                      KV state is undone exactly (model.kv_journal)

So greedy output is plain greedy output, token for token, and the rows' records are those of
plain steps. With sampling, each judged row draws its token as a plain step would, with the
next uniform of the sampler's stream, and the draft is kept when it is that token: kept with
probability p(d), as speculative rejection sampling with a proposal made with certainty keeps
it, and the output is plain sampling's own, token for token, for the same seed (the stream
gives one uniform per token, in order, whatever k the rounds had).

SpecController picks k (0 to K) per round from what it measured: the acceptance at each draft
depth, the seconds of a plain step and of rounds at each k (drafts and the verify pass, whose
cost per extra row depends on how many experts the rows share and whether they are cached).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.model.kv_journal import KVJournal
from ds4f.engine.model.mtp import MAX_DRAFTS


def parse_spec(value) -> str | int:
    """--spec / spec = "auto" | "off" | k (0..MAX_DRAFTS drafts per round): the mode, k an int."""
    if isinstance(value, bool):
        raise Ds4fError(f"spec: {value!r}: auto, off or a number of drafts 0..{MAX_DRAFTS}", param="spec")
    if isinstance(value, int):
        k = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "off"):
            return text
        try:
            k = int(text)
        except ValueError:
            raise Ds4fError(f"spec: {value!r}: auto, off or a number of drafts 0..{MAX_DRAFTS}",
                            param="spec") from None
    if not 0 <= k <= MAX_DRAFTS:
        raise Ds4fError(f"spec: {k} drafts: 0..{MAX_DRAFTS}", param="spec")
    return "off" if k == 0 else k


# ---- drafters -------------------------------------------------------------------------------------
class MtpDrafter:
    """The MTP layer's drafts for one session. It sees each committed row's last-layer streams
    (Session calls observe) and keeps the window's worth of them; a draft first brings the MTP
    layer's window up to date from them (keys alone), then runs the block for the last row and
    the chained drafts; the chained rows' window entries are undone after (they came from drafts,
    not from the main model)."""

    def __init__(self, layer, context: int) -> None:
        self.layer = layer
        self.state = layer.new_state(context)
        g = layer.geometry
        self.window = layer.source.weights.block.shape.window
        N = g.attention.hc_mult
        self.ring = np.zeros((self.window, N, g.hidden), np.float32)   # main streams of position j at j % window
        self.known = np.full(self.window, -1, np.int64)                  # the position each ring row holds
        self.tokens: dict[int, int] = {}                                  # position -> token, the window's

    @property
    def nbytes(self) -> int:
        """The main rows it keeps and its window."""
        return self.ring.nbytes + self.known.nbytes + self.state.cache.nbytes

    def reset(self) -> None:
        """The session's state was replaced: nothing seen is valid."""
        self.known[:] = -1
        self.tokens.clear()
        self.state.cache.reset()
        self.state.exact = 0

    def observe(self, pos0: int, hidden: np.ndarray, tokens: list[int]) -> None:
        """Rows pos0, ... were committed with these tokens; hidden: their last layer's streams
        (fp32 [n, N * hidden])."""
        N, D = self.ring.shape[1:]
        for i, t in enumerate(tokens):
            j = pos0 + i
            self.ring[j % self.window] = hidden[i].reshape(N, D)
            self.known[j % self.window] = j
            self.tokens[j] = int(t)
        for j in [j for j in self.tokens if j <= pos0 + len(tokens) - 1 - self.window]:
            del self.tokens[j]

    def _streams(self, j: int) -> np.ndarray | None:
        return self.ring[j % self.window] if j >= 0 and self.known[j % self.window] == j else None

    def draft(self, k: int, position: int, token: int) -> list[int]:
        """k drafts for the tokens after `token` (to be fed at `position`); [] when there is no
        row before it to draft from."""
        last = position - 1                          # the MTP row of (main row P-1, token)
        X = self._streams(last)
        if k <= 0 or X is None:
            return []
        state, layer = self.state, self.layer
        first = max(state.exact, last - self.window + 1)
        rows = [j for j in range(first, last) if self._streams(j) is not None and j + 1 in self.tokens]
        if rows:
            for a, b in _runs(rows):
                layer.push(state, np.stack([self.ring[j % self.window] for j in range(a, b)]),
                           [self.tokens[j + 1] for j in range(a, b)], a)
        logits, out = layer.rows(state, X[None], [token], last)
        state.exact = last + 1
        drafts = [int(np.argmax(logits[0]))]
        if k > 1:
            journal = KVJournal(state.layers, last + 1, k - 1)
            for i in range(1, k):
                logits, out = layer.rows(state, out[:1].copy(), [drafts[-1]], last + i)
                drafts.append(int(np.argmax(logits[0])))
            journal.rollback(0)
        return drafts


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of sorted positions."""
    out, a = [], rows[0]
    for x, y in zip(rows, rows[1:] + [None]):
        if y != x + 1:
            out.append((a, x + 1))
            a = y
    return out


class OracleDrafter:
    """A draft that proposes the true next token (from a reference sequence: plain greedy
    output) with probability p, else another token: for measuring what acceptance buys, as
    random weights accept nothing. Seeded: a run reproduces."""

    nbytes = 0

    def __init__(self, truth: list[int], p: float, vocab: int, seed: int = 0) -> None:
        self.truth, self.p, self.vocab = list(truth), float(p), vocab
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def observe(self, pos0, hidden, tokens) -> None:
        pass

    def reset(self) -> None:
        pass

    def draft(self, k: int, position: int, token: int) -> list[int]:
        out = []
        for i in range(k):
            j = position + 1 + i
            true = self.truth[j] if j < len(self.truth) else 0
            out.append(true if self.rng.random() < self.p else (true + 1 + int(self.rng.integers(self.vocab - 1)))
                       % self.vocab)
        return out


# ---- acceptance -------------------------------------------------------------------------------------
def accept_draft(sampler, logits: np.ndarray, draft: int) -> tuple[bool, int]:
    """(kept, token) for a row whose logits judge `draft`: the token the row picks as a plain
    step would (greedy: its argmax; a sampler: its draw, one uniform of its stream), the draft
    kept when it is that token. Sampled, a draft is so kept with the probability the sampler's
    distribution gives it, and the token is always a draw from that distribution."""
    if sampler is None or sampler.plain_greedy:
        best = int(np.argmax(logits))
        return best == draft, best
    token = int(sampler.sample(logits))
    return token == draft, token


# ---- choosing k -------------------------------------------------------------------------------------
RECENT = 7           # measurements a cost estimate keeps: their median (a slow outlier moves it not at all)
SHADOW_FIRST = 8     # auto: shadow drafts (a draft beside a plain step, not verified) at least SHADOW_EVERY
SHADOW_EVERY = 1     # plain steps apart until this many, then at least SHADOW_LATER apart; and all of them
SHADOW_LATER = 32    # together within SHADOW_BUDGET of the plain steps' time (the first one aside)
SHADOW_BUDGET = 0.02
ROW_PRIOR = 0.5      # a verify row's cost beyond the first, in plain steps, before one is measured
DEPTH_PRIOR = 2      # a depth's acceptance starts as the first depth's, worth this many judgements
JUDGED_MEMORY = 64   # judgements at a depth beyond which the older ones count half: acceptance follows
                     # a conversation that changes (and what earlier runs on the engine measured fades)
EXPLORE_ACCEPTANCE = 0.6   # where drafts are kept this often, auto tries a k whose expected rate is within
EXPLORE_MARGIN = 0.85      # this share of the best's until it ran CONFIRM rounds: a cost measured once
CONFIRM = 3                # (or only estimated) is not yet the k's cost


class Recent:
    """The last RECENT measurements of a cost; add() returns their median."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=RECENT)

    def add(self, value: float) -> float:
        self.samples.append(float(value))
        ordered = sorted(self.samples)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def copy(self) -> "Recent":
        other = Recent()
        other.samples.extend(self.samples)
        return other


@dataclass
class SpecStats:
    """What speculation did in a run (the report's, the console's, /metrics')."""

    rounds: int = 0                # rounds with drafts
    drafted: int = 0               # drafts proposed
    accepted: int = 0              # drafts kept
    tokens: int = 0                # tokens those rounds gave (accepted + one each)
    draft_bytes: int = 0           # bytes the MTP layer read (shadow drafts included)
    draft_s: float = 0.0           # seconds in the MTP layer (shadow drafts included)
    verify_extra_bytes: int = 0    # bytes the verify passes read beyond a plain step's mean
    plain_steps: int = 0
    shadows: int = 0               # drafts made beside plain steps to measure acceptance
    shadow_hits: int = 0           # of them, the ones the plain step agreed with
    by_k: dict = field(default_factory=dict)   # k -> rounds
    by_depth: dict = field(default_factory=dict)   # depth -> [drafts judged there in rounds, kept]

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.tokens / self.rounds if self.rounds else None

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "acceptance": self.acceptance, "tokens_per_round": self.tokens_per_round,
                "draft_bytes": self.draft_bytes, "draft_s": self.draft_s,
                "verify_extra_bytes": self.verify_extra_bytes, "plain_steps": self.plain_steps,
                "shadows": self.shadows, "shadow_hits": self.shadow_hits,
                "by_k": {str(k): v for k, v in sorted(self.by_k.items())},
                "by_depth": {str(d): list(v) for d, v in sorted(self.by_depth.items())}}


class SpecController:
    """k per round: fixed, or (auto) the k of the highest expected tokens per second.

    Expected tokens of a round of k: 1 + a1 + a1 a2 + ... (a_d: the measured chance the draft at
    depth d is kept when the ones before it were, starting from the first depth's and worth
    DEPTH_PRIOR judgements of its own; past JUDGED_MEMORY judgements the older ones count half).
    Its seconds: measured for a k that ran, else the plain step's plus k times (a verify row's
    extra cost + a draft's) plus the pushing of its tokens' rows into the MTP layer's window that
    the next draft does first: the extra row's cost that of the nearest k that ran, ROW_PRIOR
    plain steps before any did. Every cost is the median of its last RECENT measurements, so one
    slow step (a disk stall, a first use) does not decide; where drafts are mostly kept, a k whose
    expected rate is close to the best's is tried until CONFIRM rounds measured it. The first
    depth's acceptance is learnt without paying for verification: while auto steps plainly it
    drafts beside a plain step now and then (a shadow draft, SHADOW_EVERY then SHADOW_LATER steps
    apart) and counts whether the step's token is the draft; after the first, a shadow is made
    only while all of them stay within SHADOW_BUDGET of the plain steps' time. So where drafts
    are not kept, auto stays plain and pays only the shadow drafts. learn_from starts a run from
    an earlier one's measurements (the same engine's)."""

    def __init__(self, mode: str | int, max_k: int = MAX_DRAFTS) -> None:
        self.mode = mode
        self.max_k = max_k if mode == "auto" else (0 if mode == "off" else int(mode))
        self.tries = np.zeros(MAX_DRAFTS + 1)                # depth d: drafts judged there (older ones
        self.hits = np.zeros(MAX_DRAFTS + 1)                 # halved past JUDGED_MEMORY), and kept
        self.plain_s: float | None = None                    # a plain step's seconds (Recent's median)
        self.plain_bytes: float | None = None
        self.draft_s: float | None = None                    # one draft's through the block
        self.push_s = 0.0                                    # one row's keys pushed into its window
        self.round_s: dict[int, float] = {}                  # k -> a round's
        self.rounds_at: dict[int, int] = {}                  # k -> rounds measured
        self._recent: dict = {}                              # what each figure is the median of
        self.plain_total = 0.0                               # seconds of every plain step
        self.shadow_s = 0.0                                  # and of every shadow draft
        self.since_shadow = 0
        self.stats = SpecStats()
        self.last_k = 0

    def learn_from(self, other: "SpecController") -> "SpecController":
        """Start from what `other` measured (an earlier run's controller on the same engine): the
        acceptance at each depth, the costs' recent measurements, the rounds at each k, the shadow
        drafts' account. Its SpecStats stay this run's own. Returns self."""
        self.tries, self.hits = other.tries.copy(), other.hits.copy()
        self._recent = {name: r.copy() for name, r in other._recent.items()}
        self.plain_s, self.plain_bytes, self.draft_s = other.plain_s, other.plain_bytes, other.draft_s
        self.push_s = other.push_s
        self.round_s, self.rounds_at = dict(other.round_s), dict(other.rounds_at)
        self.plain_total, self.shadow_s = other.plain_total, other.shadow_s
        return self

    def acceptance(self, depth: int) -> float:
        """Estimated chance the draft at `depth` (1..) is kept given the earlier ones were."""
        first = (self.hits[1] + 1) / (self.tries[1] + 2)
        if depth == 1:
            return first
        return (self.hits[depth] + DEPTH_PRIOR * first) / (self.tries[depth] + DEPTH_PRIOR)

    def _judged(self, depth: int, kept: bool) -> None:
        self.tries[depth] += 1
        self.hits[depth] += kept
        if self.tries[depth] > JUDGED_MEMORY:
            self.tries[depth] /= 2
            self.hits[depth] /= 2

    def _median(self, name, value: float) -> float:
        return self._recent.setdefault(name, Recent()).add(value)

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for d in range(1, k + 1):
            run *= self.acceptance(d)
            e += run
        return e

    def row_seconds(self, k: int) -> float:
        """A verify row's cost beyond the first in a round of k (drafting apart): that of the
        measured k nearest to it (the rows' expert union grows slower than their count, so a
        row costs less the more there are), ROW_PRIOR plain steps before any round ran."""
        if not self.round_s:
            return ROW_PRIOR * self.plain_s
        j = min(self.round_s, key=lambda m: (abs(m - k), -m))
        drafting = j * (self.draft_s or 0.0) + self.expected_tokens(j) * self.push_s
        return max(0.0, (self.round_s[j] - self.plain_s - drafting) / j)

    def round_seconds(self, k: int) -> float | None:
        """A round of k: measured, else the plain step's, k verify rows' and k drafts' seconds,
        and the catching up of its tokens' rows that the next draft does."""
        if k in self.round_s:
            return self.round_s[k]
        if self.plain_s is None:
            return None
        return (self.plain_s + k * (self.row_seconds(k) + (self.draft_s or 0.0))
                + self.expected_tokens(k) * self.push_s)

    def choose(self, limit: int) -> int:
        """Drafts for the next round (0: a plain step); limit: the most the run and session take."""
        k_max = min(self.max_k, limit)
        if k_max <= 0:
            return 0
        if self.mode != "auto":
            return k_max
        if self.plain_s is None:
            return 0
        rates = {0: 1.0 / self.plain_s}
        for k in range(1, k_max + 1):
            rates[k] = self.expected_tokens(k) / self.round_seconds(k)
        best = max(rates, key=lambda k: (rates[k], -k))
        if self.acceptance(1) >= EXPLORE_ACCEPTANCE:      # a close k whose cost is not settled yet
            close = [k for k in rates if k and k != best and self.rounds_at.get(k, 0) < CONFIRM
                     and rates[k] >= EXPLORE_MARGIN * rates[best]]
            if close:
                return max(close, key=lambda k: rates[k])
        return best

    def wants_shadow(self) -> bool:
        """auto, before a plain step: draft beside it this time (see the class)?"""
        if self.mode != "auto" or self.plain_s is None:
            return False
        self.since_shadow += 1
        if self.since_shadow < (SHADOW_EVERY if self.stats.shadows < SHADOW_FIRST else SHADOW_LATER):
            return False
        cost = (self.draft_s or 0.0) + self.since_shadow * self.push_s     # the rows since the last one too
        if self.stats.shadows and self.shadow_s + cost > SHADOW_BUDGET * self.plain_total:
            return False
        self.since_shadow = 0
        return True

    def record_shadow(self, kept: bool, seconds: float, bytes_read: int, push: tuple[float, int] = (0.0, 0)) -> None:
        """A shadow draft: whether the plain step's token was it, and what drafting it cost
        (push: of its seconds, catching the window up, and the rows it pushed)."""
        self._judged(1, bool(kept))
        self._draft_cost(1, seconds, bytes_read, push)
        self.shadow_s += seconds
        self.stats.shadows += 1
        self.stats.shadow_hits += bool(kept)

    def _draft_cost(self, k: int, seconds: float, bytes_read: int, push: tuple[float, int]) -> None:
        push_s, pushed = push
        self.draft_s = self._median("draft", (seconds - push_s) / k)
        if pushed:
            self.push_s = self._median("push", push_s / pushed)
        self.stats.draft_bytes += bytes_read
        self.stats.draft_s += seconds

    def record_plain(self, seconds: float, bytes_read: int) -> None:
        self.plain_s = self._median("plain", seconds)
        self.plain_bytes = self._median("plain_bytes", bytes_read)
        self.plain_total += seconds
        self.stats.plain_steps += 1
        self.last_k = 0

    def record_round(self, k: int, kept: int, tokens: int, seconds: float, verify_bytes: int, draft_bytes: int,
                     draft_s: float, push: tuple[float, int] = (0.0, 0)) -> None:
        """A round of k drafts: `kept` of them accepted, `tokens` emitted (kept + 1, fewer when the
        output ended), its seconds (drafts included) and bytes."""
        st = self.stats
        for d in range(1, min(k, kept + 1) + 1):      # the depths judged: up to the first rejection
            self._judged(d, d <= kept)
            st.by_depth.setdefault(d, [0, 0])
            st.by_depth[d][0] += 1
            st.by_depth[d][1] += d <= kept
        self.round_s[k] = self._median(("round", k), seconds)
        self.rounds_at[k] = self.rounds_at.get(k, 0) + 1
        self._draft_cost(k, draft_s, draft_bytes, push)
        st.rounds += 1
        st.drafted += k
        st.accepted += kept
        st.tokens += tokens
        st.verify_extra_bytes += max(0, int(verify_bytes - (self.plain_bytes or 0)))
        st.by_k[k] = st.by_k.get(k, 0) + 1
        self.last_k = k


# ---- a round ------------------------------------------------------------------------------------------
@dataclass
class Round:
    """One round's drafts and verification, before it is committed (finish_round)."""

    k: int                         # drafts asked for
    drafts: list[int]              # those made (fewer: no row to draft from)
    result: object                 # Session.verify's Rows: each row's records and logits, their costs
    picks: list[int]               # the token each usable row gives: accepted rows' and the one after
    kept: int                      # drafts accepted
    draft_bytes: int
    draft_s: float                 # drafting's seconds, catching the window up included
    push: tuple[float, int] = (0.0, 0)   # of them, catching up: seconds, rows pushed


def speculate(session, drafter, k: int, token: int, sampler=None) -> Round:
    """Draft k tokens after `token`, verify them with it in one pass, judge them in order."""
    drafts, draft_s, draft_bytes, push = _timed_draft(drafter, k, session.position, token)
    result = session.verify([token] + drafts)
    picks, kept = [], 0
    for i in range(len(drafts) + 1):     # the row after the last draft judges nothing (-1): its pick
        ok, nxt = accept_draft(sampler, result.logits[i], drafts[i] if i < len(drafts) else -1)
        picks.append(nxt)
        if not ok:
            break
        kept += 1
    return Round(k, drafts, result, picks, kept, draft_bytes, draft_s, push)


def _timed_draft(drafter, k: int, position: int, token: int) -> tuple[list[int], float, int, tuple[float, int]]:
    """drafter.draft(k, position, token), its seconds, the bytes the MTP layer read for it, and
    (seconds, rows) of its catching the window up."""
    layer = getattr(drafter, "layer", None)       # an oracle has none
    costs = layer.source.costs if layer is not None else None
    before = (costs.bytes_read, costs.push_seconds, costs.pushed) if costs is not None else (0, 0.0, 0)
    t0 = perf_counter()
    drafts = drafter.draft(k, position, token)
    seconds = perf_counter() - t0
    if costs is None:
        return drafts, seconds, 0, (0.0, 0)
    return drafts, seconds, costs.bytes_read - before[0], (costs.push_seconds - before[1], costs.pushed - before[2])


def finish_round(session, controller: "SpecController | None", rnd: Round, emitted: int, seconds: float) -> None:
    """Commit the round's first `emitted` rows (the output may have ended before its last pick)
    and tell the controller what it cost."""
    session.commit(emitted)
    if controller is None:
        return
    if not rnd.drafts:                 # nothing to draft from: it was a plain step
        controller.record_plain(seconds, rnd.result.costs.bytes_read)
    else:
        controller.record_round(len(rnd.drafts), rnd.kept, emitted, seconds, rnd.result.costs.bytes_read, rnd.draft_bytes,
                                rnd.draft_s, rnd.push)


def plain_step(session, controller: "SpecController | None", drafter, token: int, sampler=None):
    """A plain step (Session.step), with a shadow draft beside it when auto wants one (told to the
    controller with the step's own cost apart). Session.step's Step."""
    shadow, draft_s, draft_bytes, push = None, 0.0, 0, (0.0, 0)
    if controller is not None and drafter is not None and controller.wants_shadow():
        drafts, draft_s, draft_bytes, push = _timed_draft(drafter, 1, session.position, token)
        shadow = drafts[0] if drafts else None
    t0 = perf_counter()
    res = session.step(token, pick=None if sampler is None else sampler.sample)
    if controller is not None:
        controller.record_plain(perf_counter() - t0, res.costs.bytes_read)
        if shadow is not None:
            controller.record_shadow(shadow == res.next_token, draft_s, draft_bytes, push)
    return res


def decode(session, token: int, n: int, controller: "SpecController | None" = None, drafter=None,
           sampler=None) -> list[int]:
    """n tokens after `token` (fed at the session's position), greedy or with `sampler`: plain
    steps, or with a controller and a drafter rounds of the k it chooses. The tokens."""
    out: list[int] = []
    while len(out) < n:
        k = controller.choose(min(n - len(out), session.max_verify_rows) - 1) if controller and drafter else 0
        t0 = perf_counter()
        if k == 0:
            res = plain_step(session, controller, drafter, token, sampler)
            token = res.next_token
            out.append(token)
            continue
        rnd = speculate(session, drafter, k, token, sampler)
        finish_round(session, controller, rnd, len(rnd.picks), perf_counter() - t0)
        out += rnd.picks
        token = rnd.picks[-1]
    return out
