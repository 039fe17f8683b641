"""Checkpoints carry their tokenizer: synth writes it, convert copies it, verify loads it."""
import json
from pathlib import Path

import pytest

from ds4f.engine.checkpoint.verify import verify_checkpoint
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.text import Tokenizer, find_tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def test_synth_and_convert_carry_the_tokenizer(tiny_official, tiny_model):
    for name in FILES:
        assert (Path(tiny_model) / name).read_bytes() == (Path(tiny_official) / name).read_bytes()
    for root in (tiny_official, tiny_model):
        tok = Tokenizer.load(root)
        assert tok.vocab_size == GEOMETRIES["tiny"].vocab and (tok.bos_id, tok.eos_id) == (0, 1)
        text = "The keeper wrote: “Calm night.” 🌊"
        assert tok.decode(tok.encode(text)) == text
    cfg = json.loads((Path(tiny_model) / "generation_config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)


def _linked_copy(src: Path, dst: Path, skip=()) -> Path:
    """The checkpoint's files as symlinks (cheap), without the files in `skip`."""
    dst.mkdir()
    for p in Path(src).iterdir():
        if p.name not in skip:
            (dst / p.name).symlink_to(p.resolve())
    return dst


@pytest.mark.parametrize("which", ["tiny_official", "tiny_model"])
def test_verify_loads_the_tokenizer(which, request, tmp_path):
    root = request.getfixturevalue(which)
    info: dict = {}
    assert verify_checkpoint(root, progress=False, info=info) == []
    assert info["tokenizer"] == f"tokenizer: {GEOMETRIES['tiny'].vocab} tokens"

    bare = _linked_copy(root, tmp_path / "bare", skip=FILES)
    info = {}
    assert verify_checkpoint(bare, progress=False, info=info) == []          # no tokenizer is fine
    assert info["tokenizer"] == "no tokenizer" and find_tokenizer(bare) is None

    bad = _linked_copy(root, tmp_path / "bad", skip=("tokenizer.json",))
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [')
    problems = verify_checkpoint(bad, progress=False)
    assert len(problems) == 1 and problems[0].startswith(f"{bad / 'tokenizer.json'}: not a valid tokenizer")
    with pytest.raises(Ds4fError, match="tokenizer.json: not a valid tokenizer"):
        find_tokenizer(bad)

    gen = _linked_copy(root, tmp_path / "gen", skip=("generation_config.json",))
    (gen / "generation_config.json").write_text('{"top_p": 0}')
    problems = verify_checkpoint(gen, progress=False)
    assert problems == [f"{gen / 'generation_config.json'}: top_p 0 is out of range"]


def test_verify_checks_the_tokenizer_fits_the_model(tiny_model, tmp_path):
    from ds4f.engine.text.synthetic import write_tokenizer_files

    big = _linked_copy(tiny_model, tmp_path / "big", skip=FILES)
    write_tokenizer_files(big, GEOMETRIES["demo"])          # 8192 tokens for a 512-token model
    problems = verify_checkpoint(big, progress=False)
    assert problems == [f"{big / 'tokenizer.json'}: 8192 tokens, more than the model's vocab_size 512"]


def test_the_demo_model_has_a_tokenizer(tmp_path):
    from ds4f.engine.checkpoint import demo

    path = demo.ensure_demo_model(root=tmp_path, geometry="tiny")
    tok = find_tokenizer(path)
    assert tok is not None and tok.vocab_size == GEOMETRIES["tiny"].vocab
    assert tok.decode(tok.encode("Hello")) == "Hello"
