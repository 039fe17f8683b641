"""`ds4f bench llama`: ds4f against llama.cpp on the same model, side by side (optional: ds4f never
needs llama.cpp to build or test).

The model is the bench checkpoint. llama.cpp reads GGUF, made from the official shards by its
own converter (convert_hf_to_gguf.py of a llama.cpp source tree, with its gguf-py): the shards
are synthesised again with the bench checkpoint's geometry and seed (the same weights), converted
once into <cache>/bench-llama.gguf, and removed; a marker beside the GGUF names what it was made
from (the geometry, the seed, the converter's sources), so a changed converter converts again.
The converter keeps the routed experts in MXFP4 and writes the FP8 trunk as Q8_0. The synthetic
tokenizer is not one the converter knows by its hash: it is written with DeepSeek-V3's
pre-tokenizer (PRE_TOKENIZER), the only change to the converter's run, made from outside it.

Rounds alternate, ds4f first: ds4f, llama.cpp, ds4f, llama.cpp ... Each round is a child process
of its own, so its peak RSS is its own (os.wait4's ru_maxrss), and both hold every weight in RAM:
ds4f with the preset (default server: the trunk pinned) and an expert cache of the whole pool,
llama.cpp reading the GGUF into memory (--load-mode none) rather than mapping it. Both use the same
kernel threads, and measure the same things, llama-bench's way: a warm-up first, then `repeat`
times each of pp128 and pp512 (a prompt of that many random token ids on an empty context: its
tokens over the time it took) and tg (`gen` tokens decoded one at a time after one token: tokens
over their time), the figure the mean of the repetitions' tokens/s. The result gives each round's
figures with the load average before and after it, and the ratios ds4f / llama.cpp of the medians
over the rounds. `lock` (a file) is held with flock for each round, not across rounds, so that
other benchmarks on a shared machine run between them and none runs during one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ds4f.errors import Ds4fError

Log = Callable[[str], None]

PROMPTS = (128, 512)                 # llama-bench's pp tests: prompt lengths
GGUF_NAME = "bench-llama.gguf"
MARKER_NAME = "bench-llama.json"     # written last, beside the GGUF
OFFICIAL_DIRNAME = "bench-official"  # the official shards while the converter reads them
PRE_TOKENIZER = "deepseek-v3"        # llama.cpp's name for DeepSeek's pre-tokenizer (its regexes)
LLAMA_BENCH_PATHS = ("bin/llama-bench", "llama-bench")
CONVERTER_MODULES = ("torch", "transformers", "safetensors", "numpy", "sentencepiece")
MEMORY_WAIT_S = 600                  # how long a round waits for the memory it needs
METRICS = ("decode", *(f"pp{n}" for n in PROMPTS))

# The converter's run: llama.cpp's convert_hf_to_gguf.py as it is, except that a tokenizer whose
# pre-tokenizer hash it does not know is written with the given pre-tokenizer name instead of
# stopping (argv: source tree, pre-tokenizer, then the converter's own arguments).
_CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
sys.path[:0] = [src, src + "/gguf-py"]
try:
    from conversion import base as where
except ImportError:
    import convert_hf_to_gguf as where
known = where.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("ds4f: a pre-tokenizer llama.cpp does not list (a synthetic tokenizer): written as " + pre,
              file=sys.stderr)
        return pre
where.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
if where.__name__ == "convert_hf_to_gguf":
    where.main()
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _quiet(_line: str) -> None:
    pass


# -- what llama.cpp provides -----------------------------------------------------------------------
def find_llama_bench(build_dir) -> Path:
    """llama-bench in a llama.cpp build directory (bin/llama-bench, or at its top); a Ds4fError
    naming the paths looked at when there is none."""
    if not build_dir:
        raise Ds4fError("--llama-build: bench llama needs a llama.cpp build directory holding llama-bench "
                        "(cmake --build BUILD --target llama-bench)", param="llama_build")
    d = Path(build_dir).expanduser()
    if not d.is_dir():
        raise Ds4fError(f"--llama-build: {d}: no such directory (a llama.cpp build directory holding "
                        f"{d / LLAMA_BENCH_PATHS[0]})", param="llama_build")
    for rel in LLAMA_BENCH_PATHS:
        p = d / rel
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise Ds4fError(f"--llama-build: no llama-bench in {d}: neither {d / LLAMA_BENCH_PATHS[0]} nor "
                    f"{d / LLAMA_BENCH_PATHS[1]} is an executable file (cmake --build {d} --target llama-bench)",
                    param="llama_build")


def find_converter(src_dir) -> Path:
    """convert_hf_to_gguf.py of a llama.cpp source tree that also holds gguf-py; a Ds4fError
    naming the missing path."""
    if not src_dir:
        raise Ds4fError("--llama-src: bench llama needs llama.cpp's source tree, for its converter "
                        "(convert_hf_to_gguf.py) and gguf-py", param="llama_src")
    d = Path(src_dir).expanduser()
    if not d.is_dir():
        raise Ds4fError(f"--llama-src: {d}: no such directory (llama.cpp's source tree)", param="llama_src")
    script = d / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise Ds4fError(f"--llama-src: no converter in {d}: {script} is missing", param="llama_src")
    if not (d / "gguf-py" / "gguf").is_dir():
        raise Ds4fError(f"--llama-src: no gguf-py in {d}: {d / 'gguf-py' / 'gguf'} is missing (the converter "
                        f"imports it)", param="llama_src")
    return script


def check_converter_python(python: str) -> None:
    """The converter's interpreter imports what the converter needs; else a Ds4fError naming
    the interpreter and the missing modules."""
    probe = ("import importlib.util; print(','.join(m for m in %r if importlib.util.find_spec(m) is None))"
             % (CONVERTER_MODULES,))
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise Ds4fError(f"--llama-python: {python}: cannot run: {exc.strerror or exc}", param="llama_python") from None
    missing = done.stdout.strip()
    if done.returncode != 0 or missing:
        raise Ds4fError(f"--llama-python: {python} lacks what llama.cpp's converter imports "
                        f"({missing or done.stderr.strip()[-200:]}): pip install torch transformers safetensors "
                        f"sentencepiece there, or name a Python that has them", param="llama_python")


def converter_digest(src_dir) -> str:
    """sha256 over the converter's sources (convert_hf_to_gguf.py and conversion/*.py)."""
    d = Path(src_dir)
    files = [d / "convert_hf_to_gguf.py", *sorted((d / "conversion").glob("*.py"))]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


