"""A session's state as a value: what a sequence carries from one position to the next, taken at a
position (Session.snapshot), put back into a session (Session.restore, Engine.fork), and saved to a
file and loaded from one (save_state, load_state).

What a session carries (the model's semantics, model/attention.py): per layer the sliding window's
ring and the positions pushed; on a compressed layer its compressor's open group (kv and gate by
slot), the previous group's first halves (the overlap) and every compressed row so far; on a CSA
layer the indexer's compressor likewise. The hyper-connection streams carry nothing across
positions. With the tokens evaluated and the last logits, that is everything a continuation reads:
a restored session continues byte for byte as the original would.

The file (little-endian):
    b"DS4FKVST"  u32 version  u32 header_len  header JSON (utf-8)  payload  sha256 (32 bytes)
The header names the format, the geometry, the checkpoint's fingerprint, the tokens and every
array of the payload (name, dtype, shape, offset); the sha256 covers everything before it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ds4f.errors import Ds4fError

MAGIC = b"DS4FKVST"
VERSION = 2      # 1: kept states that carried full state-dump records (refused: their prompts are computed)
_HEAD = struct.Struct("<8sII")
_SHA = 32

# what each compressor state carries, by attribute: the open group, the overlap, the rows so far
_COMPRESSOR_ARRAYS = ("kv", "gate", "prev_kv", "prev_gate")


@dataclass(frozen=True)
class CompressorSnapshot:
    kv: np.ndarray           # fp32 [ratio, width]  the open group's kv, by slot
    gate: np.ndarray         # fp32 [ratio, width]  and its gate
    prev_kv: np.ndarray      # fp32 [ratio, dim]    the previous group's first halves
    prev_gate: np.ndarray    # fp32 [ratio, dim]
    rows: np.ndarray         # fp32 [n_rows, dim]   the compressed rows so far (RoPE applied)


@dataclass(frozen=True)
class LayerSnapshot:
    tokens: int                                  # positions pushed
    window: np.ndarray                           # fp32 [window, head_dim], row pos % window
    compressor: CompressorSnapshot | None = None
    indexer: CompressorSnapshot | None = None


@dataclass(frozen=True)
class SessionState:
    """A session at a position: the tokens it evaluated, the logits after the last one, and every
    layer's carried attention state (copies: the session goes on without changing them)."""

    tokens: tuple[int, ...]
    logits: np.ndarray | None                    # fp32 [vocab]; None at position 0
    layers: tuple[LayerSnapshot, ...]
    geometry: dict                               # Geometry.to_config() of the model it belongs to
    checkpoint: str                              # the fingerprint of its checkpoint
    backend: str = ""                            # the kernels that computed it (its low bits are theirs)
    attached: dict = field(default_factory=dict)  # name -> array its keeper adds (kept and saved with it)

    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold (what keeping it costs in RAM)."""
        return sum(a.nbytes for _, a in _arrays(self))


def canonical(geometry: dict) -> dict:
    """A geometry's config as a state holds it: as JSON gives it back (lists, not tuples), so a
    state loaded from a file compares equal to the one it was saved from."""
    return json.loads(json.dumps(geometry))


# ---- taking and putting back -------------------------------------------------------------------
def _take_compressor(c) -> CompressorSnapshot | None:
    if c is None:
        return None
    return CompressorSnapshot(*(getattr(c, name).copy() for name in _COMPRESSOR_ARRAYS), c.rows[:c.n_rows].copy())


def take_layers(kv) -> tuple[LayerSnapshot, ...]:
    """Copies of a KVCache's carried state, layer by layer."""
    return tuple(LayerSnapshot(c.tokens, c.window.copy(), _take_compressor(c.compressor), _take_compressor(c.indexer))
                 for c in kv.layers)


def _check_compressor(snap: CompressorSnapshot | None, c, where: str) -> None:
    if (snap is None) != (c is None):
        raise Ds4fError(f"{where}: the state has {'no ' if snap is None else ''}compressor where the model has"
                        f" {'one' if c is not None else 'none'}", param="state")
    if c is None:
        return
    for name in _COMPRESSOR_ARRAYS:
        src, dst = getattr(snap, name), getattr(c, name)
        if src.shape != dst.shape:
            raise Ds4fError(f"{where}: {name} of shape {list(src.shape)}, the model's is {list(dst.shape)}",
                            param="state")
    if len(snap.rows) > len(c.rows) or snap.rows.shape[1:] != c.rows.shape[1:]:
        raise Ds4fError(f"{where}: {len(snap.rows)} compressed rows of {list(snap.rows.shape[1:])}; this session"
                        f" holds {len(c.rows)} of {list(c.rows.shape[1:])}", param="state")


