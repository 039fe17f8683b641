"""The out-of-the-box demo model: a synthetic checkpoint made once in the user's cache directory.

    path = ensure_demo_model(progress=callback)   # callback(done, total, label)
    path = ensure_synthetic("bench", progress=True, announce=print)   # the CLI: a message, then bars

The first call synthesises the `demo` geometry in the official format, converts it to the
ds4f layout and renames the result into place as <cache>/demo-ds4f; the official shards are
removed afterwards to save space. `announce(message)` is called once before a build starts
(build_message: what is made, where, and the disk it needs); `progress` is a callback on one
0..1000 scale, True for the synth and convert steps' own bars on stderr, or None/False for
nothing. A build that would not fit on the disk is refused before it starts. Later calls
return the existing directory at once, announcing nothing. A crash
or ^C never leaves a half model that looks whole: the work happens in a hidden sibling
directory and only a finished, marked conversion is renamed into place. A file lock keeps two
consoles started together from building it twice.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from ds4f.engine.checkpoint.base import LAYOUT_VERSION
from ds4f.paths import user_cache_dir
from ds4f.errors import Ds4fError
from ds4f.safe_read import read_regular_json

DEMO_DIRNAME = "demo-ds4f"
DEMO_GEOMETRY = "demo"
DEMO_SEED = 0
DEMO_VERSION = 4                # bump to rebuild everyone's demo model on next launch (a new layout does too);
                                # 2: synth writes the attention and hyper-connection tensors;
                                # 3: and the tokenizer files; 4: and the MTP layer (speculative decoding)
MARKER = "ds4f-demo.json"       # written last, inside the converted checkpoint
LAYOUT_FILES = ("trunk.bin", "trunk.json", "pool-mxfp4.bin", "pool-mxfp4.json")

ProgressCallback = Callable[[int, int, str], None]
Announce = Callable[[str], None]


def _marker(geometry: str, seed: int) -> dict:
    return {"format": "ds4f-demo", "version": DEMO_VERSION, "layout": LAYOUT_VERSION, "geometry": geometry,
            "seed": seed}


def is_complete(path: Path, geometry: str = DEMO_GEOMETRY, seed: int = DEMO_SEED) -> bool:
    """A finished demo conversion of this version (marker present and matching, layout files there)."""
    try:   # a regular file of a few bytes: a FIFO or a device under its name is no marker
        marker = read_regular_json(path / MARKER, "demo marker", 64 << 10)
    except Ds4fError:
        return False
    if marker != _marker(geometry, seed):
        return False
    return all((path / name).is_file() for name in LAYOUT_FILES)


def build_sizes(geometry: str) -> tuple[int, int]:
    """(bytes of the official shards synth writes, about the bytes of the converted layout):
    the totals the synth and convert bars count, and what the disk holds during a build.
    The converted size counts the layout's regions as convert lays them out: each layer's MoE
    region, its extra.N region (attention, hyper-connections) and the global region, every
    tensor 64-byte aligned and every region padded to 4 KiB, plus one 4 KiB-aligned record
    per expert (the MTP layer's included: synthetic models have one); only the JSON files are left out."""
    from ds4f.engine.checkpoint.base import TENSOR_ALIGN, align_up, moe_region_layout, official_name
    from ds4f.engine.checkpoint.tensors import mtp_tensors, official_tensors
    from ds4f.engine.model.geometry import get_geometry

    g = get_geometry(geometry)
    tensors = official_tensors(g) + mtp_tensors(g)
    official = sum(t.nbytes for t in tensors)
    moe = {official_name(L, short) for L in range(g.n_layers) for short, *_ in moe_region_layout(g, L)[0]}
    regions = sum(moe_region_layout(g, L)[1] for L in range(g.n_layers))
    other: dict[str, int] = {}   # extra.N and global: bytes so far, tensors 64-byte aligned
    for t in tensors:
        if (".experts." in t.name and ".shared_experts." not in t.name) or t.name in moe:
            continue
        parts = t.name.split(".")
        region = f"extra.{parts[1]}" if parts[0] == "layers" and int(parts[1]) < g.n_layers else "global"
        other[region] = align_up(other.get(region, 0), TENSOR_ALIGN) + t.nbytes
    regions += sum(align_up(n) for n in other.values())
    layers = g.n_layers + (1 if g.attention is not None else 0)
    converted = layers * g.n_experts * align_up(g.expert_nbytes) + regions
    return official, converted


def disk_size(n: float) -> str:
    """Bytes on disk in decimal units (kB, MB, GB: powers of 1000), as the progress bars count them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def build_message(geometry: str, out: Path) -> str:
    """What announce() is told before a build: the model, where it goes, and the disk it takes
    (in GB of 1e9 bytes, the unit of the synth and convert bars)."""
    from ds4f.engine.model.geometry import get_geometry

    g = get_geometry(geometry)
    official, converted = build_sizes(geometry)
    what = "the demo model" if geometry == DEMO_GEOMETRY else f"the {geometry} checkpoint"
    mtp = " + the MTP layer" if g.attention is not None else ""
    return (f"making {what} in {out} (once; later runs reuse it): {g.n_layers} layers{mtp} x {g.n_experts} experts, "
            f"synthesised in the official format ({disk_size(official)}), then converted to the ds4f layout "
            f"({disk_size(converted)}); {disk_size(official + converted)} of disk while it builds")


def _check_room(root: Path, geometry: str) -> None:
    official, converted = build_sizes(geometry)
    need = official + converted
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return
    if free < need:
        raise Ds4fError(f"{root}: {disk_size(free)} free, but making the {geometry} model needs "
                        f"{disk_size(need)} while it builds")


class _Stage:
    """Maps one step's progress (synth, then convert) onto one 0..1000 bar for the caller."""

    SCALE = 1000

    def __init__(self, callback: ProgressCallback | None, start: float, end: float, name: str):
        self.callback, self.start, self.end, self.name = callback, start, end, name

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.callback is None:
            return
        frac = (done / total) if total else 1.0
        value = self.start + (self.end - self.start) * max(0.0, min(1.0, frac))
        self.callback(int(value * self.SCALE), self.SCALE, f"{self.name}: {label}" if label else self.name)


class _BuildLock:
    """An exclusive lock file next to the demo model (fcntl where available)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = None

    def __enter__(self):
        self.fh = open(self.path, "a+")
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): a second console may build in parallel; renames stay atomic
            pass
        return self

    def __exit__(self, *exc):
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
        except ImportError:
            pass
        self.fh.close()
        return False


def ensure_demo_model(progress: ProgressCallback | bool | None = None, *, root: str | os.PathLike | None = None,
                      geometry: str = DEMO_GEOMETRY, seed: int = DEMO_SEED, dirname: str = DEMO_DIRNAME,
                      announce: Announce | None = None) -> Path:
    """The demo checkpoint's directory, made on first use (see the module docstring)."""
    from ds4f.engine.checkpoint.convert import convert_checkpoint
    from ds4f.engine.checkpoint.synth import synth_checkpoint
    from ds4f.engine.model.geometry import get_geometry

    root = Path(root) if root is not None else user_cache_dir()
    out = root / dirname
    if is_complete(out, geometry, seed):
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Ds4fError(f"{root}: cannot create the cache directory for the demo model: {exc.strerror}") from None
    with _BuildLock(root / f".{dirname}.lock"):
        if is_complete(out, geometry, seed):  # another process finished it while we waited
            return out
        for stale in root.glob(f".{dirname}.build-*"):  # left by a crash: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        _check_room(root, geometry)
        if announce is not None:
            announce(build_message(geometry, out))
        callback = progress if callable(progress) else None
        bars = progress is True   # synth's and convert's own bars; None and False: none
        work = root / f".{dirname}.build-{os.getpid()}-{int(time.time())}"
        work.mkdir()
        try:
            official = work / "official"
            converted = work / "ds4f"
            synth_checkpoint(official, geometry, seed=seed, mtp=get_geometry(geometry).attention is not None,
                             progress=_Stage(callback, 0.0, 0.5, "synthesising") if callback else bars)
            convert_checkpoint(official, converted,
                               progress=_Stage(callback, 0.5, 0.98, "converting") if callback else bars)
            shutil.rmtree(official, ignore_errors=True)  # the official shards are not needed once converted
            (converted / MARKER).write_text(json.dumps(_marker(geometry, seed)) + "\n")
            if callback is not None:
                callback(990, 1000, "moving into place")
            if out.exists() or out.is_symlink():
                old = root / f".{dirname}.build-old-{os.getpid()}"
                os.rename(out, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(converted, out)
        except OSError as exc:
            raise Ds4fError(f"{work}: cannot make the demo model: {exc.strerror or exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if callable(progress):
        progress(1000, 1000, "ready")
    return out


def ensure_synthetic(geometry: str, progress: ProgressCallback | bool | None = None, *,
                     announce: Announce | None = None, root: str | os.PathLike | None = None) -> Path:
    """A converted synthetic checkpoint of a named geometry (e.g. the `bench` model of the
    benchmarks) in the cache directory, made once, like the demo model."""
    if geometry == DEMO_GEOMETRY:
        return ensure_demo_model(progress, announce=announce, root=root)
    return ensure_demo_model(progress, geometry=geometry, dirname=f"{geometry}-ds4f", announce=announce, root=root)
