"""Kept states in blocks: a conversation's compressed rows stored once, however many states share them.

What grows with a session's tokens is its compressed rows (each compressed layer's compressor and,
on a CSA layer, its indexer: one row per `ratio` tokens, never changed once made) and the per-token
arrays a run attaches (its compact records). The rest of a state (each layer's window ring and open
group, the last logits) has a fixed size. A *block* holds one span of `block_tokens` positions of
the growing part: for every compressed layer the rows of that span, and the span's rows of every
per-token attachment. The span ends at a multiple of every layer's ratio, so a block's rows depend
only on the tokens up to its end; a block is keyed by the backend and that token prefix (a chain of
sha256 from the checkpoint's fingerprint, one link per block). Two states of one conversation, or two conversations with one system
prompt, share the blocks of their common prefix.

A state kept in blocks is a *head* (a SessionState whose rows and per-token attachments are only
those past its last whole block) and the keys of its blocks; join() gives the whole state back, bit
for bit the one split() was given.

On disk a block is a file of session_state's container (magic DS4FKVBL, a header naming its key,
checkpoint, backend and span, its arrays, a sha256 of all of it), written whole or not at all.
Sizes on DeepSeek-V4-Flash (`ds4f plan`): a block of 256 tokens is 3.4 MiB of rows (13.4 KiB a
token) plus 0.9 MiB of compact records when a run attaches them; a head is about 32 MiB (43 windows
of 128 x 512 fp32, the HCA layers' open groups, the logits).
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ds4f.engine.session_state import SessionState, read_arrays, write_arrays
from ds4f.errors import Ds4fError

BLOCK_MAGIC = b"DS4FKVBL"
BLOCK_TARGET = 256           # positions a block spans, rounded up to a multiple of every compression ratio
BLOCK_SUFFIX = ".kvb"
PARTS = ("compressor", "indexer")


def block_tokens(ratios, target: int = BLOCK_TARGET) -> int:
    """Positions a block spans: the least multiple of every ratio (0s, sliding-window layers, aside)
    that is at least `target`."""
    step = 1
    for r in ratios:
        if r:
            step = step * r // math.gcd(step, r)
    return step * max(1, -(-target // step))


def chain_keys(checkpoint: str, backend: str, tokens, span: int, n_blocks: int) -> list[str]:
    """The keys of the first n_blocks blocks of `tokens`: block b's is the sha256 of block b-1's key
    and the token ids of its span, the first's of the checkpoint's fingerprint, the backend and the
    span (so two checkpoints sharing a directory never share a key)."""
    keys, prev = [], f"ds4f.kvblock:{checkpoint}:{backend}:{span}"
    for b in range(n_blocks):
        h = hashlib.sha256(prev.encode())
        h.update(np.asarray(tokens[b * span:(b + 1) * span], np.int64).tobytes())
        prev = h.hexdigest()
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class Block:
    key: str
    start: int                           # its first position
    span: int                            # positions it covers
    arrays: dict                         # name -> array: "<layer>.<part>.rows" and "attached.<name>"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass(frozen=True)
class Head:
    """A state without its blocks: what it holds past them, and their keys in order."""
    state: SessionState                  # rows and per-token attachments past the blocks only
    keys: tuple[str, ...]
    span: int                            # positions a block covers
    per_token: tuple[str, ...]           # the attachments split by token (their first axis: positions)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.state.tokens

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def header(self) -> dict:
        """What a head's file records beside the state (session_state.save_state's `extra`)."""
        return {"blocks": list(self.keys), "block_tokens": self.span, "per_token": list(self.per_token)}


def _ratios(state: SessionState) -> list[int]:
    """Each layer's compression ratio from the state's geometry (0: sliding window only)."""
    g = state.geometry
    n = g["num_hidden_layers"]
    return [int(r) for r in g.get("compress_ratios", [0] * n)[:n]]


def _compressors(state: SessionState):
    """(layer, part, its snapshot) of every compressor and indexer the state's layers carry."""
    for i, layer in enumerate(state.layers):
        for part in PARTS:
            c = getattr(layer, part)
            if c is not None:
                yield i, part, c


def _with_rows(state: SessionState, rows: dict) -> tuple:
    """The state's layers with the compressed rows of (layer, part) replaced by rows[layer, part]."""
    layers = list(state.layers)
    for (i, part), r in rows.items():
        layers[i] = replace(layers[i], **{part: replace(getattr(layers[i], part), rows=r)})
    return tuple(layers)


def split(state: SessionState, span: int) -> tuple[Head, list[Block]]:
    """The state's head and its whole blocks (span positions each, from position 0), their arrays
    copies (a block a cache already holds is shared, and the split state's rows can go)."""
    ratios = _ratios(state)
    for r in ratios:
        if r and span % r:
            raise Ds4fError(f"a block of {span} positions is not a multiple of the compression ratio {r}",
                            kind="internal")
    n_blocks = state.position // span
    keys = chain_keys(state.checkpoint, state.backend, state.tokens, span, n_blocks)
    per_token = tuple(sorted(name for name, a in state.attached.items()
                             if a.ndim >= 1 and len(a) == state.position))
    blocks = [Block(key, b * span, span, {}) for b, key in enumerate(keys)]
    tails = {}
    for i, part, c in _compressors(state):
        per_block = span // ratios[i]
        whole = n_blocks * per_block
        if len(c.rows) < whole:
            raise Ds4fError(f"layer {i} {part}: {len(c.rows)} compressed rows at position {state.position}, fewer"
                            f" than its {n_blocks} blocks hold", kind="internal")
        for b, block in enumerate(blocks):     # copies: the state's arrays go once split
            block.arrays[f"{i}.{part}.rows"] = c.rows[b * per_block:(b + 1) * per_block].copy()
        tails[i, part] = c.rows[whole:].copy()
    attached = dict(state.attached)
    for name in per_token:
        a = state.attached[name]
        for b, block in enumerate(blocks):
            block.arrays[f"attached.{name}"] = a[b * span:(b + 1) * span].copy()
        attached[name] = a[n_blocks * span:].copy()
    head = replace(state, layers=_with_rows(state, tails), attached=attached)
    return Head(head, tuple(keys), span, per_token), blocks


