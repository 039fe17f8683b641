"""A routing trace: for each token and layer, the experts the router chose (rank order).

It comes from a run's state dump (ds4f.runs.traces reads it) or from a compact export
(`ds4f trace export`, an .npz, read and written here).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.safe_read import open_regular
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.runtime.cache_book import PAGE
from ds4f.engine.runtime.schedule import chunk_layer_keys, token_request_order

TRACE_FORMAT = "ds4f.trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    geometry: Geometry
    ids: np.ndarray          # int32 [tokens, n_layers, top_k], routing-rank order
    tokens: np.ndarray       # int32 [tokens], the token fed at each step
    source: str = ""
    prefill: int = 0         # the first `prefill` tokens went through layer-major prefill chunks
    chunk: int = 0           # of `chunk` tokens each (runtime.schedule's chunk request order)

    def chunks(self) -> list[tuple[int, int]]:
        """The (start, end) token ranges of the prefill chunks of more than one token. A chunk of
        one (the prompt's last, when the chunk size does not divide it) streams as a token does
        (runtime.streamer), so it is one of the tokens after the chunks."""
        if not self.prefill or not self.chunk:
            return []
        return [(a, min(a + self.chunk, self.prefill)) for a in range(0, self.prefill, self.chunk)
                if min(a + self.chunk, self.prefill) - a > 1]

    @property
    def slot_nbytes(self) -> int:
        return -(-self.geometry.expert_nbytes // PAGE) * PAGE

    @property
    def pool_bytes(self) -> int:
        g = self.geometry
        return g.n_layers * g.n_experts * self.slot_nbytes

    def request_sequence(self) -> np.ndarray:
        """Every request's key as a code layer * n_experts + expert, int64, in the engine's order
        (runtime.schedule), rank order within a layer: 8 bytes per request."""
        g = self.geometry
        order = token_request_order(g.n_layers, g.n_hash_layers)
        chunks = self.chunks()
        start = chunks[-1][1] if chunks else 0
        parts = [np.asarray([layer * g.n_experts + e for layer in range(g.n_layers)
                             for _, e in chunk_layer_keys(layer, self.ids[a:b, layer])], np.int64)
                 for a, b in chunks]
        ids = self.ids[start:, order, :].astype(np.int64)
        parts.append((ids + (np.asarray(order, np.int64) * g.n_experts)[None, :, None]).reshape(-1))
        return np.concatenate(parts)


def read_trace_file(path: str | os.PathLike, file=None) -> Trace:
    """A trace exported by write_trace_file (.npz); a run's state dump is read by ds4f.runs.traces.
    file: the trace already open (a regular file); else it is opened here, as a regular file only."""
    path = Path(path)
    if file is None:
        with open_regular(path, "trace") as (f, _st):
            return read_trace_file(path, f)
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != TRACE_FORMAT:
                raise ValueError("not a ds4f trace")
            if meta.get("version") != TRACE_VERSION:
                raise Ds4fError(f"{path}: trace version {meta.get('version')}; this ds4f reads {TRACE_VERSION}")
            geometry = Geometry.from_config(meta["geometry"], str(path))
            ids = z["ids"].astype(np.int32)
            tokens = z["tokens"].astype(np.int32)
    except Ds4fError:
        raise
    except Exception as exc:  # zip/npz/json damage of any kind
        raise Ds4fError(f"{path}: not a ds4f state dump or trace ({exc})") from None
    g = geometry
    if ids.ndim != 3 or ids.shape[1:] != (g.n_layers, g.top_k) or len(tokens) != len(ids):
        raise Ds4fError(f"{path}: trace shape {ids.shape} does not match its geometry "
                        f"({g.n_layers} layers x top-{g.top_k})")
    if len(ids) and (ids.min() < 0 or ids.max() >= g.n_experts):
        raise Ds4fError(f"{path}: expert ids outside 0..{g.n_experts - 1}")
    return Trace(geometry, ids, tokens, str(path))


def write_trace_file(trace: Trace, out: str | os.PathLike, source: str) -> Path:
    """The compact trace: expert ids as uint16, token ids, geometry (written whole, then renamed)."""
    out = Path(out)
    meta = json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION,
                       "geometry": trace.geometry.to_config(), "source": source})
    tmp = out.with_name(out.name + ".partial.npz")
    np.savez_compressed(tmp, meta=np.array(meta), ids=trace.ids.astype(np.uint16), tokens=trace.tokens)
    os.replace(tmp, out)
    return out
