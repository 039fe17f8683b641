"""Synthetic checkpoints kept in the user's cache directory: the demo and bench models.

ensure_synthetic(name) returns a converted (ds4f layout) checkpoint of the named geometry,
making it on first use: synthesize the official shards, convert, keep the sample prompts,
drop the shards. Each stage writes under a temporary name and renames, so an interrupted
first launch never leaves a half model that looks whole.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .config import user_cache_dir
from .errors import Ds4fError


def synthetic_path(name: str) -> Path:
    return user_cache_dir() / f"{name}-ds4f"


def ensure_synthetic(name: str, progress=None, seed: int = 0) -> Path:
    """The converted synthetic checkpoint `name`, made now if missing or incomplete."""
    from .checkpoint import open_checkpoint
    from .convert import convert_checkpoint
    from .synth import synth_checkpoint

    dst = synthetic_path(name)
    if dst.exists():
        try:
            open_checkpoint(dst).close()
            return dst
        except Ds4fError:
            shutil.rmtree(dst)  # incomplete or from an older format: make it again
    official = user_cache_dir() / f"{name}-official.partial"
    if official.exists():
        shutil.rmtree(official)
    official.parent.mkdir(parents=True, exist_ok=True)
    try:
        synth_checkpoint(official, name, seed=seed, progress=progress)
        convert_checkpoint(official, dst, progress=progress)
        prompts = official / "prompts.json"
        if prompts.is_file() and not (dst / "prompts.json").exists():
            shutil.copyfile(prompts, dst / "prompts.json")
    finally:
        shutil.rmtree(official, ignore_errors=True)
    return dst