# -- the GGUF --------------------------------------------------------------------------------------
def _gguf_marker(geometry: str, seed: int, digest: str) -> dict:
    from ds4f.engine.checkpoint.synth import SYNTH_VERSION

    return {"format": "ds4f-bench-llama", "version": 1, "geometry": geometry, "seed": seed,
            "synth": SYNTH_VERSION, "pre_tokenizer": PRE_TOKENIZER, "converter_sha256": digest}


@contextmanager
def _flock(path: Path):
    import fcntl

    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_gguf(src_dir, python: str, *, geometry: str = "bench", root=None, log: Log = _quiet,
                progress=None) -> Path:
    """<root>/bench-llama.gguf (root: the user's cache directory), converted by llama.cpp's
    converter from the official shards of the checkpoint ensure_synthetic(geometry) makes, when
    no GGUF with a matching marker is there."""
    from ds4f.engine.checkpoint.demo import DEMO_SEED, build_sizes, disk_size
    from ds4f.engine.checkpoint.synth import synth_checkpoint
    from ds4f.engine.model.geometry import get_geometry
    from ds4f.paths import user_cache_dir

    root = Path(root) if root is not None else user_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    gguf, marker_path = root / GGUF_NAME, root / MARKER_NAME
    want = _gguf_marker(geometry, DEMO_SEED, converter_digest(src_dir))
    with _flock(root / f".{GGUF_NAME}.lock"):
        if _gguf_ready(gguf, src_dir, geometry):
            return gguf
        official_bytes, _ = build_sizes(geometry)
        need = 2 * official_bytes   # the shards, and a GGUF of about their size
        free = shutil.disk_usage(root).free
        if free < need:
            raise Ds4fError(f"{root}: {disk_size(free)} free, but converting the {geometry} checkpoint for "
                            f"llama.cpp needs {disk_size(need)} while it runs")
        marker_path.unlink(missing_ok=True)
        official = root / OFFICIAL_DIRNAME
        shutil.rmtree(official, ignore_errors=True)          # a crash's leftover: we hold the lock
        partial = root / f".{GGUF_NAME}.partial-{os.getpid()}"
        log(f"making {gguf} for llama.cpp (once; later runs reuse it): the {geometry} checkpoint's official shards "
            f"({disk_size(official_bytes)}, seed {DEMO_SEED}) in {official}, then llama.cpp's converter; the shards "
            f"are removed afterwards")
        try:
            synth_checkpoint(official, geometry, seed=DEMO_SEED, mtp=get_geometry(geometry).attention is not None,
                             progress=progress)
            conv_log = root / f"{GGUF_NAME}.convert.log"
            log(f"converting with {Path(src_dir) / 'convert_hf_to_gguf.py'} (its output: {conv_log})")
            with open(conv_log, "w") as out:
                done = subprocess.run([python, "-c", _CONVERT, str(src_dir), PRE_TOKENIZER, str(official),
                                       "--outfile", str(partial)], stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0 or not partial.is_file():
                tail = " / ".join(conv_log.read_text(errors="replace").strip().splitlines()[-3:])
                raise Ds4fError(f"llama.cpp's converter failed (exit {done.returncode}; {conv_log}): {tail}")
            os.replace(partial, gguf)
            marker_path.write_text(json.dumps(dict(want, bytes=gguf.stat().st_size)) + "\n")
        finally:
            shutil.rmtree(official, ignore_errors=True)
            partial.unlink(missing_ok=True)
    return gguf


# -- llama-bench's output --------------------------------------------------------------------------
def llama_test_name(n_prompt: int, n_gen: int) -> str:
    """llama-bench's name of a test: pp512, tg128, pp512+tg128."""
    if n_prompt and n_gen:
        return f"pp{n_prompt}+tg{n_gen}"
    return f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"


def parse_llama_bench(text: str) -> dict:
    """llama-bench's `-o json` output: {"tests": {name: {"tokens_per_s", "stddev", "samples",
    "n_depth"}}, "build_commit", "model_type", "model_size", "n_threads", "backends"}; a
    Ds4fError naming what is wrong with text that is not that."""
    try:
        records = json.loads(text)
    except ValueError as exc:
        raise Ds4fError(f"llama-bench's output is not JSON ({exc}): {text.strip()[:120]!r}") from None
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        raise Ds4fError("llama-bench's output: expected a JSON list of test records (-o json)")
    tests = {}
    for r in records:
        try:
            name = llama_test_name(int(r["n_prompt"]), int(r["n_gen"]))
            tests[name] = {"tokens_per_s": float(r["avg_ts"]), "stddev": float(r["stddev_ts"]),
                           "samples": [float(v) for v in r.get("samples_ts", ())], "n_depth": int(r.get("n_depth", 0))}
        except (KeyError, TypeError, ValueError) as exc:
            raise Ds4fError(f"llama-bench's output: a test record without a usable {exc} "
                            f"(fields: {', '.join(sorted(r))})") from None
    first = records[0]
    threads = {int(r.get("n_threads", 0)) for r in records}
    return {"tests": tests, "build_commit": first.get("build_commit"), "model_type": first.get("model_type"),
            "model_size": first.get("model_size"), "backends": first.get("backends"),
            "n_threads": threads.pop() if len(threads) == 1 else sorted(threads)}


# -- rounds ----------------------------------------------------------------------------------------
def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _wait_for_memory(need: int, what: str, log: Log, wait_s: float = MEMORY_WAIT_S) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        have = mem_available()
        if have is None or have >= need:
            return
        if time.monotonic() >= deadline:
            raise Ds4fError(f"{what} needs about {need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB is available "
                            f"(waited {wait_s:.0f} s): stop what holds the memory, then run it again")
        log(f"  {what}: waiting for memory ({have / 2**30:.1f} GiB available, {need / 2**30:.1f} GiB needed)")
        time.sleep(10)


# A small Python between this process and the measured one: Linux records the exec'ing process's
# high-water RSS into the new program's ru_maxrss, so a child started straight from a large process
# (a test runner, a console) would report at least that process's size. The launcher is small,
# waits for its own child with wait4, and writes that child's ru_maxrss (KiB) to argv[1].
_LAUNCHER = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[2:])\n"
             "_, status, usage = os.wait4(p.pid, 0)\n"
             "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
             "sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)\n")