def _put_compressor(snap: CompressorSnapshot | None, c) -> None:
    if c is None:
        return
    for name in _COMPRESSOR_ARRAYS:
        getattr(c, name)[:] = getattr(snap, name)
    n = len(snap.rows)
    c.rows[:n] = snap.rows
    c.rows[n:] = 0          # as a session that reached this position itself has them
    c.n_rows = n


def put_layers(layers: tuple[LayerSnapshot, ...], kv) -> None:
    """Write a state's layers into a KVCache of the same model (its context large enough); every
    layer is checked before any is written, so a refused state changes nothing."""
    if len(layers) != len(kv.layers):
        raise Ds4fError(f"the state has {len(layers)} layers, the model {len(kv.layers)}", param="state")
    for i, (snap, c) in enumerate(zip(layers, kv.layers)):
        if snap.window.shape != c.window.shape:
            raise Ds4fError(f"layer {i}: window of shape {list(snap.window.shape)}, the model's is"
                            f" {list(c.window.shape)}", param="state")
        _check_compressor(snap.compressor, c.compressor, f"layer {i} compressor")
        _check_compressor(snap.indexer, c.indexer, f"layer {i} indexer")
    for snap, c in zip(layers, kv.layers):
        _put_compressor(snap.compressor, c.compressor)
        _put_compressor(snap.indexer, c.indexer)
        c.window[:] = snap.window
        c.tokens = snap.tokens


# ---- the file -------------------------------------------------------------------------------------
def _arrays(state: SessionState) -> list[tuple[str, np.ndarray]]:
    out = [] if state.logits is None else [("logits", state.logits)]
    out += [(f"attached.{name}", a) for name, a in sorted(state.attached.items())]
    for i, layer in enumerate(state.layers):
        out.append((f"{i}.window", layer.window))
        for part in ("compressor", "indexer"):
            c = getattr(layer, part)
            if c is not None:
                out += [(f"{i}.{part}.{name}", getattr(c, name)) for name in (*_COMPRESSOR_ARRAYS, "rows")]
    return out


