"""`ds4f bench split`: where a decode token's time goes, by what the CPU was running.

A run decodes on MODEL (default: the bench checkpoint, the real expert and attention width) in a
child process that py-spy samples with its native frames (`py-spy record --native`, an optional
tool: `pip install py-spy`). Each sample of the compute thread inside a decode step (Session.eval
under forward_rows: the prompt's chunks and the load are left out) is put in one part by its
innermost frame:

    kernels      ds4f's native code (a frame in a .c / .h source of native/, or its library)
    numpy        numpy's library (ufuncs, reductions, copies, casts) and the BLAS it calls
    interpreter  Python: a .py frame, or libpython itself (the per-layer glue, argument checks)
    waiting      libc: waits on a lock or a condition (expert reads in flight, the kernels' pool),
                 memcpy, the math library
    other        anything else (cffi's own conversions, ...)

The shares are of the samples, so of the decode steps' wall time on the compute thread; the
figures are ratios from one run, not times. By default the run keeps the whole model in RAM (a
preset written for it: every layer pinned, the expert cache the size of all experts, no
prefetch) and first prefills a prompt of WARM_PROMPT tokens, which reads nearly every expert
once: its decode steps then read nothing, and what they spend beyond the kernels is the token's
fixed cost. --preset / --config measure another preset as it is, reads and their waits included.
"""
from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ds4f.errors import Ds4fError

PARTS = ("kernels", "numpy", "interpreter", "waiting", "other")
# what of the model a sample computes, by the forward pass's functions on its stack (the rest:
# the embedding, routing, norms, the records): the hyper-connections around both sublayers and the
# head's, the attention (projections and core), the experts (routed and shared, their waits
# included), the head's product (forward_rows' own call to the kernels)
PIECES = {"hyper-connections": ("hc_pre_rows ", "hc_post_rows ", "hc_head "), "attention": ("attention_parts ",),
          "experts": ("_experts ",), "head": ()}
SAMPLE_HZ = 250
WARM_PROMPT = 64                    # prompt tokens prefilled before the decode (not sampled): the cache warms
IN_RAM = """[presets.ram]
pinned_layers = "all"
cache = "100%"
policy = "cycle"
prefetch = false
context = 4096
prefill_chunk = 64
"""
STEP_FRAME = "Session.eval "        # a decode token (prefill goes through Session.prefill)
FORWARD_FRAME = "forward_rows "


def classify(leaf: str) -> str:
    """The part a sample belongs to, from its innermost frame as py-spy's raw format writes it:
    `function (file.py:line)`, `function (source.c:line)` or `function (library.so)`."""
    where = leaf[leaf.rfind("(") + 1:-1] if leaf.endswith(")") else ""
    if re.search(r"\.(c|h):\d+$", where) or "ds4f/native/_kernels" in where or "_kernels.abi3" in where:
        return "kernels"
    if ".py:" in where or "libpython" in where:
        return "interpreter"
    if "numpy" in where or "openblas" in where.lower() or "libblas" in where or "scipy_openblas" in where:
        return "numpy"
    if re.search(r"\blib(c|m|pthread)[.-]", where) or where.startswith("libc"):
        return "waiting"
    return "other"


def piece(frames: list[str]) -> str | None:
    """The PIECES name of a decode step's sample (its frames outermost first), or None."""
    below = frames[next(i for i, f in enumerate(frames) if f.startswith(FORWARD_FRAME)) + 1:]
    if not below:
        return None
    for name, starts in PIECES.items():
        if starts and any(f.startswith(starts) for f in below):
            return name
    return "head" if below[0].startswith("matmul ") and "kernels.py" in below[0] else None


def split_profile(lines) -> dict:
    """{"samples", "parts": {part: share}, "counts": {part: samples}, "top": [(part, frame, share)],
    "pieces": {piece: share}} of py-spy raw lines (`frame;frame;...;leaf count`), the decode steps'
    samples only."""
    counts: collections.Counter = collections.Counter()
    pieces: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if not (any(f.startswith(STEP_FRAME) for f in frames) and any(f.startswith(FORWARD_FRAME) for f in frames)):
            continue
        part = classify(frames[-1])
        counts[part] += int(n)
        pieces[piece(frames)] += int(n)
        leaves[(part, frames[-1])] += int(n)
        total += int(n)
    if not total:
        raise Ds4fError("bench split: no sample fell in a decode step (py-spy saw no Session.eval under"
                        " forward_rows); decode more tokens (-n)")
    top = [(part, leaf, k / total) for (part, leaf), k in leaves.most_common() if part != "kernels"][:12]
    return {"samples": total, "parts": {p: counts[p] / total for p in PARTS}, "counts": {p: counts[p] for p in PARTS},
            "top": top, "pieces": {p: pieces[p] / total for p in PIECES}}


def bench_split(model=None, preset: str | None = None, gen: int | None = None, config_path: str | None = None,
                backend: str | None = None, threads: int = 1, *, log=None, progress=None) -> dict:
    """Decode `gen` tokens (default 24) on `model` under py-spy and split the decode steps' samples
    (split_profile). preset None (and no config_path): the whole model in RAM, warmed by a prompt
    (see the module's docstring). Returns its figures with the run's settings."""
    from ds4f.bench.engine import bench_model

    spy = shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                     if (Path(sys.executable).parent / "py-spy").exists() else None)
    if spy is None:
        raise Ds4fError("bench split samples the run with py-spy, which is not installed here (pip install py-spy)")
    model = bench_model(model, progress, log)
    gen = gen or 24
    in_ram = preset is None and config_path is None
    with tempfile.TemporaryDirectory(prefix="ds4f-split-") as tmp:
        if in_ram:
            preset, config_path = "ram", Path(tmp) / "ds4f.toml"
            config_path.write_text(IN_RAM)
        cmd = [sys.executable, "-m", "ds4f.cli", "run", str(model), "--preset", preset or "server", "-n", str(gen),
               "--dump", "off", "--no-probe", "-t", str(threads)]
        if in_ram:
            cmd += ["-p", ",".join(str(t) for t in range(1, WARM_PROMPT + 1))]
        if backend:
            cmd += ["--backend", backend]
        if config_path:
            cmd += ["--config", str(config_path)]
        raw = Path(tmp) / "profile.txt"
        if log:
            log(f"decoding {gen} tokens on {model} under py-spy ({SAMPLE_HZ} samples/s, native frames)"
                + (f", the model in RAM after a {WARM_PROMPT}-token prompt" if in_ram else ""))
        done = subprocess.run([spy, "record", "--native", "-r", str(SAMPLE_HZ), "-f", "raw", "-o", str(raw), "--",
                               *cmd], capture_output=True, text=True)
        if done.returncode != 0 or not raw.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise Ds4fError("bench split: the sampled run failed: " + " / ".join(tail))
        with open(raw) as f:
            out = split_profile(f)
    return dict(out, model=str(model), preset=preset or "server", gen=gen, threads=threads,
                backend=backend or "best", warm_prompt=WARM_PROMPT if in_ram else 0)