def run_child(cmd: list[str], out_path: Path, err_path: Path, env=None) -> tuple[int, int]:
    """Run cmd with stdout and stderr to files; (exit status, peak RSS in bytes) of that child
    alone (the kernel's ru_maxrss for it, through _LAUNCHER, KiB on Linux)."""
    rss_path = Path(str(out_path) + ".maxrss")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(rss_path), *cmd], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    try:
        peak = int(rss_path.read_text()) * 1024
        rss_path.unlink()
    except (OSError, ValueError):
        peak = 0            # the launcher failed before its child ended: the status says why
    return proc.returncode, peak


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def llama_command(llama_bench: Path, gguf: Path, threads: int, gen: int, repeat: int) -> list[str]:
    """llama-bench on the GGUF: pp128 and pp512, tg`gen`, `repeat` times each, JSON, the weights read
    into memory (--load-mode none; -mmp 0 where the build is older than --load-mode)."""
    help_text = subprocess.run([str(llama_bench), "--help"], capture_output=True, text=True, timeout=60)
    load = ["-lm", "none"] if "--load-mode" in help_text.stdout + help_text.stderr else ["-mmp", "0"]
    return [str(llama_bench), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, PROMPTS)),
            "-n", str(gen), "-r", str(repeat), "-o", "json", *load]