def write_arrays(path: str | os.PathLike, magic: bytes, header: dict, arrays: list[tuple[str, np.ndarray]],
                 what: str = "session state") -> int:
    """The container both kept states and their blocks are written in: magic, version, a JSON header
    (`header` with every array's name, dtype, shape and offset), the arrays, and a sha256 of all of
    it. Written to a `.partial` beside `path` (named for this process and thread), flushed to disk,
    then renamed: a file under the final name is always whole. A write error is a Ds4fError naming
    the file; no .partial stays. Returns the file's size."""
    path = Path(path)
    offset, entries = 0, []
    for name, a in arrays:
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        offset += a.nbytes
    raw = json.dumps({**header, "version": VERSION, "arrays": entries, "payload_nbytes": offset},
                     separators=(",", ":")).encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    sha = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in (_HEAD.pack(magic, VERSION, len(raw)), raw,
                          *(np.ascontiguousarray(a).tobytes() for _, a in arrays)):
                sha.update(chunk)
                f.write(chunk)
                size += len(chunk)
            f.write(sha.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise Ds4fError(f"{path}: cannot save the {what}: {exc.strerror or exc}", path=str(path)) from None
    return size + _SHA


def read_arrays(path: str | os.PathLike, magic: bytes, fmt: str, what: str = "session state"
                ) -> tuple[dict, dict[str, np.ndarray]]:
    """A file write_arrays wrote, checked whole: (its header, its arrays by name). Refused with a
    Ds4fError naming the file and the problem: not of this kind, another version, truncated or
    altered (the sha256), a header that does not describe its payload."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read the {what}: {exc.strerror or exc}", path=str(path)) from None
    if len(data) < _HEAD.size + _SHA or data[:8] != magic:
        raise Ds4fError(f"{path}: not a ds4f {what}", path=str(path))
    _, version, hlen = _HEAD.unpack_from(data)
    if version != VERSION:
        raise Ds4fError(f"{path}: {what} version {version}; this ds4f reads version {VERSION}", path=str(path))
    if hashlib.sha256(data[:-_SHA]).digest() != data[-_SHA:]:
        raise Ds4fError(f"{path}: the {what} is truncated or damaged (its sha256 does not match)", path=str(path))
    try:
        head = json.loads(data[_HEAD.size:_HEAD.size + hlen])
        payload = data[_HEAD.size + hlen:-_SHA]
        if head.get("format") != fmt or len(payload) != head["payload_nbytes"]:
            raise ValueError("its header does not describe its payload")
        arrays = {e["name"]: np.frombuffer(payload, np.dtype(e["dtype"]), int(np.prod(e["shape"], dtype=np.int64)),
                                           e["offset"]).reshape(e["shape"]).copy() for e in head["arrays"]}
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise Ds4fError(f"{path}: not a readable {what} ({exc})", path=str(path)) from None
    return head, arrays


def save_state(state: SessionState, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write `state` to `path` (write_arrays: whole or not at all); `extra`: more header fields (a
    kept state's blocks, engine.kv_blocks)."""
    header = {"format": "ds4f.session", "geometry": state.geometry, "checkpoint": state.checkpoint,
              "backend": state.backend, "tokens": list(state.tokens),
              "layers": [{"tokens": layer.tokens} for layer in state.layers], **(extra or {})}
    write_arrays(path, MAGIC, header, _arrays(state))
    return Path(path)


def read_header(path: str | os.PathLike) -> dict:
    """A state file's header alone (cheap: its first bytes), unchecked by the sha256 (load_state
    checks the whole file before a state is used): format, version, geometry, checkpoint,
    backend, tokens. A Ds4fError when it is not a readable session state."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size or head[:8] != MAGIC:
                raise Ds4fError(f"{path}: not a ds4f session state", path=str(path))
            _, version, hlen = _HEAD.unpack(head)
            if version != VERSION:
                raise Ds4fError(f"{path}: session state version {version}; this ds4f reads version {VERSION}",
                                path=str(path))
            doc = json.loads(f.read(hlen))
        if not isinstance(doc, dict) or doc.get("format") != "ds4f.session" or not isinstance(doc.get("tokens"), list):
            raise ValueError("not a session state's header")
        doc.setdefault("backend", "")
        return doc
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read the session state: {exc.strerror or exc}", path=str(path)) from None
    except (ValueError, RecursionError) as exc:
        raise Ds4fError(f"{path}: not a readable session state ({exc or 'nested too deeply'})", path=str(path)) from None


def load_head(path: str | os.PathLike, geometry: dict | None = None, checkpoint: str | None = None
              ) -> tuple[SessionState, dict]:
    """A state file as written, with its header: a kept state's head holds only the rows past its
    blocks (the header's `blocks`; engine.kv_blocks joins them). Refused as load_state refuses."""
    path = Path(path)
    head, arrays = read_arrays(path, MAGIC, "ds4f.session")
    try:
        tokens = tuple(int(t) for t in head["tokens"])
        layers = tuple(_layer(i, layer["tokens"], arrays) for i, layer in enumerate(head["layers"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise Ds4fError(f"{path}: not a readable session state ({exc})", path=str(path)) from None
    if geometry is not None and head["geometry"] != canonical(geometry):
        raise Ds4fError(f"{path}: this session state belongs to another model geometry", path=str(path))
    if checkpoint is not None and head["checkpoint"] != checkpoint:
        raise Ds4fError(f"{path}: this session state belongs to another checkpoint (fingerprint"
                        f" {str(head['checkpoint'])[:12]}…, this one {checkpoint[:12]}…)", path=str(path))
    attached = {k[len("attached."):]: a for k, a in arrays.items() if k.startswith("attached.")}
    state = SessionState(tokens, arrays.get("logits"), layers, head["geometry"], head["checkpoint"],
                         str(head.get("backend", "")), attached)
    return state, head


def load_state(path: str | os.PathLike, geometry: dict | None = None, checkpoint: str | None = None) -> SessionState:
    """Read a state saved by save_state. Refused with a Ds4fError naming the file and the problem:
    not a session state, another version, truncated or altered (the sha256), or, when `geometry`
    and `checkpoint` are given, saved for another model or checkpoint; a kept state's head whose
    rows are in blocks (the prefix cache reads those)."""
    state, head = load_head(path, geometry, checkpoint)
    if head.get("blocks"):
        raise Ds4fError(f"{path}: a kept state whose compressed rows are in {len(head['blocks'])} blocks beside it;"
                        f" the prefix cache reads it", path=str(path))
    return state


def with_attached(state: SessionState, **arrays: np.ndarray) -> SessionState:
    """The same state with these arrays attached (a run attaches its records of the tokens)."""
    return replace(state, attached={**state.attached, **arrays})


def _layer(i: int, tokens: int, arrays: dict) -> LayerSnapshot:
    def comp(part):
        if f"{i}.{part}.kv" not in arrays:
            return None
        return CompressorSnapshot(*(arrays[f"{i}.{part}.{n}"] for n in (*_COMPRESSOR_ARRAYS, "rows")))

    return LayerSnapshot(int(tokens), arrays[f"{i}.window"], comp("compressor"), comp("indexer"))
