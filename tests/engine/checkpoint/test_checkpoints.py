"""Checkpoints: synth -> convert -> open both forms; formats; verify; every bad input."""
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ds4f.engine.checkpoint import ALIGN, aligned_buffer, open_checkpoint, read_trunk_offsets
from ds4f.engine.checkpoint.convert import convert_checkpoint
from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint.formats import (E2M1_VALUES, dequantize_fp8, dequantize_mxfp4, e8m0_to_f32, pack_e2m1,
                                 quantize_fp8, unpack_e2m1)
from ds4f.engine.model.geometry import GEOMETRIES, Geometry
from ds4f.engine.checkpoint.synth import synth_checkpoint
from ds4f.engine.checkpoint.verify import verify_checkpoint

TINY = GEOMETRIES["tiny"]


# ---- helpers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """tiny in several shards of at most 1 MiB (the bad-input tests damage copies of it)."""
    return synth_checkpoint(tmp_path_factory.mktemp("sharded") / "ck", "tiny", seed=0, shard_bytes=1 << 20)


def copy_ck(src: Path, tmp_path: Path, name="ck") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def shard_of(root: Path, tensor: str) -> Path:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    return root / index["weight_map"][tensor]


def rewrite_header(path: Path, edit) -> None:
    """Rewrite a safetensors shard with an edited header (data bytes unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True)


def expert_bytes(ck, layer, expert):
    buf = aligned_buffer(ck.slot_nbytes)
    n = ck.read_expert(layer, expert, buf)
    return buf[: ck.geometry.expert_nbytes].copy(), n


# ---- geometry -------------------------------------------------------------------------------
def test_flash_geometry_sizes():
    g = GEOMETRIES["flash"]
    assert g.expert_nbytes == 13_369_344
    assert g.n_layers * g.n_experts == 11_008
    assert abs(g.pool_nbytes - 147.2e9) < 0.1e9


def test_config_round_trip_and_official_names():
    for g in GEOMETRIES.values():
        cfg = g.to_config()
        assert cfg["model_type"] == "deepseek_v4" and cfg["scoring_func"] == "sqrtsoftplus"
        assert cfg["topk_method"] == "noaux_tc" and cfg["norm_topk_prob"] is True
        assert Geometry.from_config(json.loads(json.dumps(cfg)), "config.json") == g


@pytest.mark.parametrize("key,value,field", [
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("hidden_size", 100, "hidden_size"),
    ("num_hash_layers", 9, "num_hash_layers"),
    ("vocab_size", 0, "vocab_size"),
    ("n_routed_experts", "many", "n_routed_experts"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"),
])
def test_impossible_geometry_is_refused_naming_the_field(key, value, field):
    cfg = TINY.to_config()
    cfg[key] = value
    with pytest.raises(Ds4fError, match=rf"^my/config.json: {field}"):
        Geometry.from_config(cfg, "my/config.json")


def test_missing_config_key():
    cfg = TINY.to_config()
    del cfg["hidden_size"]
    with pytest.raises(Ds4fError, match="config.json: missing hidden_size"):
        Geometry.from_config(cfg, "config.json")


# ---- formats ----------------------------------------------------------------------------------
def test_e2m1_pack_unpack_and_decode_match_ml_dtypes():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(8, 64), dtype=np.uint8)
    packed = pack_e2m1(codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)  # element 2i in the low nibble
    assert np.array_equal(unpack_e2m1(packed), codes)
    scales = rng.integers(100, 140, size=(8, 2), dtype=np.uint8)
    scales[0, 0] = 0  # 2^-127, subnormal
    ours = dequantize_mxfp4(packed, scales)
    ref_vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ref_scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ref = ref_vals * np.repeat(ref_scale, 32, axis=1)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))  # bit-identical, -0.0 kept
    assert np.array_equal(E2M1_VALUES, np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.isnan(e8m0_to_f32(np.array([255], np.uint8)))[0]


def test_fp8_dequantization_equals_ml_dtypes_times_scale():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((300, 200)) * 0.02).astype(np.float32)
    q, s = quantize_fp8(w)
    assert s.shape == (3, 2)
    got = dequantize_fp8(q, s)
    scale = np.repeat(np.repeat(s.astype(np.float32), 128, 0), 128, 1)[:300, :200]
    ref = q.astype(np.float32) * scale
    assert got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.astype(np.float32), ref)


def test_fp8_dequantization_fails_loudly_when_bf16_cannot_hold_it():
    q = np.full((128, 128), 0.021484375, dtype=ml_dtypes.float8_e4m3fn)  # 11 x 2^-9
    s = np.array([[1]], dtype=np.uint8)  # x 2^-126 -> 11 x 2^-135, below bf16's smallest subnormal
    with pytest.raises(Ds4fError, match=r"w\.weight: FP8 value at \[0, 0\].*not exactly representable in bf16"):
        dequantize_fp8(q, s, name="w.weight")
    with pytest.raises(Ds4fError, match="NaN scale"):
        dequantize_fp8(q, np.array([[255]], np.uint8), name="w.weight")


# ---- synth: the official format -------------------------------------------------------------
def test_synth_writes_the_official_layout(tiny_official):
    root = Path(tiny_official)
    names = {p.name for p in root.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "prompts.json"} <= names
    assert any(n.startswith("model-00001-of-") and n.endswith(".safetensors") for n in names)
    cfg = json.loads((root / "config.json").read_text())
    assert Geometry.from_config(cfg, "config.json") == TINY
    index = json.loads((root / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert wm.keys() >= {"embed.weight", "head.weight", "norm.weight", "layers.0.ffn.gate.tid2eid",
                         "layers.1.ffn.gate.bias", "layers.3.ffn.experts.15.w2.scale",
                         "layers.2.ffn.shared_experts.w1.scale", "layers.0.attn_norm.weight"}
    assert "layers.1.ffn.gate.tid2eid" not in wm and "layers.0.ffn.gate.bias" not in wm


def test_safetensors_library_reads_our_shards_and_agrees(tiny_official):
    import safetensors
    from safetensors import safe_open

    expected_dtypes = {"experts.0.w1.weight": "I8", "experts.0.w1.scale": "F8_E8M0", "gate.weight": "BF16",
                       "gate.bias": "F32", "gate.tid2eid": "I64", "shared_experts.w2.weight": "F8_E4M3",
                       "shared_experts.w2.scale": "F8_E8M0", "ffn_norm.weight": "BF16"}
    ck = open_checkpoint(tiny_official)
    seen = set()
    for shard in sorted(Path(tiny_official).glob("*.safetensors")):
        for name, t in safetensors.deserialize(shard.read_bytes()):
            info = ck.tensors[name]
            assert info.file == shard and info.dtype == t["dtype"] and list(info.shape) == list(t["shape"])
            with open(shard, "rb") as f:
                f.seek(info.offset)
                assert f.read(info.nbytes) == bytes(t["data"]), name
            for suffix, dt in expected_dtypes.items():
                if name.endswith(suffix):
                    assert t["dtype"] == dt, name
            seen.add(name)
        with safe_open(str(shard), framework="np") as f:  # numpy-typed tensors through the library's reader
            for name in f.keys():
                if ck.tensors[name].dtype in ("I8", "F32", "I64"):
                    arr = f.get_tensor(name)
                    with open(shard, "rb") as g:
                        g.seek(ck.tensors[name].offset)
                        assert g.read(ck.tensors[name].nbytes) == arr.tobytes()
    assert seen == set(ck.tensors)
    # the trunk is read in its shipped dtypes: the library's bytes, FP8 weight and scale tiles as they are
    raw = dict(safetensors.deserialize(shard_of(Path(tiny_official), "layers.2.ffn.shared_experts.w1.weight").read_bytes()))
    w = np.frombuffer(raw["layers.2.ffn.shared_experts.w1.weight"]["data"], ml_dtypes.float8_e4m3fn).reshape(128, 256)
    s = np.frombuffer(raw["layers.2.ffn.shared_experts.w1.scale"]["data"], ml_dtypes.float8_e8m0fnu).reshape(1, 2)
    lt = ck.layer_tensors(2)
    got_w, got_s = lt["shared_experts.w1.weight"], lt["shared_experts.w1.scale"]
    assert got_w.dtype == ml_dtypes.float8_e4m3fn and got_s.dtype == ml_dtypes.float8_e8m0fnu
    assert got_w.tobytes() == w.tobytes() and got_s.tobytes() == s.tobytes()
    ck.close()


def test_synth_is_deterministic_and_shard_size_only_regroups(tiny_official, tmp_path):
    again = synth_checkpoint(tmp_path / "again", "tiny", seed=0, shard_bytes=300_000, progress=False)
    other = synth_checkpoint(tmp_path / "other", "tiny", seed=1, progress=False)
    a, b, c = open_checkpoint(tiny_official), open_checkpoint(again), open_checkpoint(other)
    assert len(list(Path(again).glob("*.safetensors"))) > len(list(Path(tiny_official).glob("*.safetensors")))
    for f in Path(again).glob("*.safetensors"):
        assert f.stat().st_size <= 300_000 + 64 * 1024  # bounded (header aside)
    for L, e in [(0, 0), (2, 7), (3, 15)]:
        assert np.array_equal(expert_bytes(a, L, e)[0], expert_bytes(b, L, e)[0])
        assert not np.array_equal(expert_bytes(a, L, e)[0], expert_bytes(c, L, e)[0])
    for k, v in a.layer_tensors(1).items():
        assert np.array_equal(v.view(np.uint8), b.layer_tensors(1)[k].view(np.uint8))
    assert a.prompts == b.prompts != c.prompts
    for x in (a, b, c):
        x.close()


def test_synth_magnitudes_are_typical(tiny_official):
    g = TINY
    with open_checkpoint(tiny_official) as ck:
        buf = aligned_buffer(ck.slot_nbytes)
        ck.read_expert(2, 3, buf)
        for name, k in (("w1", g.hidden), ("w3", g.hidden), ("w2", g.inter)):
            wo, ws = ck.expert_layout[name + ".weight"]
            so, ss = ck.expert_layout[name + ".scale"]
            dec = dequantize_mxfp4(buf[wo:wo + np.prod(ws)].reshape(ws), buf[so:so + np.prod(ss)].reshape(ss))
            assert 0.6 / np.sqrt(k) < dec.std() < 1.6 / np.sqrt(k), name
            assert np.isfinite(dec).all()
        lt = ck.layer_tensors(1)
        sh = dequantize_fp8(lt["shared_experts.w1.weight"], lt["shared_experts.w1.scale"]).astype(np.float32)
        assert 0.8 / np.sqrt(g.hidden) < sh.std() < 1.25 / np.sqrt(g.hidden)
        assert abs(lt["ffn_norm.weight"].astype(np.float32).mean() - 1) < 0.05
        emb = ck.global_tensor("embed.weight").astype(np.float32)
        assert 0.8 < emb.std() < 1.2


# ---- convert, and both forms through one interface ------------------------------------------------
def test_both_forms_agree(tiny_official, tiny_model):
    a, b = open_checkpoint(tiny_official), open_checkpoint(tiny_model)
    assert (a.kind, b.kind) == ("official", "ds4f")
    assert a.geometry == b.geometry == TINY
    assert a.expert_layout == b.expert_layout and a.slot_nbytes == b.slot_nbytes
    assert a.slot_nbytes % ALIGN == 0 and a.trunk_layer_buf_nbytes % ALIGN == 0
    assert b.io_mode in ("O_DIRECT", "buffered+fadvise") and a.io_mode == "buffered+fadvise"
    g = TINY
    for L in range(g.n_layers):
        for e in range(g.n_experts):
            xa, na = expert_bytes(a, L, e)
            xb, nb = expert_bytes(b, L, e)
            assert np.array_equal(xa, xb), (L, e)
            assert na == g.expert_nbytes and nb == b.slot_nbytes
        ta = a.layer_tensors(L)
        buf = aligned_buffer(b.trunk_layer_buf_nbytes)
        tb = b.read_trunk_layer(L, buf)
        assert ta.keys() == tb.keys()
        assert ("gate.tid2eid" in ta) == (L < g.n_hash_layers) and ("gate.bias" in ta) == (L >= g.n_hash_layers)
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
            assert np.array_equal(ta[k].view(np.uint8), tb[k].view(np.uint8)), (L, k)
            assert np.shares_memory(tb[k], buf)  # views into the caller's buffer
        assert b.trunk_layer_nbytes(L) % ALIGN == 0
    for name in ("embed.weight", "head.weight", "norm.weight"):
        assert np.array_equal(a.global_tensor(name).view(np.uint8), b.global_tensor(name).view(np.uint8))
    assert a.prompts == b.prompts and a.prompts
    a.close()
    b.close()


def test_expert_extents(tiny_official, tiny_model):
    with open_checkpoint(tiny_official) as a, open_checkpoint(tiny_model) as b:
        ea, eb = a.expert_extents(2, 5), b.expert_extents(2, 5)
        assert len(ea) == 2 and sum(n for _, _, n in ea) == TINY.expert_nbytes  # weights + scales
        assert len(eb) == 1 and eb[0][1] % ALIGN == 0 and eb[0][2] == b.slot_nbytes
        assert eb[0][0].endswith("pool-mxfp4.bin")
        offsets = [eb[0][1] for eb in (b.expert_extents(L, e) for L in range(4) for e in range(16))]
        assert offsets == sorted(offsets) and len(set(offsets)) == 64


def test_ds4f_layout_files(tiny_model):
    root = Path(tiny_model)
    pool = json.loads((root / "pool-mxfp4.json").read_text())
    trunk = json.loads((root / "trunk.json").read_text())
    assert pool["format"] == "ds4f-pool-mxfp4" and pool["version"] == 2
    assert pool["record_nbytes"] % 4096 == 0 and len(pool["records"]) == 64
    assert list(pool["parts"]) == ["w1.weight", "w3.weight", "w2.weight", "w1.scale", "w3.scale", "w2.scale"]
    assert trunk["format"] == "ds4f-trunk"
    regions = read_trunk_offsets(root / "trunk.offsets")
    # per layer its MoE region, then its extra region (attention, hyper-connections); then global
    assert list(regions) == [f"{kind}.{L}" for L in range(4) for kind in ("layer", "extra")] + ["global"]
    assert all(off % 4096 == 0 and n % 4096 == 0 for off, n in regions.values())
    # FP8 trunk tensors stay FP8 with their E8M0 tile scales; every region carries a crc32
    assert trunk["version"] == 2
    dtypes = {t["name"]: t["dtype"] for t in trunk["tensors"]}
    assert dtypes["layers.1.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dtypes["layers.1.ffn.shared_experts.w2.scale"] == "F8_E8M0"
    data = (root / "trunk.bin").read_bytes()
    for r in trunk["regions"]:
        assert zlib.crc32(data[r["offset"]:r["offset"] + r["nbytes"]]) == r["crc32"], r["name"]
    assert not list(root.parent.glob(".*partial*"))


def test_read_expert_is_thread_safe(tiny_model):
    with open_checkpoint(tiny_model) as ck:
        want = {(L, e): expert_bytes(ck, L, e)[0] for L in range(4) for e in range(16)}
        errors = []

        def worker(seed):
            rng = np.random.default_rng(seed)
            buf = aligned_buffer(ck.slot_nbytes)
            for _ in range(100):
                L, e = int(rng.integers(4)), int(rng.integers(16))
                ck.read_expert(L, e, buf)
                if not np.array_equal(buf[: TINY.expert_nbytes], want[L, e]):
                    errors.append((L, e))

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


def test_short_read_names_file_and_expert(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    with open_checkpoint(root) as ck:
        os.truncate(root / "pool-mxfp4.bin", ck.expert_extents(3, 15)[0][1] + 100)
        with pytest.raises(Ds4fError, match=r"pool-mxfp4.bin: truncated.*\(layer 3, expert 15\)"):
            ck.read_expert(3, 15, aligned_buffer(ck.slot_nbytes))


def test_convert_with_extra_trunk_tensors(tiny_official, tmp_path):
    """Tensors the plan does not know (a later release's, say) go to the layer's extra region (or
    global), FP8 and scale tiles unchanged; synth's attention tensors are there already."""
    from safetensors import TensorSpec, serialize_file

    root = copy_ck(tiny_official, tmp_path, "src")
    w, s = quantize_fp8(np.random.default_rng(0).standard_normal((200, 256)).astype(np.float32) * 0.05)
    hc = np.arange(8, dtype=np.float32)
    keep = [np.ascontiguousarray(w), np.ascontiguousarray(s), hc]
    specs = {"layers.1.attn.future_proj.weight": TensorSpec(dtype="float8_e4m3fn", shape=[200, 256], data_ptr=keep[0].ctypes.data, data_len=keep[0].nbytes),
             "layers.1.attn.future_proj.scale": TensorSpec(dtype="float8_e8m0fnu", shape=[2, 2], data_ptr=keep[1].ctypes.data, data_len=keep[1].nbytes),
             "layers.1.hc_future_base": TensorSpec(dtype="float32", shape=[8], data_ptr=hc.ctypes.data, data_len=hc.nbytes),
             "mtp.0.norm.weight": TensorSpec(dtype="float32", shape=[8], data_ptr=hc.ctypes.data, data_len=hc.nbytes),
             "mtp.0.ffn.experts.0.w1.weight": TensorSpec(dtype="int8", shape=[32], data_ptr=keep[0].ctypes.data, data_len=32)}
    serialize_file(specs, str(root / "model-extra.safetensors"))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for k in specs:
        index["weight_map"][k] = "model-extra.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = convert_checkpoint(root, tmp_path / "dst", progress=False)
    trunk = json.loads((dst / "trunk.json").read_text())
    by = {t["name"]: t for t in trunk["tensors"]}
    assert by["layers.1.attn.future_proj.weight"]["region"] == "extra.1" and by["layers.1.attn.future_proj.weight"]["dtype"] == "F8_E4M3"
    assert by["layers.1.attn.future_proj.scale"]["region"] == "extra.1" and by["layers.1.attn.future_proj.scale"]["dtype"] == "F8_E8M0"
    assert by["mtp.0.norm.weight"]["region"] == "global"
    assert by["layers.1.attn.wq_a.weight"]["region"] == "extra.1" and by["hc_head_fn"]["region"] == "global"
    assert "mtp.0.ffn.experts.0.w1.weight" not in by and trunk["skipped"]["count"] == 1  # MTP experts
    with open_checkpoint(dst) as ck:
        assert ck.global_tensor("layers.1.attn.future_proj.weight").tobytes() == w.tobytes()
        assert ck.global_tensor("layers.1.attn.future_proj.scale").tobytes() == s.tobytes()
        assert np.array_equal(ck.global_tensor("layers.1.hc_future_base"), hc)
        regions = read_trunk_offsets(dst / "trunk.offsets")
        assert regions["layer.1"][0] + regions["layer.1"][1] == regions["extra.1"][0]  # the layer read skips it
    assert verify_checkpoint(dst) == []


# ---- verify --------------------------------------------------------------------------------------
def test_verify_ok_on_both_forms(tiny_official, tiny_model):
    for p in (tiny_official, tiny_model):
        info = {}
        assert verify_checkpoint(p, info=info) == []
        assert info["nan_scale_bytes"] == 0 and info["records_checked"] == 64


def test_verify_catches_a_flipped_byte(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    with open_checkpoint(root) as ck:
        _, off, _ = ck.expert_extents(2, 9)[0]
    with open(root / "pool-mxfp4.bin", "r+b") as f:
        f.seek(off + 1234)
        b = f.read(1)
        f.seek(off + 1234)
        f.write(bytes([b[0] ^ 0x10]))
    problems = verify_checkpoint(root)
    assert len(problems) == 1 and "(layer 2, expert 9)" in problems[0] and "crc32" in problems[0]
    out = run_cli("verify", root)
    assert out.returncode == 1 and "(layer 2, expert 9)" in out.stderr and "Traceback" not in out.stderr


def test_verify_counts_nan_scale_bytes(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    with open_checkpoint(root) as ck:
        _, off, _ = ck.expert_extents(1, 2)[0]
        so, _ = ck.expert_layout["w2.scale"]
    with open(root / "pool-mxfp4.bin", "r+b") as f:
        f.seek(off + so)
        f.write(b"\xff\xff\xff")
    problems = verify_checkpoint(root)
    assert any("3 NaN scale bytes" in p and "(layer 1, expert 2)" in p for p in problems)


def test_verify_catches_a_truncated_pool(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    size = (root / "pool-mxfp4.bin").stat().st_size
    os.truncate(root / "pool-mxfp4.bin", size - 5000)
    problems = verify_checkpoint(root)
    assert problems and "pool-mxfp4.bin: truncated" in problems[0]
    with pytest.raises(Ds4fError, match="pool-mxfp4.bin: truncated"):
        open_checkpoint(root)
    out = run_cli("verify", root)
    assert out.returncode == 1 and "truncated" in out.stderr


# ---- bad input: one clear message naming the file, nothing damaged ---------------------------------
def _expect_everywhere(root: Path, tmp_path: Path, pattern: str):
    """open, convert and verify all report it; convert leaves nothing behind; the CLI prints one line."""
    before = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir())
    with pytest.raises(Ds4fError, match=pattern):
        open_checkpoint(root)
    with pytest.raises(Ds4fError, match=pattern):
        convert_checkpoint(root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    problems = verify_checkpoint(root)
    assert problems and any(__import__("re").search(pattern, p) for p in problems), problems
    out = run_cli("convert", root, tmp_path / "out")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("ds4f convert: error: ")
    after = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir())
    assert before == after


def test_bad_missing_shard(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "layers.2.ffn.experts.3.w1.weight")
    shard.unlink()
    _expect_everywhere(root, tmp_path, rf"{shard.name}: missing shard")


def test_bad_truncated_shard(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "layers.2.ffn.experts.3.w1.weight")
    os.truncate(shard, shard.stat().st_size - 100)
    _expect_everywhere(root, tmp_path, rf"{shard.name}: truncated")


def test_bad_index_names_a_tensor_the_shard_lacks(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    other = shard_of(root, "embed.weight").name
    index["weight_map"]["layers.1.ffn.experts.4.w3.scale"] = other
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_everywhere(root, tmp_path, rf"{other}: lacks tensor layers\.1\.ffn\.experts\.4\.w3\.scale")


def test_bad_index_lacks_a_needed_tensor(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.3.ffn.gate.bias"]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_everywhere(root, tmp_path, r"model.safetensors.index.json: no tensor layers\.3\.ffn\.gate\.bias")


def test_bad_dtype(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "layers.1.ffn_norm.weight")
    rewrite_header(shard, lambda h: h["layers.1.ffn_norm.weight"].update(dtype="F16"))
    _expect_everywhere(root, tmp_path, rf"{shard.name}: layers\.1\.ffn_norm\.weight: dtype F16, expected BF16")


def test_bad_shape(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "layers.2.ffn.gate.weight")
    rewrite_header(shard, lambda h: h["layers.2.ffn.gate.weight"].update(shape=[32, 128]))
    _expect_everywhere(root, tmp_path, rf"{shard.name}: layers\.2\.ffn\.gate\.weight: shape \[32, 128\], expected \[16, 256\]")


def test_bad_header_json(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "norm.weight")
    raw = bytearray(shard.read_bytes())
    raw[8] = ord("[")
    raw[9] = ord("!")
    shard.write_bytes(bytes(raw))
    _expect_everywhere(root, tmp_path, rf"{shard.name}: bad safetensors header")


@pytest.mark.parametrize("fname", ["config.json", "model.safetensors.index.json"])
def test_bad_json(sharded, tmp_path, fname):
    root = copy_ck(sharded, tmp_path)
    (root / fname).write_text('{"hidden_size": 256,,}')
    _expect_everywhere(root, tmp_path, rf"{fname}: bad .*JSON")


def test_bad_geometry_in_config(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    cfg["num_experts_per_tok"] = 17
    (root / "config.json").write_text(json.dumps(cfg))
    _expect_everywhere(root, tmp_path, r"config.json: num_experts_per_tok = 17: more than n_routed_experts")


def test_bad_geometry_mismatching_the_shards(sharded, tmp_path):
    root = copy_ck(sharded, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    cfg["n_routed_experts"] = 20  # the shards hold 16
    (root / "config.json").write_text(json.dumps(cfg))
    _expect_everywhere(root, tmp_path, r"no tensor layers\.0\.ffn\.experts\.16\.w1\.weight|shape .* expected")


@pytest.mark.parametrize("fname,edit,pattern", [
    ("pool-mxfp4.json", lambda d: d.update(version=99), r"pool-mxfp4.json: layout version 99, this ds4f reads version 2 \(a newer ds4f"),
    ("pool-mxfp4.json", lambda d: d["records"].pop(), r"pool-mxfp4.json: 63 records, expected 64"),
    ("pool-mxfp4.json", lambda d: d["records"][5].__setitem__(0, 100), r"record 5 .* not 4096-aligned"),
    ("trunk.json", lambda d: d.update(format="nope"), r"trunk.json: not a ds4f-trunk file"),
    ("trunk.json", lambda d: d["tensors"].pop(3), r"trunk.json: no tensor layers\.0\.ffn\.gate\.tid2eid"),
])
def test_bad_ds4f_layout_json(tiny_model, tmp_path, fname, edit, pattern):
    root = copy_ck(tiny_model, tmp_path)
    doc = json.loads((root / fname).read_text())
    edit(doc)
    (root / fname).write_text(json.dumps(doc))
    with pytest.raises(Ds4fError, match=pattern):
        open_checkpoint(root)
    problems = verify_checkpoint(root)
    assert any(__import__("re").search(pattern, p) for p in problems), problems


def test_bad_ds4f_json_syntax_and_truncated_trunk(tiny_model, tmp_path):
    root = copy_ck(tiny_model, tmp_path)
    (root / "trunk.json").write_text("{")
    with pytest.raises(Ds4fError, match=r"trunk.json: bad trunk JSON"):
        open_checkpoint(root)
    root2 = copy_ck(tiny_model, tmp_path, "ck2")
    os.truncate(root2 / "trunk.bin", 1000)
    with pytest.raises(Ds4fError, match=r"trunk.bin: truncated"):
        open_checkpoint(root2)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(Ds4fError, match="no such checkpoint"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Ds4fError, match="not a checkpoint"):
        open_checkpoint(tmp_path / "empty")
    out = run_cli("verify", tmp_path / "empty")
    assert out.returncode == 1 and "not a checkpoint" in out.stderr


def test_convert_refuses_to_overwrite_and_keeps_fp8_bytes(tiny_official, tiny_model, tmp_path):
    with pytest.raises(Ds4fError, match="already exists"):
        convert_checkpoint(tiny_official, tiny_model)
    with pytest.raises(Ds4fError, match="already in the ds4f layout"):
        convert_checkpoint(tiny_model, tmp_path / "x")
    # FP8 is no longer widened: a scale whose values would not fit bf16 converts unchanged
    root = copy_ck(tiny_official, tmp_path)
    name = "layers.1.ffn.shared_experts.w3.scale"
    shard = shard_of(root, name)
    with open_checkpoint(root) as ck:
        off = ck.tensors[name].offset
    with open(shard, "r+b") as f:
        f.seek(off)
        f.write(bytes([1]))  # 2^-126
    convert_checkpoint(root, tmp_path / "out", progress=False)
    with open_checkpoint(tmp_path / "out") as ck:
        assert ck.layer_tensors(1)["shared_experts.w3.scale"].view(np.uint8)[0, 0] == 1


# ---- CLI ------------------------------------------------------------------------------------------
def test_cli_synth_convert_verify(tmp_path):
    out = run_cli("synth", tmp_path / "s", "--geometry", "tiny", "--n-experts", "8", "--top-k", "2",
                  "--seed", "3", "--shard-mib", "0.5")
    assert out.returncode == 0, out.stderr
    with open_checkpoint(tmp_path / "s") as ck:
        assert ck.geometry == TINY.replace(n_experts=8, top_k=2)
    out = run_cli("convert", tmp_path / "s", tmp_path / "d")
    assert out.returncode == 0, out.stderr
    out = run_cli("verify", tmp_path / "d")
    assert out.returncode == 0 and "OK" in out.stdout


def test_cli_impossible_geometry_is_one_line(tmp_path):
    out = run_cli("synth", tmp_path / "s", "--geometry", "tiny", "--top-k", "40")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("ds4f synth: error: --geometry tiny with overrides: num_experts_per_tok = 40:"
                                  " more than n_routed_experts (16)")
    assert not (tmp_path / "s").exists()
    out = run_cli("synth", tmp_path / "s", "--geometry", "tiny", "--hidden", "100")
    assert out.returncode == 2 and "hidden_size = 100" in out.stderr


def test_progress_callback(tmp_path):
    calls = []
    p = synth_checkpoint(tmp_path / "s", "tiny", progress=lambda d, t, label: calls.append((d, t, label)))
    assert calls and calls[-1][0] == calls[-1][1]
    calls.clear()
    convert_checkpoint(p, tmp_path / "d", progress=lambda d, t, label: calls.append((d, t, label)))
    assert calls and calls[-1][0] == calls[-1][1]
    calls.clear()
    assert verify_checkpoint(tmp_path / "d", progress=lambda d, t, label: calls.append((d, t, label))) == []
    assert calls and calls[-1][0] == calls[-1][1]


# ---- --force replaces only what the command makes ------------------------------------------------
def test_convert_force_replaces_only_a_ds4f_layout(tiny_official, tmp_path):
    src = copy_ck(tiny_official, tmp_path, "src")
    out = convert_checkpoint(src, tmp_path / "out", progress=False)
    before = (out / "pool-mxfp4.json").read_bytes()
    (out / "stale").write_text("from the last conversion")
    assert convert_checkpoint(src, out, progress=False, force=True) == out   # a layout: replaced
    assert (out / "pool-mxfp4.json").read_bytes() == before and not (out / "stale").exists()

    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine too")
    for dst, why in ((src, "must differ from the source"), (tmp_path, "holds the source"),
                     (src / ".." / "src", "must differ from the source"),
                     (files, "replaces only a ds4f layout directory"),
                     (a_file, "replaces only a ds4f layout directory"),
                     (copy_ck(tiny_official, tmp_path, "other-official"), "replaces only a ds4f layout directory")):
        with pytest.raises(Ds4fError, match=why):
            convert_checkpoint(src, dst, progress=False, force=True)
    assert (files / "notes.txt").read_text() == "mine" and a_file.read_text() == "mine too"
    assert (src / "model.safetensors.index.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_checkpoint(src, empty, progress=False, force=True) == empty   # nothing there to lose

    out = run_cli("convert", src, files, "--force")
    assert out.returncode == 2 and "left as it is" in out.stderr and "Traceback" not in out.stderr
    assert (files / "notes.txt").read_text() == "mine"


def test_synth_force_replaces_only_a_checkpoint(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    out = run_cli("synth", mine, "--force")
    assert out.returncode == 2 and "replaces only a checkpoint directory" in out.stderr
    assert (mine / "thesis.tex").read_text() == "years of work"
    ck = tmp_path / "ck"
    assert run_cli("synth", ck).returncode == 0
    again = run_cli("synth", ck, "--force", "--seed", "1")
    assert again.returncode == 0, again.stderr


def test_cli_sizes_on_disk_agree_with_the_bars(tmp_path):
    """The bars count bytes in powers of 1000 (rich's DownloadColumn): the summaries give sizes on
    disk in the same units; an expert's record is memory, in MiB."""
    import re

    out = run_cli("synth", tmp_path / "s")
    assert out.returncode == 0, out.stderr
    assert re.search(r"[\d.]+/[\d.]+ MB", out.stderr), out.stderr            # the bar
    m = re.search(r": ([\d.]+) (kB|MB|GB) in [\d.]+ s; 4 layers x 16 experts of ([\d.]+) MiB", out.stdout)
    assert m, out.stdout
    size = sum(f.stat().st_size for f in (tmp_path / "s").iterdir())
    assert float(m.group(1)) == pytest.approx(size / {"kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(2)], abs=0.01)
    assert float(m.group(3)) == pytest.approx(TINY.expert_nbytes / 2**20, abs=0.01)
    conv = run_cli("convert", tmp_path / "s", tmp_path / "d")
    assert conv.returncode == 0 and re.search(r"\(ds4f layout\): [\d.]+ MB from [\d.]+ MB of official shards in",
                                              conv.stdout), conv.stdout
    ver = run_cli("verify", tmp_path / "d")
    assert ver.returncode == 0 and re.search(r"records, [\d.]+ MB checked", ver.stdout), ver.stdout
    for text in (out.stdout, conv.stdout, ver.stdout):
        assert "GiB" not in text and "KiB" not in text


def _tmpfs(where: Path, nbytes: int) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("command", ["synth", "convert"])
@pytest.mark.parametrize("room", ["too little to start", "full part way"])
def test_a_full_disk_is_named_and_leaves_nothing(tiny_official, tmp_path, command, room):
    """synth and convert check the room they need before writing (a geometry of terabytes never
    starts), and a disk that fills part way (the tensors fit, the rest does not) is an error naming
    the path and the reason, with nothing left behind."""
    from ds4f.engine.checkpoint.synth import official_tensors

    tensors = sum(t.nbytes for t in official_tensors(GEOMETRIES["tiny"]))
    need = tensors if command == "synth" else sum(p.stat().st_size for p in tiny_official.iterdir())
    small = tmp_path / "small"
    page = 4096
    if not _tmpfs(small, page if room == "too little to start" else -(-need // page) * page + page):
        pytest.skip("cannot mount a tmpfs here (needs root and mount)")
    try:
        args = ("synth", small / "out", "--geometry", "tiny") if command == "synth" else \
            ("convert", tiny_official, small / "out")
        out = run_cli(*args)
        assert out.returncode != 0 and "Traceback" not in out.stderr and "internal error" not in out.stderr
        assert str(small / "out") in out.stderr, out.stderr
        said = "free" if room == "too little to start" else "No space left"
        assert said in out.stderr, out.stderr
        assert list(small.iterdir()) == [], "nothing left behind"
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_tensors_that_share_bytes_are_refused(sharded, tmp_path):
    """Two tensors of a shard whose data offsets overlap (one tensor's bytes read as another's):
    refused as the safetensors library refuses them, naming both."""
    root = copy_ck(sharded, tmp_path)
    shard = shard_of(root, "layers.1.ffn_norm.weight")
    header = json.loads(shard.read_bytes()[8:8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]])
    names = sorted((n for n, m in header.items() if n != "__metadata__" and m["dtype"] == "BF16"),
                   key=lambda n: header[n]["data_offsets"][0])
    a, b = names[0], next(n for n in names[1:] if header[n]["shape"] == header[names[0]]["shape"])
    rewrite_header(shard, lambda h: h[b].update(data_offsets=list(h[a]["data_offsets"])))
    _expect_everywhere(root, tmp_path, rf"{shard.name}: tensors .* overlap")


def test_layers_past_the_configs_count_are_refused_not_dropped(sharded, tmp_path):
    """A config.json whose num_hidden_layers is below the shards' layers (another checkpoint's
    config): refused naming both, never run on the first layers alone (the MTP layer is mtp.0.*)."""
    root = copy_ck(sharded, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    for key in ("compress_ratios", "layer_types", "mlp_layer_types"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:cfg["num_hidden_layers"]]
    (root / "config.json").write_text(json.dumps(cfg))
    _expect_everywhere(root, tmp_path, rf"num_hidden_layers = {cfg['num_hidden_layers']}, but the shards hold"
                                       rf" layers\.{cfg['num_hidden_layers']}\.\* tensors")


@pytest.mark.parametrize("key, value", [("hc_sinkhorn_iters", 10**7), ("sliding_window", 10**9),
                                        ("routed_scaling_factor", 1e300), ("hidden_size", 1 << 20),
                                        ("rms_norm_eps", 5.0), ("n_routed_experts", 10**6)])
def test_config_values_far_past_any_model_are_refused_naming_the_key(sharded, tmp_path, key, value):
    root = copy_ck(sharded, tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    assert key in cfg, sorted(cfg)
    cfg[key] = value
    (root / "config.json").write_text(json.dumps(cfg))
    _expect_everywhere(root, tmp_path, rf"config.json: {key} = .*far past any DeepSeek-V4")
