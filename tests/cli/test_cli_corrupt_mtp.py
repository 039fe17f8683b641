"""A corrupt expert of the MTP layer is named as the MTP layer's, with its file: never as the main
model's "layer 0" (the one-layer block the drafts run on) nor as "layer N" (its records' index in
the pool). Real checkpoints with the MTP layer, corrupted on disk, run with speculation."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from ds4f.engine.checkpoint.convert import convert_checkpoint
from ds4f.engine.checkpoint.synth import synth_checkpoint
from ds4f.engine.model.geometry import get_geometry

G = get_geometry("tiny")


def ds4f(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def mtp_official(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("mtp") / "official", "tiny", seed=0, mtp=True)


def _mtp_scales(shard_dir):
    """(shard, absolute offset, length) of every MTP expert's scale tensor in the release's shards."""
    for shard in sorted(shard_dir.glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name.startswith("mtp.0.ffn.experts.") and name.endswith(".scale"):
                a, b = t["data_offsets"]
                yield shard, 8 + n + a, b - a


def _pool(layout):
    doc = json.loads((layout / "pool-mxfp4.json").read_text())
    mtp = range(G.n_layers * G.n_experts, (G.n_layers + 1) * G.n_experts)
    return doc, mtp


def _refused(out, *words, absent=()):
    assert out.returncode != 0 and "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    for w in words:
        assert str(w) in line, (w, line)
    for w in absent:
        assert w not in line, (w, line)
    return line


def test_nan_scales_of_the_mtp_experts_in_the_release(mtp_official, tmp_path):
    src = tmp_path / "official"
    shutil.copytree(mtp_official, src)
    shards = set()
    for shard, off, n in _mtp_scales(src):                  # every MTP expert's scales NaN (0xFF)
        with open(shard, "r+b") as f:
            f.seek(off)
            f.write(b"\xff" * n)
        shards.add(shard)
    assert shards
    line = _refused(ds4f("run", src, "--spec", "3", "-n", "16", "--no-probe", "--dump", "off"),
                    "the MTP layer's expert", "mtp.0.ffn.experts.", *map(str, shards), absent=("layer 0",))
    assert "non-finite" in line


def test_nan_scales_of_the_mtp_experts_in_the_ds4f_layout(mtp_official, tmp_path):
    """NaN scales under a correct crc32 (as the release's own NaN scales are): the forward pass
    finds them and names the MTP layer's record in the pool file."""
    layout = convert_checkpoint(mtp_official, tmp_path / "ds4f", progress=False)
    doc, mtp = _pool(layout)
    scale_lo = G.expert_nbytes - sum(int(np.prod(s)) for k, s in G.expert_parts().items() if k.endswith(".scale"))
    with open(layout / "pool-mxfp4.bin", "r+b") as f:
        for i in mtp:
            off = doc["records"][i][0]
            f.seek(off)
            rec = bytearray(f.read(G.expert_nbytes))
            rec[scale_lo:] = b"\xff" * (G.expert_nbytes - scale_lo)
            f.seek(off)
            f.write(rec)
            doc["records"][i][1] = zlib.crc32(rec)
    (layout / "pool-mxfp4.json").write_text(json.dumps(doc))
    _refused(ds4f("run", layout, "--spec", "3", "-n", "16", "--no-probe", "--dump", "off"),
             "the MTP layer's expert", "of " + str(layout / "pool-mxfp4.bin"), "non-finite", absent=("layer 0",))


def test_a_crc_mismatch_of_an_mtp_record_in_run_and_verify(mtp_official, tmp_path):
    layout = convert_checkpoint(mtp_official, tmp_path / "ds4f", progress=False)
    doc, mtp = _pool(layout)
    with open(layout / "pool-mxfp4.bin", "r+b") as f:
        for i in mtp:                                        # one byte of every MTP record flipped
            off = doc["records"][i][0] + 100
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
    bad_layer = f"layer {G.n_layers}"                        # a layer the model does not have
    _refused(ds4f("run", layout, "--spec", "3", "-n", "16", "--no-probe", "--dump", "off"),
             "the MTP layer, expert", layout / "pool-mxfp4.bin", "corrupt", absent=(bad_layer, "layer 0"))
    out = ds4f("verify", layout)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    problems = [ln for ln in out.stderr.splitlines() if ln.startswith("problem:")]
    assert problems and "the MTP layer, expert" in problems[0] and bad_layer not in problems[0], problems