def llama_round(cmd: list[str], gen: int, work: Path) -> dict:
    """One llama-bench child: its tests' tokens/s as METRICS, its peak RSS, its build."""
    code, rss = run_child(cmd, work / "llama.json", work / "llama.err")
    if code != 0:
        raise Ds4fError(f"llama-bench failed (exit {code}): {_tail(work / 'llama.err')}")
    parsed = parse_llama_bench((work / "llama.json").read_text(errors="replace"))
    tests = parsed["tests"]
    want = {"decode": f"tg{gen}", **{f"pp{n}": f"pp{n}" for n in PROMPTS}}
    missing = [name for name in want.values() if name not in tests]
    if missing:
        raise Ds4fError(f"llama-bench's output has no {', '.join(missing)} (it has {', '.join(tests)})")
    return {"engine": "llama.cpp", **{k: tests[name]["tokens_per_s"] for k, name in want.items()},
            "samples": {k: tests[name]["samples"] for k, name in want.items()}, "peak_rss": rss,
            "build_commit": parsed["build_commit"], "model_type": parsed["model_type"],
            "n_threads": parsed["n_threads"]}


def ds4f_command(model: Path, threads: int, gen: int, repeat: int, preset: str, config_path) -> list[str]:
    spec = {"model": str(model), "threads": threads, "gen": gen, "repeat": repeat, "preset": preset,
            "config_path": config_path}
    return [sys.executable, "-m", "ds4f.bench.llama", json.dumps(spec)]


def ds4f_round(cmd: list[str], work: Path) -> dict:
    """One ds4f child (ds4f_measure): its figures and its peak RSS."""
    code, rss = run_child(cmd, work / "ds4f.json", work / "ds4f.err")
    if code != 0:
        raise Ds4fError(f"the ds4f round failed (exit {code}): {_tail(work / 'ds4f.err')}")
    try:
        r = json.loads((work / "ds4f.json").read_text())
    except ValueError:
        raise Ds4fError(f"the ds4f round wrote no figures: {_tail(work / 'ds4f.err')}") from None
    return dict(r, engine="ds4f", peak_rss=rss)


def _prompt(vocab: int, n: int, seed: int) -> tuple[int, ...]:
    from ds4f.bench.prefill import _prompt as prompt_ids

    return prompt_ids(vocab, n, seed)


