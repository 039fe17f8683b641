"""`ds4f bench console` end to end on the tiny checkpoint: figures on stdout, the dict as JSON."""
import json
import subprocess
import sys


def _ds4f(*args):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_bench_console_prints_figures_and_writes_json(tiny_model, tmp_path):
    out = _ds4f("bench", "console", tiny_model, "--json", tmp_path / "console.json")
    assert out.returncode == 0, out.stderr
    assert "key to action" in out.stdout and "bytes/refresh" in out.stdout
    figures = json.loads((tmp_path / "console.json").read_text())
    assert figures["keys"] == len(figures["key_latency_s"]) > 0
    assert figures["key_latency_median_s"] > 0


def test_bench_console_refuses_the_other_benches_flags(tmp_path):
    out = _ds4f("bench", "console", tmp_path, "--gen", "3")
    assert out.returncode == 2 and "--gen" in out.stderr and "Traceback" not in out.stderr
    missing = _ds4f("bench", "console", tmp_path / "nope")
    assert missing.returncode == 2 and "nope" in missing.stderr and "Traceback" not in missing.stderr
