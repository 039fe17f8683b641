"""`ds4f bench llama`, the parts that need no llama.cpp: llama-bench's JSON output read from a
sample written from the fields its README documents for `-o json`; the ratios over alternated
rounds; the errors naming a missing llama-bench or converter; a round of a stand-in llama-bench
(a real child process: its peak RSS is its own); and the whole command on the tiny model with a
stand-in converter and llama-bench, the ds4f rounds real."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4f.bench.llama import (GGUF_NAME, MARKER_NAME, OFFICIAL_DIRNAME, PRE_TOKENIZER, bench_llama, find_converter,
                              find_llama_bench, llama_command, llama_round, parse_llama_bench, ratios)
from ds4f.errors import Ds4fError


def _record(n_prompt: int, n_gen: int, avg_ts: float, samples: list[float], threads: int = 2) -> dict:
    """One test record with the fields llama-bench's README shows for `-o json`."""
    n = max(n_prompt, n_gen)
    return {"build_commit": "8cf427ff", "build_number": 5163, "cpu_info": "Intel(R) Xeon(R) Processor",
            "gpu_info": "", "backends": "CPU", "model_filename": "bench-llama.gguf",
            "model_type": "deepseek4 ?B MXFP4 MoE", "model_size": 9214771200, "model_n_params": 13842412544,
            "n_batch": 2048, "n_ubatch": 512, "n_threads": threads, "cpu_mask": "0x0", "cpu_strict": False,
            "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0, "split_mode": "layer",
            "main_gpu": 0, "no_kv_offload": False, "flash_attn": -1, "devices": "auto", "tensor_split": "0.00",
            "tensor_buft_overrides": "none", "use_mmap": False, "use_direct_io": False, "embeddings": False,
            "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0, "fit_min_ctx": 0,
            "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "test_time": "2025-04-24T11:58:50Z",
            "avg_ns": int(n / avg_ts * 1e9), "stddev_ns": 1453752, "avg_ts": avg_ts, "stddev_ts": 0.25,
            "samples_ns": [int(n / s * 1e9) for s in samples], "samples_ts": samples}


SAMPLE = [_record(128, 0, 21.5, [21.0, 22.0]), _record(512, 0, 18.25, [18.0, 18.5]), _record(0, 32, 2.75, [2.5, 3.0])]


def test_llama_bench_json_is_read_by_test():
    r = parse_llama_bench(json.dumps(SAMPLE, indent=2))
    assert sorted(r["tests"]) == ["pp128", "pp512", "tg32"]
    assert r["tests"]["pp512"]["tokens_per_s"] == 18.25 and r["tests"]["pp512"]["samples"] == [18.0, 18.5]
    assert r["tests"]["tg32"]["tokens_per_s"] == 2.75 and r["tests"]["tg32"]["stddev"] == 0.25
    assert r["build_commit"] == "8cf427ff" and r["n_threads"] == 2 and r["model_size"] == 9214771200
    mixed = parse_llama_bench(json.dumps([_record(512, 128, 9.0, [9.0])]))
    assert list(mixed["tests"]) == ["pp512+tg128"]


@pytest.mark.parametrize("text, named", [
    ("| model | size |", "not JSON"),
    (json.dumps({"n_prompt": 128}), "list of test records"),
    (json.dumps([]), "list of test records"),
    (json.dumps([{k: v for k, v in SAMPLE[0].items() if k != "avg_ts"}]), "avg_ts"),
])
def test_output_that_is_not_llama_bench_json_is_named(text, named):
    with pytest.raises(Ds4fError, match=named):
        parse_llama_bench(text)


def _round(engine: str, i: int, decode: float, pp128: float, pp512: float, rss: int) -> dict:
    return {"engine": engine, "round": i, "decode": decode, "pp128": pp128, "pp512": pp512, "peak_rss": rss}


