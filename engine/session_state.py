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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.partials import written_whole
from ds4f.safe_read import open_regular

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


# ---- what a state holds, checked --------------------------------------------------------------------
def _model_arrays(state: SessionState):
    """(name, array) of what the model computed (the logits, each layer's window and compressors),
    the keeper's attachments aside."""
    return [(name, a) for name, a in _arrays(state) if not name.startswith("attached.")]


def non_finite(state: SessionState) -> str | None:
    """The first of the state's computed arrays holding a NaN or an infinity ('2.window'), None when
    all are finite. A compressor's overlap gate starts at -inf (no group closed yet): there only NaN
    and +inf count."""
    for name, a in _model_arrays(state):
        if name.endswith(".prev_gate"):
            if np.isnan(a).any() or np.isposinf(a).any():
                return name
        elif not np.isfinite(a).all():
            return name
    return None


def check_state(state: SessionState, finite: bool = True) -> None:
    """A whole state against itself and its geometry: every computed array fp32 and (finite) finite,
    every layer at the state's position, the window and logits of the geometry's shapes, each
    compressor's arrays of one ratio and width and with a row per closed group (tokens // ratio). A
    Ds4fError (no path: the caller names the file) for the first that is not."""
    g = state.geometry if isinstance(state.geometry, dict) else {}
    n = g.get("num_hidden_layers")
    if isinstance(n, int) and len(state.layers) != n:
        raise Ds4fError(f"{len(state.layers)} layers, its geometry has {n}")
    for name, a in _model_arrays(state):
        if a.dtype != np.float32:
            raise Ds4fError(f"{name} is {a.dtype}, not float32")
    if state.logits is not None and state.logits.shape != (g.get("vocab_size", len(state.logits)),):
        raise Ds4fError(f"logits of shape {list(state.logits.shape)}, the vocabulary is {g.get('vocab_size')}")
    ratios = g.get("compress_ratios") or []
    window = (g.get("sliding_window"), g.get("head_dim"))
    for i, layer in enumerate(state.layers):
        if layer.tokens != state.position:
            raise Ds4fError(f"layer {i} at position {layer.tokens}, the state at {state.position}")
        if None not in window and layer.window.shape != window:
            raise Ds4fError(f"layer {i} window of shape {list(layer.window.shape)}, the geometry's is {list(window)}")
        ratio = ratios[i] if i < len(ratios) and isinstance(ratios[i], int) else None
        for part, dim in (("compressor", g.get("head_dim")), ("indexer", g.get("index_head_dim"))):
            c = getattr(layer, part)
            if c is None:
                continue
            if not ratio:
                raise Ds4fError(f"layer {i} has a {part}, its geometry compresses nothing there")
            dim = dim if isinstance(dim, int) else c.prev_kv.shape[-1]
            if c.kv.shape != c.gate.shape or c.prev_kv.shape != c.prev_gate.shape or c.kv.ndim != 2 \
                    or c.prev_kv.shape != (ratio, dim) or c.kv.shape[0] != ratio or c.kv.shape[1] not in (dim, 2 * dim):
                raise Ds4fError(f"layer {i} {part}: its open group's arrays are not of ratio {ratio} and width {dim}")
            if c.rows.shape != (state.position // ratio, dim):
                raise Ds4fError(f"layer {i} {part}: {list(c.rows.shape)} compressed rows, {state.position // ratio}"
                                f" of {dim} at position {state.position}")
    bad = non_finite(state) if finite else None
    if bad is not None:
        raise Ds4fError(f"{bad} holds NaN or infinite values")


# ---- the file -------------------------------------------------------------------------------------
MAX_HEADER_BYTES = 64 << 20      # a header's JSON: the tokens of a 1M-token state are ~7 MB of it
DTYPES = frozenset(np.dtype(t).str for t in ("f4", "f2", "f8", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "?"))
_MAX_DIMS = 8


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
    it. Written whole or not at all (ds4f.partials: a `.partial` locked while it is written, one
    nobody holds is a dead writer's), so a file under the final name is always whole. A write error
    is a Ds4fError naming the file; no .partial stays. Returns the file's size."""
    path = Path(path)
    offset, entries = 0, []
    for name, a in arrays:
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        offset += a.nbytes
    raw = json.dumps({**header, "version": VERSION, "arrays": entries, "payload_nbytes": offset},
                     separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise Ds4fError(f"{path}: the {what}'s header would be {len(raw)} bytes, more than the {MAX_HEADER_BYTES}"
                        f" a reader takes", path=str(path))
    sha = hashlib.sha256()
    size = 0
    try:
        with written_whole(path) as f:
            for chunk in (_HEAD.pack(magic, VERSION, len(raw)), raw,
                          *(np.ascontiguousarray(a).tobytes() for _, a in arrays)):
                sha.update(chunk)
                f.write(chunk)
                size += len(chunk)
            f.write(sha.digest())
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot save the {what}: {exc.strerror or exc}", path=str(path)) from None
    return size + _SHA


def _is_int(v, low: int = 0, high: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


def _check_entries(head: dict, payload_nbytes: int) -> None:
    """The header's `arrays` describe the payload exactly: each a name of its own, a known dtype, a
    shape of non-negative ints, at the offset where the one before it ends; together all of it."""
    entries = head.get("arrays")
    if not isinstance(entries, list):
        raise ValueError("no list of arrays")
    at, names = 0, set()
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or e["name"] in names:
            raise ValueError(f"an array entry without a name of its own: {str(e)[:80]}")
        names.add(e["name"])
        shape = e.get("shape")
        if e.get("dtype") not in DTYPES or not isinstance(shape, list) or len(shape) > _MAX_DIMS \
                or not all(_is_int(d) for d in shape):
            raise ValueError(f"array {e['name'][:80]}: dtype {str(e.get('dtype'))[:20]} or shape {str(shape)[:80]}"
                             f" is not one ds4f writes")
        if e.get("offset") != at or not _is_int(e.get("offset")):
            raise ValueError(f"array {e['name'][:80]} at offset {str(e.get('offset'))[:20]}, the array before it"
                             f" ends at {at}")
        at += int(np.dtype(e["dtype"]).itemsize) * int(np.prod(shape, dtype=object))
        if at > payload_nbytes:
            raise ValueError(f"array {e['name'][:80]} ends past the payload's {payload_nbytes} bytes")
    if at != payload_nbytes:
        raise ValueError(f"its arrays hold {at} bytes, its payload {payload_nbytes}")


def _read_head(f, path: Path, size: int, magic: bytes, what: str) -> tuple[bytes, int]:
    """(the first bytes, the header's length) of an open file of `size` bytes: the magic, the
    version, a header length within MAX_HEADER_BYTES and the file, all checked before the header is
    read."""
    first = f.read(_HEAD.size)
    if len(first) < _HEAD.size or first[:8] != magic or size < _HEAD.size + _SHA:
        raise Ds4fError(f"{path}: not a ds4f {what}", path=str(path))
    _, version, hlen = _HEAD.unpack(first)
    if version != VERSION:
        raise Ds4fError(f"{path}: {what} version {version}; this ds4f reads version {VERSION}", path=str(path))
    if hlen > MAX_HEADER_BYTES or _HEAD.size + hlen + _SHA > size:
        raise Ds4fError(f"{path}: the {what}'s header length {hlen} is more than its file ({size} bytes) or"
                        f" {MAX_HEADER_BYTES} bytes could hold: damaged", path=str(path))
    return first, hlen


def read_arrays(path: str | os.PathLike, magic: bytes, fmt: str, what: str = "session state",
                max_bytes: int | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """A file write_arrays wrote, checked whole: (its header, its arrays by name). Refused with a
    Ds4fError naming the file and the problem: not a regular file, larger than `max_bytes`, not of
    this kind, another version, a header length past the file, truncated or altered (the sha256), a
    header that does not describe its payload (every array's dtype, shape and offset)."""
    path = Path(path)
    with open_regular(path, what) as (f, st):
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise Ds4fError(f"{path}: {size} bytes, more than the {max_bytes} a {what} here may be", path=str(path))
        try:
            first, hlen = _read_head(f, path, size, magic, what)
            data = bytearray(size)
            data[:_HEAD.size] = first
            mv, got = memoryview(data), _HEAD.size
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    break
                got += n
        except OSError as exc:
            raise Ds4fError(f"{path}: cannot read the {what}: {exc.strerror or exc}", path=str(path)) from None
    if got != size:
        raise Ds4fError(f"{path}: the {what} changed while it was read", path=str(path))
    if hashlib.sha256(mv[:-_SHA]).digest() != bytes(mv[-_SHA:]):
        raise Ds4fError(f"{path}: the {what} is truncated or damaged (its sha256 does not match)", path=str(path))
    try:
        head = json.loads(bytes(mv[_HEAD.size:_HEAD.size + hlen]))
        payload = mv[_HEAD.size + hlen:-_SHA]
        if not isinstance(head, dict) or head.get("format") != fmt or head.get("payload_nbytes") != len(payload):
            raise ValueError("its header does not describe its payload")
        _check_entries(head, len(payload))
        arrays = {e["name"]: np.frombuffer(payload, np.dtype(e["dtype"]), int(np.prod(e["shape"], dtype=np.int64)),
                                           e["offset"]).reshape(e["shape"]).copy() for e in head["arrays"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise Ds4fError(f"{path}: not a readable {what} ({exc})", path=str(path)) from None
    except RecursionError:
        raise Ds4fError(f"{path}: not a readable {what} (its header is nested too deeply)", path=str(path)) from None
    return head, arrays


def check_header(doc) -> dict:
    """A session state's header with every field a reader uses of the type it takes (format,
    version, geometry, checkpoint, backend, tokens, layers, arrays, payload_nbytes, and a kept
    state's blocks, block_tokens and per_token); the doc, `backend` defaulted. ValueError naming the
    first field that is missing or wrong."""
    if not isinstance(doc, dict) or doc.get("format") != "ds4f.session":
        raise ValueError("not a session state's header")
    if doc.get("version") != VERSION:
        raise ValueError(f"version {str(doc.get('version'))[:20]}")
    fields = {
        "geometry": lambda v: isinstance(v, dict) and _is_int(v.get("num_hidden_layers")),
        "checkpoint": lambda v: isinstance(v, str) and 0 < len(v) <= 256,
        "backend": lambda v: isinstance(v, str) and len(v) <= 64,
        "tokens": lambda v: isinstance(v, list) and all(_is_int(t, 0, (1 << 31) - 1) for t in v),
        "layers": lambda v: isinstance(v, list) and all(isinstance(x, dict) and _is_int(x.get("tokens")) for x in v),
        "payload_nbytes": _is_int,
        "arrays": lambda v: isinstance(v, list),
        "blocks": lambda v: isinstance(v, list) and all(isinstance(k, str) and len(k) == 64 and
                                                        all(c in "0123456789abcdef" for c in k) for k in v),
        "block_tokens": lambda v: _is_int(v, 1),
        "per_token": lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
    }
    doc.setdefault("backend", "")
    for name, ok in fields.items():
        if name not in doc:
            if name in ("blocks", "block_tokens", "per_token"):
                continue
            raise ValueError(f"no {name!r}")
        if not ok(doc[name]):
            raise ValueError(f"its {name!r} is not what a session state holds")
    if len(doc["layers"]) != doc["geometry"]["num_hidden_layers"]:
        raise ValueError(f"{len(doc['layers'])} layers, its geometry has {doc['geometry']['num_hidden_layers']}")
    if doc.get("blocks") and "block_tokens" not in doc:
        raise ValueError("blocks without 'block_tokens'")
    return doc


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
    checks the whole file before a state is used) but every field checked (check_header) and the
    file's size against it: format, version, geometry, checkpoint, backend, tokens, layers, arrays,
    blocks. A Ds4fError when it is not a readable session state (a FIFO or a device under the name
    is refused without a read; a header length past the file or MAX_HEADER_BYTES before one)."""
    path = Path(path)
    with open_regular(path, "session state") as (f, st):
        try:
            _, hlen = _read_head(f, path, st.st_size, MAGIC, "session state")
            raw = f.read(hlen)
        except OSError as exc:
            raise Ds4fError(f"{path}: cannot read the session state: {exc.strerror or exc}", path=str(path)) from None
    try:
        if len(raw) != hlen:
            raise ValueError("truncated header")
        doc = check_header(json.loads(raw))
        _check_entries(doc, doc["payload_nbytes"])
        described = _HEAD.size + hlen + doc["payload_nbytes"] + _SHA
        if described != st.st_size:
            raise ValueError(f"{st.st_size} bytes, its header describes {described}")
        return doc
    except (ValueError, RecursionError) as exc:
        raise Ds4fError(f"{path}: not a readable session state ({exc or 'nested too deeply'})",
                        path=str(path)) from None


def load_head(path: str | os.PathLike, geometry: dict | None = None, checkpoint: str | None = None,
              max_bytes: int | None = None) -> tuple[SessionState, dict]:
    """A state file as written, with its header: a kept state's head holds only the rows past its
    blocks (the header's `blocks`; engine.kv_blocks joins them). Refused as load_state refuses;
    its computed arrays fp32 and finite (check_state checks the joined state's shapes)."""
    path = Path(path)
    head, arrays = read_arrays(path, MAGIC, "ds4f.session", max_bytes=max_bytes)
    try:
        check_header(head)
        tokens = tuple(head["tokens"])
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
                         head["backend"], attached)
    for name, a in _model_arrays(state):
        if a.dtype != np.float32 or a.ndim != (1 if name == "logits" else 2):
            raise Ds4fError(f"{path}: a damaged session state: {name} is {a.dtype} of {a.ndim} dimensions, not"
                            f" float32 of {1 if name == 'logits' else 2}", path=str(path))
    bad = non_finite(state)
    if bad is not None:
        raise Ds4fError(f"{path}: a damaged session state: {bad} holds NaN or infinite values", path=str(path))
    return state, head


def load_state(path: str | os.PathLike, geometry: dict | None = None, checkpoint: str | None = None) -> SessionState:
    """Read a state saved by save_state. Refused with a Ds4fError naming the file and the problem:
    not a session state, another version, truncated or altered (the sha256), arrays of the wrong
    dtype, shape or values (check_state), or, when `geometry` and `checkpoint` are given, saved for
    another model or checkpoint; a kept state's head whose rows are in blocks (the prefix cache
    reads those)."""
    state, head = load_head(path, geometry, checkpoint)
    if head.get("blocks"):
        raise Ds4fError(f"{path}: a kept state whose compressed rows are in {len(head['blocks'])} blocks beside it;"
                        f" the prefix cache reads it", path=str(path))
    try:
        check_state(state)
    except Ds4fError as exc:
        raise Ds4fError(f"{path}: a damaged session state: {exc}", path=str(path)) from None
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
