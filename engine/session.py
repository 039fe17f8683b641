"""A session: one sequence's state on an engine (its tokens, position and KV cache). `eval(token)`
runs the forward pass on it and returns the logits; `step(token)` also picks the next token and says
what the token cost; `prefill(tokens)` runs a chunk of prompt tokens layer by layer, with the same
records. All three are rows of the one forward pass (model.forward): a token is a step of one row.
`snapshot()` takes its state as a value (engine.session_state) and `restore(state)` puts one back:
the session then continues byte for byte as the one the state was taken from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.costs import Costs
from ds4f.engine.model.attention import KVCache, attention_shapes
from ds4f.engine.model.kv_journal import KVJournal, journal_limit
from ds4f.engine.batch import engine_counters
from ds4f.engine.model.forward import ChunkBuffers, Segment, forward_rows, moe_rows, prefill, transient_nbytes
from ds4f.engine.runtime.helper_thread import beside
from ds4f.engine.session_state import SessionState, canonical, put_layers, take_layers


@dataclass
class Row:
    """One row's record (views of the session's buffers: copy to keep). hidden and attn are there
    with full records, compact with compact ones (model.records): a prompt chunk's rows hold the
    kind its session was made for, a decode step's are full."""

    ids: np.ndarray          # int32 [n_layers, top_k]  selected experts, rank order
    weights: np.ndarray      # fp32 [n_layers, top_k]   their routing weights
    hidden: np.ndarray | None   # fp32 [n_layers, width]   residual state after each layer (width: hc_mult x hidden)
    attn: np.ndarray | None     # fp32 [n_layers, hidden]  each layer's attention output ([n_layers, 0]: MoE-only)
    logits: np.ndarray | None   # fp32 [vocab] (None: a prompt row of a chunk without full records)
    compact: tuple | None = None   # (digest uint64 [n_layers], hidden_sketch, attn_sketch or None)
    top: tuple | None = None       # (ids, values) [TOP_LOGITS]: its top logits, where logits is None


@dataclass
class Step(Row):
    """A decode step's row, the token picked after it and what the step cost."""

    next_token: int = -1
    costs: Costs = field(default_factory=Costs)


@dataclass
class Rows:
    """Rows computed together (a prefill chunk, a token and its drafts): their records (views of
    the session's buffers: copy to keep; hidden, attn, compact as in Row) and what they cost together."""

    ids: np.ndarray          # int32 [rows, n_layers, top_k]
    weights: np.ndarray      # fp32 [rows, n_layers, top_k]
    hidden: np.ndarray | None   # fp32 [rows, n_layers, width]
    attn: np.ndarray | None     # fp32 [rows, n_layers, hidden]
    logits: np.ndarray | None   # fp32 [rows, vocab]; None without full records (picks, top, last)
    last: np.ndarray         # fp32 [vocab]: the last row's logits
    costs: Costs
    compact: tuple | None = None   # (digest [rows, n_layers], hidden_sketch, attn_sketch or None)
    top: tuple | None = None       # (ids, values) [rows, TOP_LOGITS]: compact records' top logits
    picks: np.ndarray | None = None   # int64 [rows]: each row's greedy pick, without full records

    @classmethod
    def of(cls, buf: ChunkBuffers, n: int, costs: Costs) -> "Rows":
        """Rows 0..n-1 of `buf` after a step of n rows (views)."""
        views = buf.record_views(n)
        head = buf.head_rows(n)
        return cls(logits=head if views["picks"] is None else None, last=head[-1], costs=costs, **views)

    def row(self, c: int) -> Row:
        pick = (lambda a: None if a is None else a[c])
        compact = None if self.compact is None else tuple(pick(a) for a in self.compact)
        top = None if self.top is None else (self.top[0][c], self.top[1][c])
        return Row(self.ids[c], self.weights[c], pick(self.hidden), pick(self.attn), pick(self.logits), compact, top)

    def next_token(self, c: int, pick=None) -> int:
        """The token after row c: pick(its logits) (a sampler's draw), else the greedy one. Without
        full records only the last row's logits are there to draw from."""
        if self.logits is not None:
            return int(np.argmax(self.logits[c])) if pick is None else int(pick(self.logits[c]))
        if pick is None:
            return int(self.picks[c])
        if c != len(self.ids) - 1:
            raise Ds4fError(f"a draw for row {c} of {len(self.ids)}: only the last row's logits are kept",
                            kind="internal")
        return int(pick(self.last))


