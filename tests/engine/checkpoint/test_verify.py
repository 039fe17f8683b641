"""`ds4f verify` catches what `ds4f run` would trip on, in corrupted copies of the tiny checkpoints,
and names the file, the tensor and the problem: trunk.json entries whose dtype or shape disagree
with their bytes or the geometry, overlapping tensors, a token routed to one expert twice by a
hash layer's tid2eid, and NaN FP8 scales."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.formats import E8M0_NAN
from ds4f.engine.checkpoint.verify import verify_checkpoint
from ds4f.errors import Ds4fError


def copy_ck(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ck"))


def edit_trunk(root: Path, edit) -> None:
    doc = json.loads((root / "trunk.json").read_text())
    edit({t["name"]: t for t in doc["tensors"]})
    (root / "trunk.json").write_text(json.dumps(doc))


def cli_verify(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4f.cli", "verify", str(root)], capture_output=True, text=True,
                          timeout=120)


def expect(root: Path, *patterns: str, opens: bool = False) -> list[str]:
    """verify lists a problem matching every pattern (also the CLI, exit 1); open refuses it too if `opens`."""
    problems = verify_checkpoint(root)
    hit = [p for p in problems if all(re.search(pat, p) for pat in patterns)]
    assert hit, problems
    out = cli_verify(root)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert any(all(re.search(pat, line) for pat in patterns) for line in out.stderr.splitlines()), out.stderr
    if opens:
        with pytest.raises(Ds4fError):
            open_checkpoint(root).close()
    return hit


def test_the_tiny_checkpoints_are_clean(tiny_official, tiny_model):
    assert verify_checkpoint(tiny_official) == [] and verify_checkpoint(tiny_model) == []


# ---- trunk.json lies -----------------------------------------------------------------------------
def test_a_dtype_that_disagrees_with_the_geometry(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    edit_trunk(root, lambda t: t["norm.weight"].update(dtype="F16"))   # same size, wrong numbers
    expect(root, r"trunk\.json: norm\.weight: F16 \[\d+\], expected BF16", opens=True)


def test_a_shape_that_disagrees_with_the_geometry(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    with open_checkpoint(root) as ck:
        g = ck.geometry

    def lie(t):
        t["embed.weight"]["shape"] = [g.hidden, g.vocab]                     # the same bytes, transposed
        t["layers.1.ffn.gate.weight"]["shape"] = [g.hidden, g.n_experts]
    edit_trunk(root, lie)
    expect(root, r"trunk\.json: embed\.weight: BF16 \[%d, %d\], expected BF16 \[%d, %d\]"
           % (g.hidden, g.vocab, g.vocab, g.hidden), opens=True)
    expect(root, r"trunk\.json: layers\.1\.ffn\.gate\.weight: BF16 \[%d, %d\], expected" % (g.hidden, g.n_experts))


def test_a_shape_that_disagrees_with_the_bytes(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    edit_trunk(root, lambda t: t["layers.2.ffn.shared_experts.w2.weight"].update(
        shape=[2 * s for s in t["layers.2.ffn.shared_experts.w2.weight"]["shape"]]))
    hit = expect(root, r"trunk\.json: layers\.2\.ffn\.shared_experts\.w2\.weight: nbytes \d+ disagrees with its"
                       r" dtype F8_E4M3 and shape", opens=True)
    assert len(hit) == 1


def test_overlapping_tensors(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)

    def overlap(t):
        t["layers.0.ffn_norm.weight"]["offset"] = t["layers.0.attn_norm.weight"]["offset"] + 64
        t["head.weight"]["offset"] = t["embed.weight"]["offset"] + 128
    edit_trunk(root, overlap)
    expect(root, r"trunk\.json: tensors layers\.0\.attn_norm\.weight and layers\.0\.ffn_norm\.weight overlap",
           opens=True)
    expect(root, r"trunk\.json: tensors embed\.weight and head\.weight overlap: head\.weight starts at byte \d+")


# ---- tid2eid ---------------------------------------------------------------------------------------
def _duplicate_a_row(path: Path, offset: int, top_k: int, token: int) -> list[int]:
    with open(path, "r+b") as f:
        f.seek(offset + token * top_k * 8)
        row = np.frombuffer(f.read(top_k * 8), "<i8").copy()
        row[-1] = row[0]
        f.seek(offset + token * top_k * 8)
        f.write(row.tobytes())
    return row.tolist()


def test_duplicate_expert_ids_in_a_tid2eid_row_ds4f(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    tensors = json.loads((root / "trunk.json").read_text())["tensors"]
    entry = next(t for t in tensors if t["name"] == "layers.0.ffn.gate.tid2eid")
    top_k = entry["shape"][1]
    row = _duplicate_a_row(root / "trunk.bin", entry["offset"], top_k, token=37)
    hit = expect(root, r"trunk\.bin: layers\.0\.ffn\.gate\.tid2eid: 1 token routed to the same expert twice",
                 re.escape(f"token 37: {row}"))
    assert len(hit) == 1


def test_duplicate_expert_ids_in_a_tid2eid_row_official(tiny_official, tmp_path):
    root = copy_ck(tiny_official, tmp_path)
    name = "layers.0.ffn.gate.tid2eid"
    with open_checkpoint(root) as ck:
        t = ck.tensors[name]
    for token in (3, 200):
        _duplicate_a_row(t.file, t.offset, t.shape[1], token)
    expect(root, rf"{re.escape(t.file.name)}: {re.escape(name)}: 2 tokens routed to the same expert twice",
           r"token 3: .*token 200: ")


# ---- NaN FP8 scales ----------------------------------------------------------------------------------
def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_nan_scales_in_an_fp8_weight_official(tiny_official, tmp_path):
    root = copy_ck(tiny_official, tmp_path)
    name = "layers.2.ffn.shared_experts.w1.scale"
    with open_checkpoint(root) as ck:
        t = ck.tensors[name]
        assert ck.tensors["layers.2.ffn.shared_experts.w1.weight"].dtype == "F8_E4M3"
    _poke(t.file, t.offset, bytes([E8M0_NAN, E8M0_NAN]))
    info: dict = {}
    problems = verify_checkpoint(root, info=info)
    assert info["nan_scale_bytes"] == 2
    expect(root, rf"{re.escape(str(t.file))}: {re.escape(name)}: 2 NaN scale bytes \(0xFF\) in the FP8 scale"
                 r" tiles of layers\.2\.ffn\.shared_experts\.w1\.weight")
    assert len(problems) == 1, problems


def test_nan_scales_in_an_expert_official_name_the_shard(tiny_official, tmp_path):
    root = copy_ck(tiny_official, tmp_path)
    name = "layers.3.ffn.experts.5.w2.scale"
    with open_checkpoint(root) as ck:
        t = ck.tensors[name]
    _poke(t.file, t.offset + 1, bytes([E8M0_NAN]))
    expect(root, r"1 NaN scale bytes \(0xFF\) in expert scales", rf"{re.escape(t.file.name)}: {re.escape(name)}: 1")


@pytest.mark.parametrize("name", ["layers.2.attn.indexer.wq_b.scale", "layers.3.attn.wo_a.scale"])
def test_nan_scales_in_an_attention_fp8_weight_official(tiny_official, tmp_path, name):
    """The attention's FP8 scales are checked like the shared expert's (any F8_E4M3 weight's *.scale)."""
    root = copy_ck(tiny_official, tmp_path)
    with open_checkpoint(root) as ck:
        t = ck.tensors[name]
        assert ck.tensors[name[:-len(".scale")] + ".weight"].dtype == "F8_E4M3"
    _poke(t.file, t.offset, bytes([E8M0_NAN]))
    info: dict = {}
    problems = verify_checkpoint(root, info=info)
    assert info["nan_scale_bytes"] == 1 and len(problems) == 1, problems
    expect(root, rf"{re.escape(str(t.file))}: {re.escape(name)}: 1 NaN scale bytes \(0xFF\) in the FP8 scale"
                 rf" tiles of {re.escape(name[:-len('.scale')])}\.weight")


# ---- the ds4f layout's trunk: region checksums, FP8 NaN, older layouts ----------------------------------
def _trunk_entry(root: Path, name: str) -> dict:
    return next(t for t in json.loads((root / "trunk.json").read_text())["tensors"] if t["name"] == name)


def test_nan_scale_and_code_in_the_trunk_fp8(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    scale, weight = (_trunk_entry(root, f"layers.1.ffn.shared_experts.w3.{p}") for p in ("scale", "weight"))
    _poke(root / "trunk.bin", scale["offset"], bytes([E8M0_NAN]))
    _poke(root / "trunk.bin", weight["offset"] + 5, bytes([0x7F]))
    expect(root, r"trunk\.bin: layers\.1\.ffn\.shared_experts\.w3\.scale: 1 NaN scale bytes \(0xFF\)")
    expect(root, r"trunk\.bin: layers\.1\.ffn\.shared_experts\.w3\.weight: \d+ NaN E4M3 codes")
    # the pokes also break the region's checksum, which verify names
    expect(root, r"trunk\.bin: region layer\.1 \(bytes \d+\.\.\d+\): crc32 [0-9a-f]{8}, trunk\.json says")


def test_nan_scale_and_code_in_an_attention_fp8_of_the_ds4f_trunk(tiny_model, tmp_path):
    """In the ds4f layout the attention's FP8 tensors sit in the layer's extra region: the same
    NaN checks (scale byte 0xFF, E4M3 code 0x7F) and the region's crc32 cover them."""
    root = copy_ck(tiny_model, tmp_path)
    scale, weight = (_trunk_entry(root, f"layers.2.attn.wq_b.{p}") for p in ("scale", "weight"))
    assert scale["region"] == weight["region"] == "extra.2"
    _poke(root / "trunk.bin", scale["offset"], bytes([E8M0_NAN]))
    _poke(root / "trunk.bin", weight["offset"] + 3, bytes([0xFF]))
    expect(root, r"trunk\.bin: layers\.2\.attn\.wq_b\.scale: 1 NaN scale bytes \(0xFF\)")
    expect(root, r"trunk\.bin: layers\.2\.attn\.wq_b\.weight: 1 NaN E4M3 codes")
    expect(root, r"trunk\.bin: region extra\.2 \(bytes \d+\.\.\d+\): crc32 [0-9a-f]{8}, trunk\.json says")


def test_a_flipped_trunk_byte_fails_verify_and_the_read(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    gate = _trunk_entry(root, "layers.2.ffn.gate.weight")
    with open(root / "trunk.bin", "r+b") as f:
        f.seek(gate["offset"] + 3)
        b = f.read(1)[0]
        f.seek(gate["offset"] + 3)
        f.write(bytes([b ^ 0x01]))  # a low mantissa bit: a plausible, silent change without the check
    expect(root, r"region layer\.2 .*crc32")
    with open_checkpoint(root) as ck:
        ck.layer_tensors(1)  # other regions read fine
        with pytest.raises(Ds4fError, match=r"trunk\.bin: region layer\.2 \(bytes \d+\.\.\d+\) is corrupt: crc32"):
            ck.layer_tensors(2)


def test_a_flipped_global_byte_fails_the_first_global_read(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    head = _trunk_entry(root, "head.weight")
    _poke(root / "trunk.bin", head["offset"] + 100, b"\x55\xaa")
    with open_checkpoint(root) as ck:
        with pytest.raises(Ds4fError, match=r"region global .* is corrupt"):
            ck.global_tensor("embed.weight")
    expect(root, r"region global .*crc32")


def test_an_older_layout_says_to_convert_again(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    for name in ("trunk.json", "pool-mxfp4.json"):
        doc = json.loads((root / name).read_text())
        doc["version"] = 1
        (root / name).write_text(json.dumps(doc))
    hit = expect(root, r"layout version 1, written by an older ds4f", r"ds4f convert SRC .* --force", opens=True)
    assert len(hit) == 2  # both JSON files named


def test_a_missing_or_misshapen_attention_tensor_in_the_ds4f_layout(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)

    def lie(t):
        del t["layers.2.attn.indexer.wq_b.scale"]
        t["layers.3.attn.compressor.ape"]["shape"] = list(reversed(t["layers.3.attn.compressor.ape"]["shape"]))
    doc = json.loads((root / "trunk.json").read_text())
    by = {t["name"]: t for t in doc["tensors"]}
    lie(by)
    doc["tensors"] = list(by.values())
    (root / "trunk.json").write_text(json.dumps(doc))
    expect(root, r"trunk\.json: no tensor layers\.2\.attn\.indexer\.wq_b\.scale", opens=True)
    expect(root, r"trunk\.json: layers\.3\.attn\.compressor\.ape: F32 \[\d+, \d+\], expected F32")


def test_checksum_is_zlibs_crc32():
    """The records' and regions' crc32 (ISA-L's, a dependency) gives zlib's values: whole buffers,
    memoryview slices of odd lengths and offsets, a running value carried across pieces."""
    import zlib

    from ds4f.engine.checkpoint import checksum

    assert checksum.IMPLEMENTATION == "isa-l"
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, 3 * 2**20 + 17, dtype=np.uint8).tobytes()
    mv = memoryview(data)
    for a, b in ((0, 0), (0, 1), (0, len(data)), (5, 4101), (4096, 2**20 + 3), (7, len(data) - 9)):
        assert checksum.crc32(mv[a:b]) == zlib.crc32(mv[a:b])
    running = 0
    for a in range(0, len(data), 1 << 19):
        running = checksum.crc32(mv[a:a + (1 << 19)], running)
    assert running == zlib.crc32(data)
