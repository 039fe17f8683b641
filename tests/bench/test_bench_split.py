"""`ds4f bench split`: the decode steps' samples put in parts by their innermost frame. The parts
of frames as py-spy writes them (Python, ds4f's C sources, numpy's and libc's libraries), only a
decode step's samples counted; and the command end to end on the tiny model under a real py-spy,
its parts adding up."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds4f.bench.split import PARTS, classify, split_profile

STEP = "Thread.run (threading.py:982);Run._main (main/runs/run.py:259);Session.eval (main/engine/session.py:155);" \
       "forward_rows (main/engine/model/forward.py:283)"


def test_the_part_of_a_frame():
    assert classify("_mm256_fmadd_ps (fmaintrin.h:65)") == "kernels"
    assert classify("mx_rows (avx2_matvec.c:98)") == "kernels"
    assert classify("_cffi_f_ds4f_hc_pre (ds4f/native/_kernels.abi3.so)") == "kernels"
    assert classify("_check_finite_rows (main/engine/model/forward.py:351)") == "interpreter"
    assert classify("_PyEval_EvalFrameDefault (libpython3.11.so.1.0)") == "interpreter"
    assert classify("PyArray_NewFromDescr_int (numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so)") == "numpy"
    assert classify("dgemm_kernel (numpy.libs/libscipy_openblas64_-ff651d7f.so)") == "numpy"
    assert classify("pthread_cond_signal (libc.so.6)") == "waiting"
    assert classify("0x7f3c592a3f16 (libc.so.6)") == "waiting"
    assert classify("cdatafrombuf_dealloc (_cffi_backend.cpython-311-x86_64-linux-gnu.so)") == "other"


def test_only_decode_steps_count_and_the_shares_add_up():
    lines = [f"{STEP};_moe (main/engine/model/forward.py:317);mx_rows (avx2_matvec.c:98) 30\n",
             f"{STEP};rms_norm (main/engine/model/ops.py:20);PyArray_Where (numpy/_core/_multiarray_umath.so) 6\n",
             f"{STEP};_live (main/engine/model/forward.py:330) 3\n",
             f"{STEP};sem_post (libc.so.6) 1\n",
             # the prompt's chunk and the load are not decode steps
             "Run._main (main/runs/run.py:259);Session.prefill (main/engine/session.py:190);"
             "forward_rows (main/engine/model/forward.py:283);mx_rows (avx2_matvec.c:98) 500\n",
             "Run._main (main/runs/run.py:259);load_attention (main/engine/resident.py:56) 70\n",
             "not a sample line\n"]
    r = split_profile(lines)
    assert r["samples"] == 40
    assert r["counts"] == {"kernels": 30, "numpy": 6, "interpreter": 3, "waiting": 1, "other": 0}
    assert r["parts"]["kernels"] == pytest.approx(0.75) and sum(r["parts"].values()) == pytest.approx(1.0)
    assert [t[0] for t in r["top"]] == ["numpy", "interpreter", "waiting"]     # the kernels' frames are not listed


def _spy() -> str | None:
    return shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                      if (Path(sys.executable).parent / "py-spy").exists() else None)


@pytest.mark.skipif(_spy() is None, reason="py-spy is not installed (pip install py-spy)")
def test_bench_split_end_to_end(tiny_model, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        probe = subprocess.run([_spy(), "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=60)
    finally:
        child.kill()
        child.wait()
    if probe.returncode != 0 and ("ermission" in probe.stderr or "ptrace" in probe.stderr.lower()):
        pytest.skip(f"py-spy may not attach to a process here: {probe.stderr.strip()[:120]}")
    out = tmp_path / "split.json"
    done = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "split", str(tiny_model), "-n", "48",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    # (on the tiny model the kernels take microseconds a layer: few or none of the samples are theirs)
    assert set(r["parts"]) == set(PARTS) and sum(r["parts"].values()) == pytest.approx(1.0)
    assert r["samples"] == sum(r["counts"].values()) > 0
    assert all(part != "kernels" and part in PARTS for part, _frame, _share in r["top"])
    assert r["preset"] == "server" and r["gen"] == 48
    assert "kernels" in done.stdout and "interpreter" in done.stdout
