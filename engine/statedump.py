"""state.bin: the reference artifact of a run, and the diff of two of them.

Layout (little-endian):
    b"DS4FSTAT"  u32 version  u32 header_len  header_json (utf-8, space-padded to 8 bytes)
    then one record per decoded token:
        i32 token_id, i32 next_token_id, u8 backend code, 3 pad bytes,
        i32 expert_ids[n_layers, top_k], f32 weights[n_layers, top_k], f32 hidden[n_layers, hidden]
The header holds only what determines the numbers (format, geometry, prompt, token count),
never thread counts, paths or times, so equal math gives equal bytes (the determinism
invariant). The file is written under a temporary name and renamed when complete.

Diff classes: identical (same bytes); low-bit (same tokens and routing, hidden states within
tolerance); routing (the first token and layer whose selected experts differ); drift (same
routing, hidden states beyond tolerance).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4f.engine.errors import Ds4fError

MAGIC = b"DS4FSTAT"
VERSION = 1
BACKEND_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "neon": 3}
BACKEND_BY_CODE = {v: k for k, v in BACKEND_CODES.items()}
# hidden-state error, relative to the layer's largest magnitude, below which two runs
# with identical routing are "low-bit" (SIMD lane order) rather than "drift"
LOW_BIT_TOLERANCE = 1e-4

CLASS_EXIT_CODES = {"identical": 0, "low-bit": 1, "routing": 3, "drift": 4, "prefix": 5}


def record_dtype(n_layers: int, top_k: int, hidden: int) -> np.dtype:
    return np.dtype([("token", "<i4"), ("next", "<i4"), ("backend", "u1"), ("pad", "u1", (3,)),
                     ("ids", "<i4", (n_layers, top_k)), ("weights", "<f4", (n_layers, top_k)),
                     ("hidden", "<f4", (n_layers, hidden))])


class StateWriter:
    """Streams records to `path`.partial, hashing as it goes; finish() renames into place."""

    def __init__(self, path: str | os.PathLike, geometry: dict, prompt: list[int], n_tokens: int) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        g = geometry
        self.dtype = record_dtype(g["num_hidden_layers"], g["num_experts_per_tok"], g["hidden_size"])
        header = json.dumps({"format": "ds4f.state", "version": VERSION, "geometry": geometry,
                             "prompt": list(prompt), "n_tokens": n_tokens}, sort_keys=True).encode()
        header += b" " * (-(len(header) + 16) % 8)
        self._rec = np.zeros(1, self.dtype)
        self._sha = hashlib.sha256()
        self._f = open(self.tmp, "wb")
        self._write(MAGIC + struct.pack("<II", VERSION, len(header)) + header)
        self.n_written = 0

    def _write(self, data: bytes) -> None:
        self._f.write(data)
        self._sha.update(data)

    def write(self, token: int, next_token: int, backend: str, ids, weights, hidden) -> None:
        rec = self._rec[0]
        rec["token"], rec["next"], rec["backend"] = token, next_token, BACKEND_CODES[backend]
        rec["ids"], rec["weights"], rec["hidden"] = ids, weights, hidden
        self._write(self._rec.tobytes())
        self.n_written += 1

    def finish(self) -> str:
        """Close, rename into place, and return the sha256 of the file."""
        self._f.close()
        os.replace(self.tmp, self.path)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


@dataclass
class State:
    path: Path
    header: dict
    records: np.ndarray      # structured, one per token
    sha256: str

    @property
    def tokens(self) -> np.ndarray:
        return self.records["token"]

    @property
    def backends(self) -> list[str]:
        return [BACKEND_BY_CODE.get(int(b), "?") for b in self.records["backend"]]


def read_state(path: str | os.PathLike) -> State:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise Ds4fError(f"{path}: state dump not found") from None
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) < 16 or data[:8] != MAGIC:
        raise Ds4fError(f"{path}: not a ds4f state dump (bad magic)")
    version, hlen = struct.unpack("<II", data[8:16])
    if version != VERSION:
        raise Ds4fError(f"{path}: state dump version {version}; this ds4f reads version {VERSION}")
    try:
        header = json.loads(data[16:16 + hlen])
        g = header["geometry"]
        dtype = record_dtype(g["num_hidden_layers"], g["num_experts_per_tok"], g["hidden_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise Ds4fError(f"{path}: corrupt state dump header ({exc})") from None
    body = data[16 + hlen:]
    if len(body) != header.get("n_tokens", -1) * dtype.itemsize:
        raise Ds4fError(f"{path}: truncated or padded state dump: {len(body)} bytes of records, "
                        f"expected {header.get('n_tokens')} x {dtype.itemsize}")
    records = np.frombuffer(body, dtype=dtype)
    return State(path, header, records, hashlib.sha256(data).hexdigest())


@dataclass
class StateDiff:
    cls: str                        # identical | low-bit | routing | drift | prefix (same prefix, lengths differ)
    token: int | None               # first divergent token (routing), else None
    layer: int | None               # first divergent layer (routing), else None
    layer_max_abs: list[float]      # per layer, over the compared tokens
    layer_max_rel: list[float]      # per layer: max |a-b| / max(|a|, |b|) of that layer
    sha_a: str
    sha_b: str
    n_tokens: int                   # tokens compared
    backends_a: list[str]
    backends_b: list[str]
    detail: str = ""

    @property
    def exit_code(self) -> int:
        return CLASS_EXIT_CODES[self.cls]

    def summary(self) -> str:
        if self.cls == "identical":
            return f"identical: sha256 {self.sha_a[:16]}… on both ({self.n_tokens} tokens)"
        worst = max(self.layer_max_rel, default=0.0)
        if self.cls == "low-bit":
            return f"low-bit: same tokens and routing, hidden states within {worst:.2e} relative (tolerance {LOW_BIT_TOLERANCE:g})"
        if self.cls == "drift":
            if self.detail:
                return f"drift: {self.detail}"
            return f"drift: same routing, but hidden states differ by up to {worst:.2e} relative (tolerance {LOW_BIT_TOLERANCE:g})"
        if self.cls == "prefix":
            return f"same prefix, lengths differ: {self.detail}"
        return f"routing divergence at token {self.token}, layer {self.layer}" + (f": {self.detail}" if self.detail else "")

    def to_dict(self) -> dict:
        return {"class": self.cls, "token": self.token, "layer": self.layer, "layer_max_abs": self.layer_max_abs,
                "layer_max_rel": self.layer_max_rel, "sha_a": self.sha_a, "sha_b": self.sha_b,
                "n_tokens": self.n_tokens, "summary": self.summary()}


def diff_states(a: str | os.PathLike | State, b: str | os.PathLike | State) -> StateDiff:
    sa = a if isinstance(a, State) else read_state(a)
    sb = b if isinstance(b, State) else read_state(b)
    ga, gb = sa.header["geometry"], sb.header["geometry"]
    shape_keys = ("num_hidden_layers", "num_experts_per_tok", "hidden_size")
    if any(ga[k] != gb[k] for k in shape_keys):
        raise Ds4fError(f"{sb.path}: geometry differs from {sa.path} "
                        f"({', '.join(f'{k} {ga[k]} vs {gb[k]}' for k in shape_keys if ga[k] != gb[k])}); nothing to compare")
    ra, rb = sa.records, sb.records
    n = min(len(ra), len(rb))
    n_layers = ga["num_hidden_layers"]

    def errors(upto: int) -> tuple[list[float], list[float]]:
        if upto == 0:
            return [0.0] * n_layers, [0.0] * n_layers
        ha = ra["hidden"][:upto].astype(np.float64)
        hb = rb["hidden"][:upto].astype(np.float64)
        d = np.abs(ha - hb).max(axis=(0, 2))
        scale = np.maximum(np.abs(ha).max(axis=(0, 2)), np.abs(hb).max(axis=(0, 2)))
        rel = np.where(scale > 0, d / np.where(scale > 0, scale, 1), 0.0)
        return [float(v) for v in d], [float(v) for v in rel]

    common = dict(sha_a=sa.sha256, sha_b=sb.sha256, backends_a=sa.backends, backends_b=sb.backends)
    if sa.sha256 == sb.sha256:
        return StateDiff("identical", None, None, [0.0] * n_layers, [0.0] * n_layers, n_tokens=n, **common)

    # first (token, layer) where the selected experts (as sets) or the fed token differ
    for t in range(n):
        if ra["token"][t] != rb["token"][t]:
            mabs, mrel = errors(t)
            return StateDiff("routing", t, 0, mabs, mrel, n_tokens=n,
                             detail=f"token ids differ ({ra['token'][t]} vs {rb['token'][t]})", **common)
        for layer in range(n_layers):
            ea, eb = ra["ids"][t, layer], rb["ids"][t, layer]
            if set(ea.tolist()) != set(eb.tolist()):
                mabs, mrel = errors(t)
                return StateDiff("routing", t, layer, mabs, mrel, n_tokens=n,
                                 detail=f"experts {sorted(ea.tolist())} vs {sorted(eb.tolist())}", **common)
    mabs, mrel = errors(n)
    finite = [bool(np.isfinite(s.records["hidden"][:n]).all()) for s in (sa, sb)]
    if not all(finite):
        which = " and ".join(str(s.path) for s, ok in zip((sa, sb), finite) if not ok)
        return StateDiff("drift", None, None, mabs, mrel, n_tokens=n,
                         detail=f"non-finite hidden states (NaN or Inf) in {which}", **common)
    within = max(mrel, default=0.0) <= LOW_BIT_TOLERANCE
    if len(ra) != len(rb):
        same = "bit-identical" if within and max(mabs, default=0.0) == 0.0 else (
            f"within {max(mrel, default=0.0):.2e} relative" if within else None)
        if same is not None:
            return StateDiff("prefix", None, None, mabs, mrel, n_tokens=n,
                             detail=f"the first {n} tokens have the same routing and states {same};"
                                    f" the runs have {len(ra)} and {len(rb)} tokens", **common)
    return StateDiff("low-bit" if within else "drift", None, None, mabs, mrel, n_tokens=n, **common)


def read_routing(path: str | os.PathLike, chunk_tokens: int = 256) -> np.ndarray:
    """Just the expert ids of a dump (int32 [tokens, n_layers, top_k]), read a chunk of records at a
    time: memory for the ids, not for the hidden states (read_state holds the whole file)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise Ds4fError(f"{path}: not a ds4f state dump (bad magic)")
            version, hlen = struct.unpack("<II", head[8:16])
            if version != VERSION:
                raise Ds4fError(f"{path}: state dump version {version}; this ds4f reads version {VERSION}")
            try:
                header = json.loads(f.read(hlen))
                g = header["geometry"]
                n = int(header["n_tokens"])
                dtype = record_dtype(g["num_hidden_layers"], g["num_experts_per_tok"], g["hidden_size"])
            except (ValueError, KeyError, TypeError) as exc:
                raise Ds4fError(f"{path}: corrupt state dump header ({exc})") from None
            ids = np.empty((n, g["num_hidden_layers"], g["num_experts_per_tok"]), np.int32)
            for start in range(0, n, chunk_tokens):
                count = min(chunk_tokens, n - start)
                data = f.read(count * dtype.itemsize)
                if len(data) != count * dtype.itemsize:
                    raise Ds4fError(f"{path}: truncated state dump: record {start + len(data) // dtype.itemsize}"
                                    f" of {n} is missing")
                ids[start:start + count] = np.frombuffer(data, dtype=dtype)["ids"]
    except FileNotFoundError:
        raise Ds4fError(f"{path}: state dump not found") from None
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror}") from None
    return ids