def join(head: Head, blocks: list[Block]) -> SessionState:
    """The whole state of a head and its blocks (in order): bit for bit the state split() was given."""
    if [b.key for b in blocks] != list(head.keys):
        raise Ds4fError("the blocks given are not the head's", kind="internal")
    state = head.state
    whole = {}
    for i, part, c in _compressors(state):
        rows = [b.arrays[f"{i}.{part}.rows"] for b in blocks] + [c.rows]
        whole[i, part] = np.concatenate(rows) if len(rows) > 1 else c.rows
    attached = dict(state.attached)
    for name in head.per_token:
        parts = [b.arrays[f"attached.{name}"] for b in blocks] + [state.attached[name]]
        attached[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return replace(state, layers=_with_rows(state, whole), attached=attached)


# ---- the files ----------------------------------------------------------------------------------
def block_path(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / f"{key}{BLOCK_SUFFIX}"


def save_block(block: Block, path: str | os.PathLike, checkpoint: str, backend: str) -> int:
    """Write a block (whole or not at all); its file's size."""
    header = {"format": "ds4f.kvblock", "key": block.key, "checkpoint": checkpoint, "backend": backend,
              "start": block.start, "span": block.span}
    return write_arrays(path, BLOCK_MAGIC, header, sorted(block.arrays.items()), what="kept-state block")


def load_block(path: str | os.PathLike, key: str, checkpoint: str, max_bytes: int | None = None) -> Block:
    """The block of `key` from its file, checked whole (session_state.read_arrays: a regular file of
    at most `max_bytes`, every array's dtype, shape and offset) and against its key and checkpoint;
    its rows fp32, 2-D and finite."""
    head, arrays = read_arrays(path, BLOCK_MAGIC, "ds4f.kvblock", what="kept-state block", max_bytes=max_bytes)
    if head.get("key") != key:
        raise Ds4fError(f"{path}: a kept-state block of another key", path=str(path))
    if head.get("checkpoint") != checkpoint:
        raise Ds4fError(f"{path}: a kept-state block of another checkpoint", path=str(path))
    start, span = head.get("start"), head.get("span")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, span)) or start < 0 or span < 1:
        raise Ds4fError(f"{path}: a damaged kept-state block (start {str(start)[:20]}, span {str(span)[:20]})",
                        path=str(path))
    for name, a in arrays.items():
        if name.startswith("attached."):
            continue
        if not name.endswith(".rows") or a.dtype != np.float32 or a.ndim != 2:
            raise Ds4fError(f"{path}: a damaged kept-state block: {name} is {a.dtype} of {a.ndim} dimensions",
                            path=str(path))
        if not np.isfinite(a).all():
            raise Ds4fError(f"{path}: a damaged kept-state block: {name} holds NaN or infinite values", path=str(path))
    return Block(key, start, span, arrays)


def check_blocks(head: Head, blocks: list[Block]) -> None:
    """The blocks are the head's: in its order, each of its span, each with the rows of every
    compressor the head has (span / ratio rows of its width) and the span's rows of every per-token
    attachment. A Ds4fError naming the first block that is not (join would give a wrong state)."""
    ratios = _ratios(head.state)
    tails = {(i, part): c.rows for i, part, c in _compressors(head.state)}
    for b, block in enumerate(blocks):
        where = f"block {b + 1} of {len(blocks)} ({block.key[:12]}…)"
        if block.key != head.keys[b] or block.start != b * head.span or block.span != head.span:
            raise Ds4fError(f"{where}: not the head's block {b + 1} (start {block.start}, span {block.span})")
        want = {f"{i}.{part}.rows" for i, part in tails} | {f"attached.{name}" for name in head.per_token}
        if set(block.arrays) != want:
            raise Ds4fError(f"{where}: arrays {sorted(block.arrays)[:4]}…, the head needs {sorted(want)[:4]}…")
        for (i, part), tail in tails.items():
            rows = block.arrays[f"{i}.{part}.rows"]
            if not ratios[i] or rows.shape != (head.span // ratios[i], tail.shape[1]):
                raise Ds4fError(f"{where}: layer {i} {part} rows of shape {list(rows.shape)}")
        for name in head.per_token:
            a, tail = block.arrays[f"attached.{name}"], head.state.attached.get(name)
            if tail is None or a.shape[1:] != tail.shape[1:] or a.dtype != tail.dtype or len(a) != head.span:
                raise Ds4fError(f"{where}: attachment {name} of shape {list(a.shape)}")
