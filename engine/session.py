"""A session: one sequence's state on an engine (its position; the KV cache joins it with
attention). `eval(token)` runs the forward pass and returns the logits; `step(token)` also picks
the greedy next token and says what the token cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4f.engine.errors import Ds4fError
from ds4f.engine.model.attention import KVCache, attention_shapes
from ds4f.engine.model.forward import ForwardBuffers, forward, moe_sublayer


@dataclass
class StepResult:
    next_token: int
    ids: np.ndarray          # int32 [n_layers, top_k]  selected experts, rank order
    weights: np.ndarray      # fp32 [n_layers, top_k]
    hidden: np.ndarray       # fp32 [n_layers, width]  residual state after each layer (width: hc_mult x hidden)
    attn: np.ndarray         # fp32 [n_layers, hidden]  each layer's attention output ([n_layers, 0]: MoE-only)
    logits: np.ndarray       # fp32 [vocab]  the step's logits (the session's buffer)
    hits: int
    misses: int
    bytes_read: int
    stall_s: float
    disk_busy_s: float       # time in this step with at least one read in flight
    disk_depth_s: float      # time integral of reads in flight (/ step time = mean queue depth)
    reads: int = 0           # reads started during the step (experts, prefetch guesses, trunk layers)
    prefetch_hits: int = 0   # of the hits, those on an expert a prefetch guess brought in
                             # (hits - prefetch_hits: the cache policy's own hits)
    attention_s: float = 0.0  # the step's time in attention sublayers (hyper-connection mixing included)
    moe_s: float = 0.0        # in MoE sublayers, waiting for expert reads (stall_s) included
    head_s: float = 0.0       # in the head (hc reduction, final norm, vocabulary matvec)


class Session:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.geometry = engine.geometry
        self.source = engine.streamer
        self.buffers = ForwardBuffers(self.geometry)
        self.position = 0          # tokens evaluated so far
        self.context = engine.preset.context   # the most positions this session may reach
        att = self.geometry.attention
        self.kv = KVCache(attention_shapes(att, self.geometry.rms_norm_eps), self.context) if att else None

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes + self.kv_nbytes

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV cache, allocated for the whole context when the session starts."""
        return self.kv.nbytes if self.kv is not None else 0

    def eval(self, token_id: int) -> np.ndarray:
        """The logits after `token_id` (fp32 [vocab], the session's buffer: copy to keep)."""
        g = self.geometry
        if not 0 <= token_id < g.vocab:
            raise Ds4fError(f"token id {token_id} is outside the vocabulary (0..{g.vocab - 1})", param="token")
        if self.position >= self.context:
            raise Ds4fError(f"position {self.position} is past the context of {self.context} positions the preset"
                            f" {self.engine.preset.name!r} allocates (raise its `context`)", param="context")
        logits = forward(self.source, token_id, self.buffers, self.kv, self.position)
        self.position += 1
        return logits

    def moe_sublayer(self, layer: int, h: np.ndarray, token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One layer's MoE block alone on the residual h, as if `token_id` were at that layer:
        (ids, weights, y), y the session's buffer. Tests compare it with transformers' block."""
        self.source.start_token(token_id)
        ids, weights, y = moe_sublayer(self.source, layer, h, token_id, self.buffers)
        self.source.finish_layer(layer, ids)
        return ids, weights, y

    def step(self, token_id: int, pick=None) -> StepResult:
        """eval, the next token (greedy, or `pick(logits)`: a sampler's draw), and the token's
        reads, hits (those on prefetched experts apart) and stall."""
        cache, reader, source = self.engine.cache, self.engine.reader, self.source
        hits0 = sum(c.hits for c in cache.layers)
        misses0 = sum(c.misses for c in cache.layers)
        bytes0 = reader.expert_stats.totals()[1] + reader.trunk_stats.totals()[1]
        busy0, depth0 = reader.occupancy.totals()
        stall0 = source.stall_s
        prefetched0 = sum(source.prefetch_layer_hits)
        reads0 = reader.started_reads
        logits = self.eval(token_id)
        next_token = int(np.argmax(logits)) if pick is None else int(pick(logits))
        bytes1 = reader.expert_stats.totals()[1] + reader.trunk_stats.totals()[1]
        busy1, depth1 = reader.occupancy.totals()
        b = self.buffers
        return StepResult(next_token, b.ids, b.weights, b.hidden, b.attn, logits,
                          hits=sum(c.hits for c in cache.layers) - hits0,
                          misses=sum(c.misses for c in cache.layers) - misses0,
                          bytes_read=bytes1 - bytes0, stall_s=source.stall_s - stall0,
                          disk_busy_s=busy1 - busy0, disk_depth_s=depth1 - depth0,
                          reads=reader.started_reads - reads0,
                          prefetch_hits=sum(source.prefetch_layer_hits) - prefetched0,
                          attention_s=float(b.times[0]), moe_s=float(b.times[1]), head_s=float(b.times[2]))