def ds4f_measure(model, threads: int, gen: int, repeat: int, preset: str = "server", config_path=None) -> dict:
    """In this process: one engine (EngineHost) with `preset`'s trunk and an expert cache of the
    whole pool; a warm-up run (a prompt of the longest length and a token), then `repeat` times
    pp128, pp512 and tg`gen` as llama-bench runs them, each a run of its own on the warm engine.
    Returns METRICS (mean tokens/s of the repetitions), their samples, and the runs' GB read
    per token and hit rate."""
    from dataclasses import replace

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import Budget
    from ds4f.runs.config import RunConfig
    from ds4f.runs.host import EngineHost
    from ds4f.runs.run import start_run
    from ds4f.settings import load_settings

    settings = load_settings(config_path)
    whole = replace(settings.engine.get_preset(preset), cache=Budget(fraction=1.0), cache_limit=None)
    with open_checkpoint(model) as ck:
        vocab = ck.geometry.vocab
    host = EngineHost()

    def one(prompt: tuple[int, ...], n_gen: int, mode: str) -> dict:
        rows: list = []
        run = start_run(RunConfig(model=str(model), preset=whole, gen=n_gen, prompt=prompt, kernel_threads=threads,
                                  config_path=config_path, probe_floor=False, dump="off", reuse_prefix=False),
                        engines=host, on_token=rows.append)
        run.wait()
        if run.state != "done":
            raise Ds4fError(run.error or f"a ds4f run ended {run.state}")
        n = len(prompt)
        if len(rows) != n + n_gen - 1:
            raise Ds4fError(f"a ds4f run of {n} prompt tokens and {n_gen} generated recorded {len(rows)} steps")
        timed = rows[:n] if mode == "prompt" else rows[n:]
        return {"tokens": len(timed), "seconds": sum(t.seconds for t in timed),
                "bytes": sum(t.bytes_read for t in timed), "hits": sum(t.hits for t in timed),
                "misses": sum(t.misses for t in timed)}

    one(_prompt(vocab, max(PROMPTS), 1), 1, "prompt")          # the warm-up: every expert read once
    samples: dict[str, list[float]] = {k: [] for k in METRICS}
    totals = {"tokens": 0, "bytes": 0, "hits": 0, "misses": 0}
    for rep in range(repeat):
        for n in PROMPTS:
            r = one(_prompt(vocab, n, 2 + rep), 1, "prompt")
            samples[f"pp{n}"].append(r["tokens"] / r["seconds"])
            for k in totals:
                totals[k] += r[k]
        r = one((0,), gen + 1, "decode")      # after the first token, `gen` decode steps
        samples["decode"].append(r["tokens"] / r["seconds"])
        for k in totals:
            totals[k] += r[k]
    looked = totals["hits"] + totals["misses"]
    return {**{k: statistics.fmean(v) for k, v in samples.items()}, "samples": samples,
            "gb_per_token": totals["bytes"] / 1e9 / totals["tokens"] if totals["tokens"] else None,
            "hit_rate": totals["hits"] / looked if looked else None, "preset": whole.name,
            "cache": "the whole pool", "threads": threads}


def ratios(rounds: list[dict]) -> dict:
    """{metric: {"ds4f", "llama", "ratio", "low", "high"}} for METRICS and peak_rss: the medians
    over the rounds of each engine, ds4f's over llama.cpp's, and the lowest and highest ratio of
    a ds4f round to the llama.cpp round after it."""
    ours = [r for r in rounds if r["engine"] == "ds4f"]
    theirs = [r for r in rounds if r["engine"] == "llama.cpp"]
    out = {}
    for key in (*METRICS, "peak_rss"):
        a = [r[key] for r in ours if r.get(key)]
        b = [r[key] for r in theirs if r.get(key)]
        if not a or not b:
            out[key] = {"ds4f": None, "llama": None, "ratio": None, "low": None, "high": None}
            continue
        pairs = [x[key] / y[key] for x, y in zip(ours, theirs) if x.get(key) and y.get(key)]
        ma, mb = statistics.median(a), statistics.median(b)
        out[key] = {"ds4f": ma, "llama": mb, "ratio": ma / mb, "low": min(pairs), "high": max(pairs)}
    return out


