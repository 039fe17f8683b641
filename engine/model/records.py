"""What a step keeps of its rows layer by layer: the records a state dump writes.

Three kinds, by what the run writes (runs.statedump's dump modes):

- full: each layer's state after it (hc_mult x hidden floats) and its attention output (hidden
  floats): 3.4 MiB a token on DeepSeek-V4-Flash, for a full dump and for the checks that compare
  layer states with transformers';
- compact: per layer a 64-bit digest of those exact bits and a sketch of each (max |x|, rms and
  the projections on a few fixed directions): 1.9 KiB a token there, what a compact dump holds;
- none: nothing per layer (a run without a dump).

Every kind keeps the routing (ids, weights) and the last layer's state (what the drafter of
speculative decoding reads). Full records keep every row's logits; the others each row's greedy
pick, its top logits (compact), and the last row's logits whole (what a sampler draws from after
the prompt). A compact record made here, layer by layer as the forward pass finishes each, is bit
for bit the one made from the full record afterwards (the same functions, on the same rows): a
prompt chunk then holds 0.69 MiB a token on DeepSeek-V4-Flash, not 4.4, and the chunk that fits
the memory plan grows by as much.
"""
from __future__ import annotations

import hashlib

import numpy as np

RECORD_KINDS = ("full", "compact", "none")
RECORDS_OF_DUMP = {"full": "full", "compact": "compact", "off": "none"}   # a dump mode's records

HIDDEN_DIRECTIONS = 4     # a compact record's fixed directions per layer state
ATTN_DIRECTIONS = 1       # and per attention output
HIDDEN_SKETCH = 2 + HIDDEN_DIRECTIONS   # max |x|, rms(x), then x on each direction
ATTN_SKETCH = 2 + ATTN_DIRECTIONS
SKETCH_ROWS = 32          # rows sketched at a time (their float64 copies: 4 MiB on flash)
TOP_LOGITS = 8            # a record keeps the step's TOP_LOGITS largest logits and their token ids

_directions_cache: dict[tuple[int, int], np.ndarray] = {}


def directions(width: int, n: int) -> np.ndarray:
    """n fixed directions of `width` coordinates, each +-1/sqrt(width) (float64 [n, width]): the
    signs from a splitmix64 of (direction, coordinate), so every ds4f and every machine has the
    same ones."""
    key = (width, n)
    if key not in _directions_cache:
        i = np.arange(width, dtype=np.uint64)
        out = np.empty((n, width), np.float64)
        with np.errstate(over="ignore"):
            for j in range(n):
                z = i + np.uint64(j + 1) * np.uint64(0x9E3779B97F4A7C15)
                z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                z ^= z >> np.uint64(31)
                out[j] = 1.0 - 2.0 * (z & np.uint64(1)).astype(np.float64)
        out /= np.sqrt(width)
        _directions_cache[key] = out
    return _directions_cache[key]


def sketch(x: np.ndarray, n_directions: int) -> np.ndarray:
    """Per row of x (fp32 [rows, width]): max |x|, rms(x), then x on each of the fixed directions;
    float64 sums in numpy's fixed pairwise order (no BLAS: its order may change with the thread
    count), rounded to fp32 [rows, 2 + n_directions]. A row's sketch depends on that row alone.
    A NaN or Inf in a row shows in its sketch."""
    x64 = np.asarray(x, np.float64)
    out = np.empty((x64.shape[0], 2 + n_directions), np.float64)
    if x64.shape[1] == 0:
        out[:] = 0.0
        return out.astype(np.float32)
    out[:, 0] = np.abs(x64).max(axis=1)
    out[:, 1] = np.sqrt((x64 * x64).sum(axis=1) / x64.shape[1])
    for j, d in enumerate(directions(x64.shape[1], n_directions)):
        out[:, 2 + j] = (x64 * d).sum(axis=1)
    return out.astype(np.float32)


def state_digest(hidden: np.ndarray, attn: np.ndarray | None) -> int:
    """A 64-bit hash (blake2b) of one layer's state's exact bits, then its attention output's.
    Equal digests: the same bits (but for a 2^-64 chance)."""
    h = hashlib.blake2b(np.ascontiguousarray(hidden, np.float32).tobytes(), digest_size=8)
    if attn is not None:
        h.update(np.ascontiguousarray(attn, np.float32).tobytes())
    return int.from_bytes(h.digest(), "little")


