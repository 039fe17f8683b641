"""Checkpoints: one reading interface for both forms.

    ck = open_checkpoint(path)      # official shards (read in place) or the ds4f layout
    ck.geometry, ck.kind, ck.io_mode
    ck.layer_tensors(layer)         # MoE trunk of a layer, short names, bf16/f32/i64 arrays
    ck.read_trunk_layer(layer, buf) # the same as views into `buf`, one read (ds4f layout)
    ck.global_tensor("embed.weight")
    ck.expert_extents(layer, e)     # byte ranges on disk: ds4f one, official two
    ck.read_expert(layer, e, buf)   # into a 4096-aligned slot, canonical layout, thread-safe

The ds4f layout (its files and their format) is described in ds4f.engine.checkpoint.layout.
"""
from __future__ import annotations

from pathlib import Path

from ds4f.engine.checkpoint.base import (ALIGN, CONFIG_NAME, POOL_BIN, POOL_JSON, TRUNK_BIN, TRUNK_JSON, TRUNK_OFFSETS,
                                         Checkpoint, aligned_buffer)
from ds4f.engine.checkpoint.layout import Ds4fCheckpoint, read_trunk_offsets
from ds4f.engine.checkpoint.official import OfficialCheckpoint
from ds4f.engine.checkpoint.safetensors_index import INDEX_NAME
from ds4f.errors import Ds4fError

__all__ = ["ALIGN", "Checkpoint", "Ds4fCheckpoint", "OfficialCheckpoint", "aligned_buffer", "detect_kind",
           "open_checkpoint", "read_trunk_offsets"]

def detect_kind(path: Path | str) -> tuple[Path, str]:
    p = Path(path)
    if p.is_file():
        if p.name in (POOL_JSON, TRUNK_JSON, POOL_BIN, TRUNK_BIN, TRUNK_OFFSETS):
            return p.parent, "ds4f"
        if p.name == INDEX_NAME or p.name == CONFIG_NAME or p.suffix == ".safetensors":
            return p.parent, "official"
        raise Ds4fError(f"{p}: not a checkpoint directory")
    if not p.exists():
        raise Ds4fError(f"{p}: no such checkpoint (missing)")
    if not p.is_dir():
        raise Ds4fError(f"{p}: not a checkpoint directory")
    if (p / POOL_JSON).exists():
        return p, "ds4f"
    if (p / INDEX_NAME).exists() or any(p.glob("*.safetensors")):
        return p, "official"
    raise Ds4fError(f"{p}: not a checkpoint: no {POOL_JSON} (ds4f layout) and no {INDEX_NAME} or"
                    f" .safetensors shards (official release)")


def open_checkpoint(path: Path | str) -> Checkpoint:
    root, kind = detect_kind(path)
    return Ds4fCheckpoint(root) if kind == "ds4f" else OfficialCheckpoint(root)