def test_ratios_are_medians_over_rounds_and_the_pairs_bound_them():
    gib = 2**30
    rounds = [_round("ds4f", 1, 2.0, 30.0, 10.0, 9 * gib), _round("llama.cpp", 1, 4.0, 20.0, 20.0, 14 * gib),
              _round("ds4f", 2, 3.0, 60.0, 12.0, 8 * gib), _round("llama.cpp", 2, 4.0, 20.0, 24.0, 16 * gib),
              _round("ds4f", 3, 4.0, 45.0, 11.0, 10 * gib), _round("llama.cpp", 3, 8.0, 30.0, 22.0, 15 * gib)]
    r = ratios(rounds)
    # medians: decode 3 / 4, pp128 45 / 20, pp512 11 / 22, RSS 9 / 15
    assert r["decode"]["ds4f"] == 3.0 and r["decode"]["llama"] == 4.0 and r["decode"]["ratio"] == pytest.approx(0.75)
    assert (r["decode"]["low"], r["decode"]["high"]) == (pytest.approx(0.5), pytest.approx(0.75))
    assert r["pp128"]["ratio"] == pytest.approx(2.25) and r["pp128"]["high"] == pytest.approx(3.0)
    assert r["pp512"]["ratio"] == pytest.approx(0.5)
    assert (r["pp512"]["low"], r["pp512"]["high"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert r["peak_rss"]["ratio"] == pytest.approx(0.6) and r["peak_rss"]["low"] == pytest.approx(0.5)
    missing = ratios([_round("ds4f", 1, 2.0, 30.0, 10.0, 9 * gib)])
    assert missing["decode"] == {"ds4f": None, "llama": None, "ratio": None, "low": None, "high": None}


# A stand-in llama-bench: the arguments of a real one, the JSON of the sample above for the tests it
# is asked, after holding MIB MiB of touched memory (its peak RSS).
FAKE_BENCH = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("  -lm, --load-mode <auto|none|mmap|mlock|mmap+mlock|dio> (default: auto)")
    sys.exit(0)
opt = dict(zip(args[::2], args[1::2]))
assert os.path.isfile(opt["-m"]), opt["-m"]
assert opt["-o"] == "json" and opt["-lm"] == "none", args
with open(os.environ["FAKE_BENCH_LOG"], "a") as f:
    f.write("llama\\n")
held = bytearray({mib} << 20)
for i in range(0, len(held), 4096):
    held[i] = 1
sample = {sample}
out = []
for p in opt["-p"].split(","):
    rec = dict(sample[0], n_prompt=int(p), n_gen=0, n_threads=int(opt["-t"]))
    rec["avg_ts"] = {{"128": 21.5, "512": 18.25}}[p]
    out.append(rec)
out.append(dict(sample[2], n_prompt=0, n_gen=int(opt["-n"]), n_threads=int(opt["-t"])))
print(json.dumps(out, indent=2))
"""


def _fake_build(root: Path, mib: int = 96) -> Path:
    build = root / "build"
    (build / "bin").mkdir(parents=True)
    exe = build / "bin" / "llama-bench"
    exe.write_text(FAKE_BENCH.format(python=sys.executable, mib=mib, sample=repr(SAMPLE)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return build


def test_missing_llama_bench_and_converter_are_named(tmp_path):
    with pytest.raises(Ds4fError, match="--llama-build: .*needs a llama.cpp build directory"):
        find_llama_bench(None)
    with pytest.raises(Ds4fError, match=f"{tmp_path / 'gone'}: no such directory"):
        find_llama_bench(tmp_path / "gone")
    with pytest.raises(Ds4fError, match=f"neither {tmp_path / 'bin' / 'llama-bench'} nor {tmp_path / 'llama-bench'}"):
        find_llama_bench(tmp_path)
    assert find_llama_bench(_fake_build(tmp_path)) == tmp_path / "build" / "bin" / "llama-bench"
    src = tmp_path / "llama.cpp"
    src.mkdir()
    with pytest.raises(Ds4fError, match=f"{src / 'convert_hf_to_gguf.py'} is missing"):
        find_converter(src)
    (src / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(Ds4fError, match=f"{src / 'gguf-py' / 'gguf'} is missing"):
        find_converter(src)
    (src / "gguf-py" / "gguf").mkdir(parents=True)
    assert find_converter(src) == src / "convert_hf_to_gguf.py"


def test_the_cli_names_the_missing_llama_bench_before_any_work(tmp_path):
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "llama", "--llama-build", str(tmp_path),
                           "--llama-src", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert f"{tmp_path / 'bin' / 'llama-bench'}" in done.stderr, done.stderr
    assert not (Path(env["XDG_CACHE_HOME"]) / "ds4f" / GGUF_NAME).exists()
    done = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "engine", "--llama-src", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--llama-src: only bench llama takes it" in done.stderr


def test_a_llama_round_reads_the_childs_output_and_its_own_peak_rss(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_LOG", str(tmp_path / "calls"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cmd = llama_command(find_llama_bench(_fake_build(tmp_path, mib=96)), gguf, 2, 32, 3)
    assert cmd[cmd.index("-p") + 1] == "128,512" and cmd[cmd.index("-r") + 1] == "3" and "-lm" in cmd
    ballast = np.ones(512 << 17)           # 512 MiB resident here: the child's figure must not count it
    r = llama_round(cmd, 32, tmp_path)
    assert ballast.sum() == 512 << 17
    assert (r["decode"], r["pp128"], r["pp512"]) == (2.75, 21.5, 18.25)
    assert r["samples"]["decode"] == [2.5, 3.0] and r["n_threads"] == 2
    assert 96 << 20 < r["peak_rss"] < 400 << 20     # the child's 96 MiB, not this process's RSS
    with pytest.raises(Ds4fError, match="has no tg64"):
        llama_round(cmd[:cmd.index("-n") + 1] + ["8"] + cmd[cmd.index("-n") + 2:], 64, tmp_path)


# A stand-in for llama.cpp's converter, with the shape ds4f's run of it relies on: a TextModel whose
# get_vocab_base_pre refuses a tokenizer it does not know, and main() writing --outfile.
FAKE_CONVERTER = """
import json, sys
from pathlib import Path

class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")

def main():
    model, out = Path(sys.argv[1]), Path(sys.argv[sys.argv.index("--outfile") + 1])
    config = json.loads((model / "config.json").read_text())
    assert (model / "model.safetensors.index.json").is_file()
    with open(Path(__file__).parent / "calls", "a") as f:
        f.write("convert\\n")
    out.write_text(json.dumps({"pre": TextModel().get_vocab_base_pre(None), "layers": config["num_hidden_layers"]}))

if __name__ == "__main__":
    main()
"""


def _fake_source(root: Path) -> Path:
    src = root / "llama.cpp"
    (src / "gguf-py" / "gguf").mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    return src


def _python_with_converter_modules(root: Path) -> str:
    """This Python, with empty modules under the names the converter's interpreter is checked for."""
    stubs = root / "stubs"
    for name in ("torch", "transformers", "safetensors", "numpy", "sentencepiece"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("")
    exe = root / "python"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={stubs} exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_bench_llama_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_LOG", str(tmp_path / "llama.cpp" / "calls"))
    src, build, root = _fake_source(tmp_path), _fake_build(tmp_path), tmp_path / "cache"
    with pytest.raises(Ds4fError, match=f"--llama-python: {sys.executable} lacks .*torch"):
        bench_llama(build, src, geometry="tiny", root=root)
    python = _python_with_converter_modules(tmp_path)
    lines: list[str] = []
    r = bench_llama(build, src, rounds=2, threads=2, gen=4, repeat=1, python=python, geometry="tiny", root=root,
                    log=lines.append)
    assert [(x["engine"], x["round"]) for x in r["rounds"]] == [("ds4f", 1), ("llama.cpp", 1), ("ds4f", 2),
                                                               ("llama.cpp", 2)]
    gguf = root / GGUF_NAME
    assert json.loads(gguf.read_text()) == {"pre": PRE_TOKENIZER, "layers": 4}     # the tiny geometry's layers
    assert json.loads((root / MARKER_NAME).read_text())["bytes"] == gguf.stat().st_size
    assert not (root / OFFICIAL_DIRNAME).exists()                  # the shards went once converted
    ours = [x for x in r["rounds"] if x["engine"] == "ds4f"]
    assert all(x["decode"] > 0 and x["pp128"] > 0 and x["pp512"] > 0 and x["hit_rate"] == 1.0 for x in ours)
    assert all(x["peak_rss"] > 0 and x["load_before"] and x["load_after"] for x in r["rounds"])
    m = r["ratios"]
    ds4f_decode = sorted(x["decode"] for x in ours)
    assert m["decode"]["llama"] == 2.75 and m["pp512"]["llama"] == 18.25
    assert m["decode"]["ratio"] == pytest.approx((ds4f_decode[0] + ds4f_decode[1]) / 2 / 2.75)
    assert (tmp_path / "llama.cpp" / "calls").read_text() == "convert\nllama\nllama\n"
    # a second run converts nothing; a changed converter converts again
    bench_llama(build, src, rounds=1, gen=4, repeat=1, python=python, geometry="tiny", root=root)
    assert (tmp_path / "llama.cpp" / "calls").read_text().count("convert") == 1
    (src / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER + "\n# changed\n")
    bench_llama(build, src, rounds=1, gen=4, repeat=1, python=python, geometry="tiny", root=root)
    assert (tmp_path / "llama.cpp" / "calls").read_text().count("convert") == 2


def test_the_ratio_table_shows_the_medians_and_their_ratio():
    from ds4f.cli.bench import _llama_tables

    gib = 2**30
    rounds = [_round("ds4f", 1, 2.0, 30.0, 10.0, 9 * gib), _round("llama.cpp", 1, 4.0, 20.0, 20.0, 12 * gib)]
    for r in rounds:
        r.update(load_before="0.10 0.20 0.30", load_after="2.00 1.00 0.50")
    result = {"rounds": rounds, "ratios": ratios(rounds), "threads": 2, "gen": 32, "repeat": 3, "preset": "server"}
    per_round, table = _llama_tables(result)
    assert [row[:2] for row in per_round.rows] == [[1, "ds4f"], [1, "llama.cpp"]]
    lines = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in table.text().splitlines()[1:]
             if line.strip() and not line.startswith("-")}
    assert lines["decode tok/s"][:3] == ["2.00", "4.00", "0.50"]
    assert lines["pp128 tok/s"][:3] == ["30.00", "20.00", "1.50"]
    assert lines["peak RSS"][1:4] == ["9.00", "12.00", "0.75"]