def bench_llama(llama_build, llama_src, *, rounds: int = 3, threads: int = 2, gen: int = 32, repeat: int = 3,
                preset: str = "server", python: str | None = None, lock: str | None = None,
                config_path: str | None = None, geometry: str = "bench", root=None, log: Log | None = None,
                progress=None) -> dict:
    """Alternate rounds (ds4f first) on the bench checkpoint and its GGUF. Returns {"rounds": [...],
    "ratios": ratios(rounds), "model", "gguf", "threads", "gen", "repeat", "preset", "llama_bench"}:
    each round {"engine", "round", METRICS..., "peak_rss", "load_before", "load_after", "seconds"}."""
    from ds4f.engine.checkpoint.demo import ensure_synthetic

    log = log or _quiet
    for name, value, low in (("--rounds", rounds, 1), ("--threads", threads, 1), ("--gen", gen, 1),
                             ("--repeat", repeat, 1)):
        if not isinstance(value, int) or value < low:
            raise Ds4fError(f"{name}: at least {low}, got {value!r}")
    llama_bench = find_llama_bench(llama_build)
    find_converter(llama_src)
    python = python or sys.executable
    root = Path(root) if root is not None else None
    gguf_path = (root if root is not None else _cache()) / GGUF_NAME
    if not _gguf_ready(gguf_path, llama_src, geometry):
        check_converter_python(python)
    model = ensure_synthetic(geometry, progress=progress, announce=log, root=root)
    gguf = ensure_gguf(Path(llama_src).expanduser(), python, geometry=geometry, root=root, log=log, progress=progress)
    llama_cmd = llama_command(llama_bench, gguf, threads, gen, repeat)
    ds4f_cmd = ds4f_command(model, threads, gen, repeat, preset, config_path)
    ds4f_need = sum(f.stat().st_size for f in model.iterdir() if f.is_file()) + (1 << 30)
    llama_need = int(gguf.stat().st_size * 1.1) + (1 << 30)
    out = []
    with tempfile.TemporaryDirectory(prefix="ds4f-bench-llama-") as tmp:
        work = Path(tmp)
        for i in range(rounds):
            for engine, need, go in (("ds4f", ds4f_need, lambda: ds4f_round(ds4f_cmd, work)),
                                     ("llama.cpp", llama_need, lambda: llama_round(llama_cmd, gen, work))):
                log(f"round {i + 1}/{rounds}: {engine}")
                with _flock(Path(lock)) if lock else _nothing():
                    _wait_for_memory(need, f"the {engine} round", log)
                    before, t0 = _loadavg(), time.monotonic()
                    r = go()
                    r.update(round=i + 1, load_before=before, load_after=_loadavg(),
                             seconds=time.monotonic() - t0)
                log(f"  decode {r['decode']:.2f} tok/s, pp128 {r['pp128']:.2f}, pp512 {r['pp512']:.2f}, "
                    f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB, load {r['load_before']} -> {r['load_after']}")
                out.append(r)
    return {"rounds": out, "ratios": ratios(out), "model": str(model), "gguf": str(gguf), "threads": threads,
            "gen": gen, "repeat": repeat, "preset": preset, "llama_bench": str(llama_bench),
            "llama_command": llama_cmd}


@contextmanager
def _nothing():
    yield


def _cache() -> Path:
    from ds4f.paths import user_cache_dir

    return user_cache_dir()


def _gguf_ready(gguf: Path, src_dir, geometry: str) -> bool:
    from ds4f.engine.checkpoint.demo import DEMO_SEED

    try:
        marker = json.loads((gguf.parent / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    want = _gguf_marker(geometry, DEMO_SEED, converter_digest(Path(src_dir).expanduser()))
    return {k: marker.get(k) for k in want} == want and gguf.is_file() and gguf.stat().st_size == marker.get("bytes")


def _main(argv: list[str]) -> int:
    """The ds4f round's child: ds4f_measure with the JSON spec of argv[0], its result on stdout."""
    spec = json.loads(argv[0])
    try:
        r = ds4f_measure(spec["model"], spec["threads"], spec["gen"], spec["repeat"], spec["preset"],
                         spec["config_path"])
    except Ds4fError as exc:
        print(f"ds4f bench llama: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