def layer_digests(hidden: np.ndarray, attn: np.ndarray | None) -> np.ndarray:
    """Per layer of one token's record (fp32 [n_layers, width], [n_layers, hidden] or None):
    state_digest, uint64 [n_layers]."""
    return np.array([state_digest(hidden[layer], None if attn is None else attn[layer])
                     for layer in range(len(hidden))], np.uint64)


def top_logits(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The TOP_LOGITS largest logits, largest first, equal values by lower token id: (ids, values)."""
    k = min(TOP_LOGITS, len(logits))
    part = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    order = np.lexsort((part, -logits[part]))
    ids = np.full(TOP_LOGITS, -1, np.int32)
    values = np.full(TOP_LOGITS, -np.inf, np.float32)
    ids[:k], values[:k] = part[order], logits[part[order]]
    return ids, values


def compact_of(hidden: np.ndarray, attn: np.ndarray | None) -> tuple:
    """One token's compact record from its full one (hidden fp32 [n_layers, width], attn fp32
    [n_layers, hidden]; None: a MoE-only model): (digest uint64 [n_layers], hidden_sketch fp32
    [n_layers, HIDDEN_SKETCH], attn_sketch fp32 [n_layers, ATTN_SKETCH] or None)."""
    return (layer_digests(hidden, attn), sketch(hidden, HIDDEN_DIRECTIONS),
            None if attn is None else sketch(attn, ATTN_DIRECTIONS))


class CompactLayers:
    """The compact records of a buffer's rows: digest uint64 [rows, n_layers], hidden_sketch fp32
    [rows, n_layers, HIDDEN_SKETCH], attn_sketch fp32 [rows, n_layers, ATTN_SKETCH] (None: a
    MoE-only model, whose digests cover the state alone)."""

    def __init__(self, rows: int, n_layers: int, attention: bool) -> None:
        self.digest = np.zeros((rows, n_layers), np.uint64)
        self.hidden_sketch = np.zeros((rows, n_layers, HIDDEN_SKETCH), np.float32)
        self.attn_sketch = np.zeros((rows, n_layers, ATTN_SKETCH), np.float32) if attention else None

    @staticmethod
    def nbytes_for(rows: int, n_layers: int, attention: bool) -> int:
        return rows * n_layers * (8 + 4 * HIDDEN_SKETCH + (4 * ATTN_SKETCH if attention else 0))

    def keep_layer(self, layer: int, hidden: np.ndarray, attn: np.ndarray | None, n: int) -> None:
        """Rows 0..n-1 at `layer`: their states hidden fp32 [n, width] and attention outputs attn
        fp32 [n, hidden] (None: MoE-only)."""
        for c in range(n):
            self.digest[c, layer] = state_digest(hidden[c], None if attn is None else attn[c])
        for a in range(0, n, SKETCH_ROWS):
            b = min(n, a + SKETCH_ROWS)
            self.hidden_sketch[a:b, layer] = sketch(hidden[a:b], HIDDEN_DIRECTIONS)
            if self.attn_sketch is not None:
                self.attn_sketch[a:b, layer] = sketch(attn[a:b], ATTN_DIRECTIONS)

    def keep_row(self, i: int, hidden: np.ndarray, attn: np.ndarray | None) -> None:
        """Row i from its full record (hidden fp32 [n_layers, width], attn [n_layers, hidden])."""
        digest, hidden_sketch, attn_sketch = compact_of(hidden, attn if self.attn_sketch is not None else None)
        self.digest[i], self.hidden_sketch[i] = digest, hidden_sketch
        if attn_sketch is not None:
            self.attn_sketch[i] = attn_sketch

    def rows(self, n: int) -> tuple:
        """(digest, hidden_sketch, attn_sketch) of rows 0..n-1 (views)."""
        return (self.digest[:n], self.hidden_sketch[:n],
                None if self.attn_sketch is None else self.attn_sketch[:n])