class Session:
    def __init__(self, engine, prefill_chunk: int = 0, records: str = "full") -> None:
        self.engine = engine
        self.geometry = engine.geometry
        self.source = engine.streamer
        self.buffers = ChunkBuffers(self.geometry, 1)   # a decode token's row
        self.prefill_chunk = prefill_chunk   # prompt tokens per prefill chunk (0: token by token only)
        # records: what a prompt chunk's rows keep per layer (model.records): full, compact, none
        self.chunk = ChunkBuffers(self.geometry, prefill_chunk, records) if prefill_chunk > 0 else None
        self.position = 0          # tokens evaluated so far
        self.tokens: list[int] = []                 # the tokens evaluated, in order
        self._logits: np.ndarray | None = None      # the logits after the last one (a view of a buffer)
        self.context = engine.preset.context   # the most positions this session may reach
        att = self.geometry.attention
        self.kv = KVCache(attention_shapes(att, self.geometry.rms_norm_eps), self.context) if att else None
        self.batcher = None        # the engine's StepBatcher once joined (engine.batch): steps shared
        self._kernels = None       # its own kernel settings in a batch (see `kernels`)
        self._batched = None       # the batcher's answer to the last step or chunk
        self.drafter = None        # engine.speculative's: told each row's last-layer streams
        self._verify_buf: ChunkBuffers | None = None   # a token and its drafts' rows (verify)
        self._journal: KVJournal | None = None          # what verify's rows overwrote, to undo
        self._pending: list[int] = []
        self.closed = False        # close(): its buffers let go

    @property
    def max_verify_rows(self) -> int:
        """The most rows verify takes: a token and its drafts, within what the KV journal can
        undo (the smallest window or compression ratio), and the context left."""
        if self.kv is None:
            return 1
        return max(1, min(journal_limit(self.kv.layers), self.context - self.position))

    @property
    def kernels(self):
        """The kernel backend and threads its rows are computed with (engine.KernelSettings): the
        engine's; in a batch its own, from the engine's when it joined unless set (a step holds
        rows of one setting and applies it, engine.batch), so a switch of one sequence is its own."""
        return self._kernels if self._kernels is not None else self.engine.kernels

    @kernels.setter
    def kernels(self, settings) -> None:
        self._kernels = settings

    def join(self, batcher) -> None:
        """Step together with the other sessions of `batcher` from the next token on."""
        if self._kernels is None:
            self._kernels = self.engine.kernels
        batcher.join(self)
        self.batcher = batcher

    def leave(self) -> None:
        """Step alone again (a session that ends leaves its batch)."""
        if self.batcher is not None:
            self.batcher.leave(self)
            self.batcher = None

    def close(self) -> None:
        """The session's end: out of its batch, and its buffers, KV cache and drafts let go now.
        A finished run's record outlives its session (its run, kept for status and reports, sits
        in reference cycles that only Python's cyclic collector frees, late), and the KV cache is
        the largest thing a run allocates (462 MiB at 32768 positions on DeepSeek-V4-Flash): its
        memory must not wait for that. Idempotent; a closed session computes nothing more."""
        self.leave()
        self.buffers = self.chunk = self.kv = self._verify_buf = self._journal = None
        self._batched = self._logits = self.drafter = None
        self.closed = True

    @property
    def nbytes(self) -> int:
        """Its buffers, the KV cache, and a prefill chunk's buffers with the temporaries of one of its
        layers (model.forward.transient_nbytes)."""
        if self.closed:
            return 0
        chunk = self.chunk.nbytes + transient_nbytes(self.geometry, self.chunk.chunk) if self.chunk is not None else 0
        drafts = (self._verify_buf.nbytes if self._verify_buf is not None else 0) + \
            (self.drafter.nbytes if self.drafter is not None else 0)
        return self.buffers.nbytes + self.kv_nbytes + chunk + drafts

    def enable_drafts(self, drafter) -> None:
        """Speculative decoding from here on (engine.speculative): the drafter sees every row
        the session computes, and the verify rows' buffers are allocated now (nbytes counts them)."""
        self.drafter = drafter
        if self.kv is not None and self._verify_buf is None:
            self._verify_buf = ChunkBuffers(self.geometry, self.max_verify_rows)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV cache, allocated for the whole context when the session starts."""
        return self.kv.nbytes if self.kv is not None else 0

    def eval(self, token_id: int) -> np.ndarray:
        """The logits after `token_id` (fp32 [vocab], the session's buffer: copy to keep)."""
        self._check_tokens([token_id])
        b = self.buffers
        if self.batcher is not None:
            self._batched = self.batcher.compute(self, [token_id], b)
        else:
            forward_rows(self.source, [Segment([token_id], self.position, self.kv)], b, None, beside)
        logits = b.logits[0]
        if self.drafter is not None:
            self.drafter.observe(self.position, b.last_states(1), [token_id])
        self.position += 1
        self.tokens.append(int(token_id))
        self._logits = logits
        return logits

    def moe_sublayer(self, layer: int, h: np.ndarray, token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One layer's MoE block alone on the residual h, as if `token_id` were at that layer:
        (ids, weights, y), y the session's buffer. Tests compare it with transformers' block."""
        ids, weights, y = moe_rows(self.source, layer, h[None], [token_id], self.buffers)
        return ids[0], weights[0], y[0]

    def step(self, token_id: int, pick=None) -> Step:
        """eval, the next token (greedy, or `pick(logits)`: a sampler's draw), and the token's
        reads, hits (those on prefetched experts apart) and stall."""
        before = self._counters()
        logits = self.eval(token_id)
        next_token = int(np.argmax(logits)) if pick is None else int(pick(logits))
        b = self.buffers
        return Step(b.ids[0], b.weights[0], b.hidden[0], b.attn[0], logits, next_token=next_token,
                    costs=self._costs(before, b.times))

    def prefill(self, token_ids: list[int], should_stop=None) -> Rows:
        """A chunk of prompt tokens through the model layer by layer (model.forward): the same
        records and logits as step() on each in turn, each chosen expert read once for the chunk.
        At most `prefill_chunk` tokens; the chunk's reads, hits and stall together. should_stop:
        asked before each layer; True stops the chunk with model.forward.Stopped, and the session
        is not to be used further (its KV cache holds part of the chunk)."""
        n = len(token_ids)
        if self.chunk is None or not 0 < n <= self.chunk.chunk:
            raise Ds4fError(f"a chunk of {n} prompt tokens; this session takes 1 to {self.prefill_chunk}",
                            param="prompt")
        self._check_tokens(token_ids)
        before = self._counters()
        b = self.chunk
        if self.batcher is not None:
            self._batched = self.batcher.compute(self, list(token_ids), b, should_stop, prompt=True)
        else:
            prefill(self.source, list(token_ids), b, self.kv, self.position, should_stop, beside)
        if self.drafter is not None:
            self.drafter.observe(self.position, b.last_states(n), list(token_ids))
        self.position += n
        self.tokens += [int(t) for t in token_ids]
        rows = Rows.of(b, n, self._costs(before, b.times))
        self._logits = rows.last
        return rows

    def verify(self, token_ids: list[int]) -> Rows:
        """A token and the drafts after it as rows at this session's position, in one layer-major
        pass (each layer's experts read once for all of them): each row's records and logits
        byte for byte those of step() on it. The rows are not yet the session's: commit(keep)
        takes the first `keep` of them and undoes the others in the KV cache exactly."""
        n = len(token_ids)
        if self.kv is None or self.batcher is not None:
            raise Ds4fError("verify needs a session of the whole model stepping alone", kind="internal")
        if not 0 < n <= self.max_verify_rows:
            raise Ds4fError(f"verify of {n} rows; this session takes 1 to {self.max_verify_rows}", kind="internal")
        self._check_tokens(token_ids)
        if self._verify_buf is None or self._verify_buf.chunk < n:
            self._verify_buf = ChunkBuffers(self.geometry, self.max_verify_rows)
        b = self._verify_buf
        before = self._counters()
        self._journal = KVJournal(self.kv.layers, self.position, n)
        self._pending = [int(t) for t in token_ids]
        prefill(self.source, list(token_ids), b, self.kv, self.position, None, beside)
        return Rows.of(b, n, self._costs(before, b.times))

    def commit(self, keep: int) -> None:
        """The first `keep` rows of the last verify become the session's (1 <= keep <= its rows;
        the logits after the last kept one are the session's); the later rows are undone."""
        if self._journal is None:
            raise Ds4fError("commit without a verify before it", kind="internal")
        journal, self._journal = self._journal, None
        if not 1 <= keep <= len(self._pending):
            raise Ds4fError(f"commit of {keep} rows of a verify of {len(self._pending)}", kind="internal")
        journal.rollback(keep)
        kept = self._pending[:keep]
        if self.drafter is not None:
            self.drafter.observe(self.position, self._verify_buf.last_states(keep), kept)
        self.position += keep
        self.tokens += kept
        self._logits = self._verify_buf.logits[keep - 1]

    def snapshot(self) -> SessionState:
        """This session's state now, as a value (copies: the session goes on without changing it)."""
        if self.kv is None:
            raise Ds4fError("a session without attention (the MoE half alone) has no state to keep", param="state")
        logits = None if self._logits is None else self._logits.copy()
        return SessionState(tuple(self.tokens), logits, take_layers(self.kv), canonical(self.geometry.to_config()),
                            self.engine.fingerprint, self.kernels.backend)

    def restore(self, state: SessionState) -> None:
        """Put `state` back: this session is then at its position, with its tokens, logits and
        KV cache, whatever it held before. Refused (and this session left as it was) when the
        state belongs to another model or checkpoint, or passes this session's context."""
        if self.kv is None:
            raise Ds4fError("a session without attention (the MoE half alone) has no state to restore",
                            param="state")
        if state.geometry != canonical(self.geometry.to_config()):
            raise Ds4fError("the session state belongs to another model geometry", param="state")
        if state.checkpoint != self.engine.fingerprint:
            raise Ds4fError("the session state belongs to another checkpoint", param="state")
        if state.position > self.context:
            raise Ds4fError(f"the session state is at position {state.position}, past the context of"
                            f" {self.context} positions the preset {self.engine.preset.name!r} allocates",
                            param="context")
        if state.position and state.logits is None:
            raise Ds4fError("the session state has no logits for its last token", param="state")
        put_layers(state.layers, self.kv)
        self.position, self.tokens = state.position, list(state.tokens)
        self._journal = None
        if self.drafter is not None:    # the rows it saw are not this state's
            self.drafter.reset()
        if state.logits is None:
            self._logits = None
        else:
            self.buffers.logits[0] = state.logits
            self._logits = self.buffers.logits[0]

    @property
    def logits(self) -> np.ndarray | None:
        """The logits after the last token evaluated (fp32 [vocab], a buffer: copy to keep); None at
        position 0."""
        return self._logits

    def _check_tokens(self, token_ids) -> None:
        """The ids are in the vocabulary and their positions (from the session's) within the context."""
        g = self.geometry
        bad = [t for t in token_ids if not 0 <= t < g.vocab]
        if bad:
            raise Ds4fError(f"token id {bad[0]} is outside the vocabulary (0..{g.vocab - 1})", param="token")
        last = self.position + len(token_ids) - 1
        if last >= self.context:
            raise Ds4fError(f"position {last} is past the context of {self.context} positions the preset"
                            f" {self.engine.preset.name!r} allocates (raise its `context`)", param="context")

    def _counters(self) -> list:
        return engine_counters(self.engine)

    def _costs(self, before: list, times: np.ndarray) -> Costs:
        """What the reads, the cache and the waits did for the last step or chunk: since `before`
        (a _counters()) alone, the batcher's share of its steps when batched; its times by part."""
        req = self._batched
        if self.batcher is None or req is None:
            return Costs.between(before, self._counters(), times)
        return req.costs
