"""Several sequences stepping together: one forward pass over their rows (model.forward).

Sessions of one engine join its StepBatcher; a joined session's step() and prefill() hand their
rows to it and wait. The batcher's thread gathers what the members asked for (until every member
has asked, or GATHER_S after the first did), forms a step of at most `cap` sequences (those that
waited longest first): decode tokens and prompt chunks go in steps of their own, taking turns
while both wait (a chunk takes at most rows - parallel rows, its remainder goes in its next
steps), so the sequences already decoding keep streaming and a new prompt waits for one decode
step at most; it runs the step and hands each member its rows' records, logits and share of the
step's reads. Each member computes with its own kernel backend and threads (Session.kernels): a
step holds the rows of one setting (the longest waiting member's) and applies it, so switching
one sequence's kernels changes no other's numbers.

Each row's numbers are those it gets alone, whatever else is in the step (model.forward), so a
sequence's tokens and state dump do not depend on who it shared steps with. A step of one row
(a decode token, or the last row of a prompt chunk) is computed in the session's own buffers,
streamed as a token (runtime.streamer); any other in the batcher's, with each segment's failures
isolated: a sequence whose row fails (a NaN, a corrupt expert read) gets its error, the others go on.

Knowing when it pays: the batcher keeps the seconds of decode steps by the number of sequences
in them. When a step of k sequences takes at least as long as k steps of one (the union of
their experts costs more than the trunk they share saves), it caps steps below the smallest such
k, says why, and tries one more every PROBE_STEPS steps (the cache warms, the mix
changes). Members beyond the cap take turns.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.config import AUTO_CHUNK
from ds4f.engine.costs import COUNTS, WAITS, Costs, split_whole
from ds4f.engine.model.forward import ChunkBuffers, Segment, Stopped, forward_rows
from ds4f.engine.runtime.helper_thread import beside

STEP_PROMPT_ROWS = 64  # prompt rows a batched step takes at most: a long prompt goes in several steps,
                       # the sequences already decoding keep streaming between them
GATHER_S = 0.05        # how long a step waits for members still busy with their last token, at most
GATHER_SHARE = 0.25    # and at most this share of the last step's time
PROBE_STEPS = 64       # steps between tries of one sequence more than the cap
PROBE_FIRST = 8        # decode steps before a step of one is measured, when none came by itself
EWMA = 0.25            # weight of a new step's seconds in the running means


def step_rows(parallel: int, prefill_chunk: int) -> int:
    """The rows a batched step holds: a decode row for each sequence, and a prompt chunk."""
    return parallel + batched_chunk(prefill_chunk)


def batched_chunk(prefill_chunk: int) -> int:
    """The prompt chunk of a session in a batch (its records' buffers), and of a step ("auto",
    AUTO_CHUNK: the most a step takes)."""
    return STEP_PROMPT_ROWS if prefill_chunk == AUTO_CHUNK else max(1, min(prefill_chunk, STEP_PROMPT_ROWS))


@dataclass
class _Request:
    """A member's rows waiting for the batcher: tokens at positions pos0, pos0 + 1, ...; the
    records land in `out` (the session's ChunkBuffers, from row 0)."""

    session: object
    token_ids: list[int]
    pos0: int
    out: object
    should_stop: object = None
    prompt: bool = False         # a prompt chunk (else a decode token)
    asked_at: float = field(default_factory=time.monotonic)
    done_rows: int = 0
    costs: Costs = field(default_factory=lambda: Costs(batch_steps=0))   # its rows' shares of the steps'
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def left(self) -> int:
        return len(self.token_ids) - self.done_rows


@dataclass(frozen=True)
class BatchFigures:
    """What the batcher measured (a cheap copy for snapshots and /metrics)."""

    parallel: int                 # sequences a step may hold, as configured
    rows: int                     # rows a step may hold
    cap: int                      # sequences a step holds now (<= parallel)
    cap_reason: str               # why, when below parallel
    members: int                  # sequences joined
    steps: int                    # steps run
    shared_steps: int             # steps of more than one sequence
    rows_total: int               # rows computed
    last_rows: int                # rows in the last step
    last_sequences: int           # sequences in the last step
    union_per_layer: float        # distinct experts per layer in the last step (mean over layers)
    union_sum: float              # union_per_layer summed over the steps run (over steps: the mean)
    tokens_per_s: float | None    # rows per second over the recent steps (all sequences)
    step_s_by_sequences: dict     # k -> running mean seconds of a decode step of k sequences


class StepBatcher:
    def __init__(self, engine, parallel: int, rows: int) -> None:
        if parallel < 1 or rows < parallel:
            raise ValueError(f"a batcher for {parallel} sequences in {rows} rows")
        self.engine = engine
        self.parallel = parallel
        self.rows = rows
        self.buffers = ChunkBuffers(engine.geometry, rows)
        self.cap = parallel
        self.cap_reason = ""
        self._members: set = set()
        self._pending: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._steps = self._shared_steps = self._rows_total = 0
        self._last = (0, 0, 0.0)                 # rows, sequences, union per layer
        self._rate: float | None = None          # rows per second, running mean
        self._step_s: dict[int, float] = {}      # sequences in a decode step -> running mean seconds
        self._capped_at = 0                      # the step count when the cap last changed or was probed
        self._decode_steps = 0
        self._last_prompt = False                # the last step was a prompt step
        self._union_sum = 0.0
        self._last_s = GATHER_S / GATHER_SHARE   # the last step's seconds

    @staticmethod
    def nbytes_for(g, rows: int) -> int:
        return ChunkBuffers.nbytes_for(g, rows)

    # -- members ----------------------------------------------------------------------------------
    def join(self, session) -> None:
        with self._cond:
            if self._closed:
                raise Ds4fError("the engine is closing", kind="busy")
            if len(self._members) >= self.parallel:
                raise Ds4fError(f"{len(self._members)} sequences step together already (parallel"
                                f" {self.parallel})", kind="busy")
            self._members.add(session)
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="ds4f-batch", daemon=True)
                self._thread.start()

    def leave(self, session) -> None:
        with self._cond:
            self._members.discard(session)
            self._cond.notify_all()

    def nbytes_beside(self, session) -> int:
        """The step's buffers and the members' buffers and KV caches, `session`'s apart."""
        with self._cond:
            others = [m for m in self._members if m is not session]
        return self.buffers.nbytes + sum(m.nbytes for m in others)

    @property
    def members(self) -> int:
        with self._cond:
            return len(self._members)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    # -- a member's rows ---------------------------------------------------------------------------
    def compute(self, session, token_ids: list[int], out, should_stop=None, prompt: bool = False) -> _Request:
        """Hand the session's next rows to the batcher and wait for them (records into `out`, the
        session's ChunkBuffers, rows from 0, kept as its kind: ChunkBuffers.put_row);
        prompt: they are a prompt chunk (Session.prefill), else a decode token."""
        req = _Request(session, list(token_ids), session.position, out, should_stop, prompt=prompt)
        with self._cond:
            if session not in self._members:
                raise Ds4fError("the session is not one of the batch's", kind="internal")
            self._pending.append(req)
            self._cond.notify_all()
        req.finished.wait()
        if req.error is not None:
            raise req.error
        return req

    # -- the batcher's thread ------------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for req in self._pending:
                        req.error = Ds4fError("the engine closed", kind="busy")
                        req.finished.set()
                    self._pending.clear()
                    return
                deadline = time.monotonic() + min(GATHER_S, GATHER_SHARE * self._last_s)
                while len({r.session for r in self._pending}) < len(self._members) and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                plan = self._plan()
            self._step(plan)

    def _plan(self) -> list[tuple[_Request, int]]:
        """(request, rows) of the next step: at most `cap` sequences, longest waiting first. Decode
        tokens and prompt chunks go in steps of their own, taking turns while both wait: the
        sequences decoding get a token between a prompt's chunks (each at most rows - parallel),
        and a new prompt waits for at most the decode step in flight."""
        reqs = sorted(self._pending, key=lambda r: r.asked_at)
        kernels = reqs[0].session.kernels        # a step computes with one kernel setting: the longest waiting's
        reqs = [r for r in reqs if r.session.kernels == kernels]
        cap = self.cap
        if self._steps - self._capped_at >= PROBE_STEPS:
            self._capped_at = self._steps
            if 1 not in self._step_s and self._decode_steps >= PROBE_FIRST:
                cap = 1                                # measure a step of one, the yardstick
            elif cap < self.parallel:
                cap += 1                               # try one more now and then
        decode = [r for r in reqs if not r.prompt]
        prompts = [r for r in reqs if r.prompt]
        if decode and (not prompts or self._last_prompt):
            self._last_prompt = False
            return [(r, 1) for r in decode[:cap]]
        self._last_prompt = True
        budget, plan = self.rows - self.parallel, []
        for r in prompts[:cap]:
            if budget <= 0:
                break
            k = min(r.left, budget)
            budget -= k
            plan.append((r, k))
        return plan

    def _step(self, plan: list[tuple[_Request, int]]) -> None:
        eng = self.engine
        n = sum(k for _, k in plan)
        costs_before = engine_counters(eng)
        t0 = time.perf_counter()
        with eng.compute_lock:
            try:
                eng.use_kernels(plan[0][0].session.kernels)   # its sequences' own (_plan: one setting a step)
                if len(plan) == 1 and n == 1:
                    errors = self._alone(plan[0][0])
                    union = float(eng.geometry.top_k)
                else:
                    errors, union = self._rows(plan, n)
            except BaseException as exc:   # the step itself failed: each of its sequences says so
                if not isinstance(exc, (Ds4fError, Stopped)):
                    exc = Ds4fError(f"internal error in a batched step: {type(exc).__name__}: {exc}")
                errors = {id(r): exc for r, _ in plan}
                union = 0.0
        seconds = time.perf_counter() - t0
        delta = [a - b for a, b in zip(engine_counters(eng), costs_before)]
        self._account(plan, n, seconds, union, dict(zip(COUNTS + WAITS, delta)), errors)

    def _alone(self, req: _Request) -> dict:
        """One row of one sequence (a decode token, or the last of a prompt chunk): computed in
        the session's own one-row buffers, its record copied where the request wants it (for a
        decode token, onto itself)."""
        s, b, i = req.session, req.session.buffers, req.done_rows
        forward_rows(s.source, [Segment([req.token_ids[i]], req.pos0 + i, s.kv)], b, None, beside)
        req.out.put_row(i, b.ids[0], b.weights[0], b.hidden[0], b.attn[0], b.logits[0], i == len(req.token_ids) - 1)
        _add_times(req.costs, b.times)
        return {}

    def _rows(self, plan: list[tuple[_Request, int]], n: int) -> tuple[dict, float]:
        buf = self.buffers
        segments = [Segment(r.token_ids[r.done_rows:r.done_rows + k], r.pos0 + r.done_rows, r.session.kv)
                    for r, k in plan]
        stop = plan[0][0].should_stop if len(plan) == 1 else None
        forward_rows(self.engine.streamer, segments, buf, stop, beside, isolate=True)
        errors, row = {}, 0
        for (r, k), seg in zip(plan, segments):
            if seg.error is not None:
                errors[id(r)] = seg.error
            else:
                for i in range(k):
                    j = r.done_rows + i
                    r.out.put_row(j, buf.ids[row + i], buf.weights[row + i], buf.hidden[row + i], buf.attn[row + i],
                                  buf.logits[row + i], j == len(r.token_ids) - 1)
            _add_times(r.costs, buf.times * (k / n))
            row += k
        union = float(np.mean([len(np.unique(buf.ids[:n, layer])) for layer in range(buf.ids.shape[1])]))
        return errors, union

    def _account(self, plan, n: int, seconds: float, union: float, delta: dict, errors: dict) -> None:
        shares = {k: split_whole(delta[k], n) for k in COUNTS}
        decode = not any(r.prompt for r, _ in plan)
        with self._cond:
            self._steps += 1
            self._rows_total += n
            shared = len(plan) > 1
            self._shared_steps += shared
            self._last = (n, len(plan), union)
            self._last_s = seconds
            self._union_sum += union
            rate = n / seconds if seconds > 0 else None
            if rate is not None:
                self._rate = rate if self._rate is None else (1 - EWMA) * self._rate + EWMA * rate
            if decode and not errors:
                k = len(plan)
                old = self._step_s.get(k)
                self._step_s[k] = seconds if old is None else (1 - EWMA) * old + EWMA * seconds
                self._decode_steps += 1
                self._decide_cap()
            row = 0
            for r, k in plan:
                c = r.costs
                for key in COUNTS:
                    setattr(c, key, getattr(c, key) + sum(shares[key][row:row + k]))
                for key in WAITS:
                    setattr(c, key, getattr(c, key) + delta[key] * k / n)
                row += k
                c.batch_steps += 1
                c.batch_shared += shared
                r.done_rows += k
                err = errors.get(id(r))
                if err is not None or r.left == 0:
                    r.error = err
                    self._pending.remove(r)
                    r.finished.set()

    def _decide_cap(self) -> None:
        """Cap steps below the smallest size whose decode step took at least as long as that many
        steps of one (no cap until a one-sequence step has been measured)."""
        alone = self._step_s.get(1)
        if alone is None:
            return
        losing = sorted(j for j, s in self._step_s.items() if j > 1 and s >= j * alone)
        cap = losing[0] - 1 if losing else self.parallel
        if cap != self.cap:
            self._capped_at = self._steps
        self.cap = cap
        self.cap_reason = "" if not losing else (
            f"a step of {losing[0]} sequences took {self._step_s[losing[0]]:.3f} s, {losing[0]} steps of one"
            f" {losing[0] * alone:.3f} s: the union of their experts costs more than their shared trunk saves")

    def figures(self) -> BatchFigures:
        with self._cond:
            rows, seqs, union = self._last
            return BatchFigures(self.parallel, self.rows, self.cap, self.cap_reason, len(self._members), self._steps,
                                self._shared_steps, self._rows_total, rows, seqs, union, self._union_sum, self._rate,
                                dict(sorted(self._step_s.items())))


def _add_times(costs: Costs, times) -> None:
    """A forward pass's seconds by part (model.forward's times) added to a request's costs."""
    costs.attention_s += float(times[0])
    costs.moe_s += float(times[1])
    costs.head_s += float(times[2])


def engine_counters(eng) -> list:
    """The engine's running totals that a step's costs are the differences of (costs.COUNTS, WAITS)."""
    cache, reader, source = eng.cache, eng.reader, eng.streamer
    busy, depth = reader.occupancy.totals()
    return [sum(c.hits for c in cache.layers), sum(c.misses for c in cache.layers),
            reader.expert_stats.totals()[1] + reader.trunk_stats.totals()[1], reader.started_reads,
            sum(source.prefetch_layer_hits), source.stall_s, busy, depth]
