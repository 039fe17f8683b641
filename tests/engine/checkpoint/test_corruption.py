"""Corrupt weights never give a "done" run: a pool record that fails its crc32, or an expert whose
scales decode to NaN, fails the run with a message naming the layer and expert, and no files."""
from __future__ import annotations

import json
import shutil

import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint.safetensors_index import load_official_index
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run


def _first_hash_expert(model) -> int:
    """An expert the first token (bos) certainly reads: layer 0 routes by its hash table."""
    with open_checkpoint(model) as ck:
        return int(ck.layer_tensors(0)["gate.tid2eid"][ck.geometry.bos_token_id][0])


def _failed_run(model, out):
    run = start_run(RunConfig(model=str(model), gen=3, probe_floor=False, dump_path=str(out / "state.bin")))
    assert run.wait(60), "run did not finish"
    assert run.state == "failed", f"a corrupt checkpoint gave a {run.state} run"
    assert list(out.glob("*")) == [], "a failed run left files behind"
    return run


def test_a_corrupt_pool_record_fails_the_run_naming_it(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    e = _first_hash_expert(broken)
    g = open_checkpoint(broken).geometry
    offset = json.loads((broken / "pool-mxfp4.json").read_text())["records"][e][0]  # layer 0: index e
    with open(broken / "pool-mxfp4.bin", "r+b") as f:
        f.seek(offset + g.expert_nbytes // 2)
        byte = f.read(1)
        f.seek(offset + g.expert_nbytes // 2)
        f.write(bytes([byte[0] ^ 0x01]))   # one flipped bit in the weights
    (tmp_path / "out").mkdir()
    run = _failed_run(broken, tmp_path / "out")
    assert "corrupt" in run.error and "crc32" in run.error and f"layer 0, expert {e}" in run.error, run.error
    assert "pool-mxfp4.bin" in run.error


@pytest.mark.parametrize("part", ["w2.scale", "w1.scale"])
def test_a_nan_scale_fails_the_run_naming_the_expert(tiny_official, tmp_path, part):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_official, broken)
    e = _first_hash_expert(broken)
    tensors, _files = load_official_index(broken)
    t = tensors[f"layers.0.ffn.experts.{e}.{part}"]
    with open(t.file, "r+b") as f:
        f.seek(t.offset)
        f.write(b"\xff")                  # E8M0 255 is NaN: a whole block of 32 weights becomes NaN
    (tmp_path / "out").mkdir()
    run = _failed_run(broken, tmp_path / "out")
    assert f"layer 0: expert {e}" in run.error and "non-finite" in run.error, run.error


@pytest.mark.parametrize("name", ["config.json", "pool-mxfp4.json", "trunk.json", "tokenizer_config.json"])
def test_json_nested_too_deeply_is_a_clear_error_naming_the_file(tiny_model, tmp_path, name):
    from ds4f.engine.text import Tokenizer
    from ds4f.errors import Ds4fError

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    (model / name).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(Ds4fError) as e:
        if name == "tokenizer_config.json":
            Tokenizer.load(model)
        else:
            open_checkpoint(model).close()
    assert str(model / name) in str(e.value) and "nested too deeply" in str(e.value)


@pytest.mark.parametrize("region", ["extra.0", "extra.3", "global"])
def test_a_corrupt_trunk_region_outside_the_moe_fails_the_run_naming_it(tiny_model, tmp_path, region):
    """The attention, compressors, indexer and hyper-connections (a layer's extra.N region) and
    the global region are checked against their crc32 when the run loads them, like every other."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    regions = {r["name"]: r for r in json.loads((broken / "trunk.json").read_text())["regions"]}
    r = regions[region]
    with open(broken / "trunk.bin", "r+b") as f:
        f.seek(r["offset"] + r["nbytes"] // 2)
        byte = f.read(1)
        f.seek(r["offset"] + r["nbytes"] // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    (tmp_path / "out").mkdir()
    run = _failed_run(broken, tmp_path / "out")
    assert f"region {region}" in run.error and "crc32" in run.error and "trunk.bin" in run.error, run.error


def test_pool_records_aliased_onto_one_another_are_refused_when_the_run_opens_them(tiny_model, tmp_path):
    """Two experts pointed at one record (the same offset and crc32, so each read checks out) would
    run one expert's weights for both: the run refuses the checkpoint as verify does, naming them."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    doc = json.loads((broken / "pool-mxfp4.json").read_text())
    doc["records"][5] = list(doc["records"][4])
    (broken / "pool-mxfp4.json").write_text(json.dumps(doc))
    with pytest.raises(Ds4fError) as e:
        open_checkpoint(broken)
    assert "records 4 and 5 overlap" in str(e.value) and "pool-mxfp4.json" in str(e.value)
    (tmp_path / "out").mkdir()
    with pytest.raises(Ds4fError, match="overlap"):
        start_run(RunConfig(model=str(broken), gen=2, probe_floor=False, dump_path=str(tmp_path / "out" / "s.bin")))
    assert list((tmp_path / "out").iterdir()) == []


def _poke(root, name: str, value: bytes, at: int = 0) -> None:
    tensors, _files = load_official_index(root)
    t = tensors[name]
    with open(t.file, "r+b") as f:
        f.seek(t.offset + at)
        f.write(value)


NAN_F32, NAN_BF16 = b"\x00\x00\xc0\x7f", b"\xc0\x7f"


@pytest.mark.parametrize("name, value", [
    ("layers.3.ffn.gate.bias", NAN_F32),              # the selection bias of a learned layer
    ("layers.1.ffn.gate.weight", NAN_BF16),
    ("layers.2.ffn_norm.weight", b"\x80\x7f"),         # +inf in bf16
    ("layers.0.hc_attn_fn", NAN_F32),                  # a hyper-connection parameter
    ("layers.1.hc_ffn_scale", NAN_F32),
    ("hc_head_base", NAN_F32),
    ("layers.0.attn.attn_sink", NAN_F32),
    ("layers.0.attn.q_norm.weight", NAN_BF16),
])
def test_a_non_finite_value_where_no_output_check_reaches_fails_the_run(tiny_official, tmp_path, name, value):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_official, broken)
    _poke(broken, name, value)
    (tmp_path / "out").mkdir()
    run = _failed_run(broken, tmp_path / "out")
    assert name in run.error and "non-finite" in run.error, run.error


@pytest.mark.parametrize("row, says", [([99, 1, 2, 3], "outside 0..15"), ([-1, 1, 2, 3], "outside 0..15"),
                                       ([5, 5, 2, 3], "same expert twice")])
def test_a_hash_table_with_bad_expert_ids_fails_the_run_as_verify_says(tiny_official, tmp_path, row, says):
    import numpy as np

    from ds4f.engine.checkpoint.verify import verify_checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(tiny_official, broken)
    _poke(broken, "layers.0.ffn.gate.tid2eid", np.array(row, np.int64).tobytes(), at=7 * 4 * 8)   # token 7
    (tmp_path / "out").mkdir()
    run = _failed_run(broken, tmp_path / "out")
    assert "layers.0.ffn.gate.tid2eid" in run.error and says in run.error, run.error
    assert any(says in p for p in verify_checkpoint(broken))


@pytest.mark.parametrize("layout", ["official", "ds4f"])
def test_verify_names_every_float_tensor_with_a_non_finite_value(tiny_official, tmp_path, layout):
    from ds4f.engine.checkpoint.convert import convert_checkpoint
    from ds4f.engine.checkpoint.verify import verify_checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(tiny_official, broken)
    names = ("layers.3.ffn.gate.bias", "layers.0.hc_attn_fn", "layers.2.attn_norm.weight", "norm.weight")
    for name in names:
        _poke(broken, name, NAN_F32 if name.endswith(("bias", "fn")) else NAN_BF16)
    root = broken if layout == "official" else convert_checkpoint(broken, tmp_path / "ds4f")
    problems = verify_checkpoint(root)
    for name in names:
        assert any(name in p and "non-finite" in p for p in problems), (name, problems)
