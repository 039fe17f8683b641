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


def test_the_pieces_of_the_model():
    """Each decode sample goes to the piece of the model on its stack: the hyper-connections
    (around either sublayer or the head's), the attention, the experts, the head's product; the
    rest (norms, routing) to none of them."""
    hc = "hc_pre_rows (main/engine/model/hyper.py:60);hc_pre (main/native/kernels.py:700);ds4f_hc_pre (hyper.c:10)"
    lines = [f"{STEP};attention_sublayer (main/engine/model/forward.py:130);{hc} 5\n",
             f"{STEP};hc_post_rows (main/engine/model/hyper.py:80);memcpy (libc.so.6) 2\n",
             f"{STEP};hc_head (main/engine/model/hyper.py:96);_PyEval_EvalFrameDefault (libpython3.11.so.1.0) 1\n",
             f"{STEP};attention_sublayer (main/engine/model/forward.py:130);attention_parts (main/engine/model/"
             f"attention.py:380);matmul (main/native/kernels.py:480);fp8_rows (avx512_matmul.c:231) 20\n",
             f"{STEP};_moe (main/engine/model/forward.py:317);_experts (main/engine/model/forward.py:400);"
             f"mx_rows (avx2_matvec.c:98) 40\n",
             f"{STEP};matmul (main/native/kernels.py:480);eo_rows (avx512_matmul.c:80) 12\n",
             f"{STEP};_moe (main/engine/model/forward.py:317);_route_rows (main/engine/model/forward.py:360);"
             f"rms_norm (main/engine/model/ops.py:20) 20\n"]
    r = split_profile(lines)
    assert r["samples"] == 100
    assert r["pieces"] == pytest.approx({"hyper-connections": 0.08, "attention": 0.20, "experts": 0.40, "head": 0.12})


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
    assert r["preset"] == "ram" and r["gen"] == 48 and r["warm_prompt"] > 0   # the model in RAM, warmed
    assert "kernels" in done.stdout and "interpreter" in done.stdout and "hyper-connections" in done.stdout
    assert set(r["pieces"]) == {"hyper-connections", "attention", "experts", "head"} and sum(r["pieces"].values()) <= 1
