"""The text layer's tokenizer and streaming decoder, on the synthetic tokenizer that `ds4f synth` ships."""
import json
import subprocess
import sys

import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.text import GenerationDefaults, TextStream, Tokenizer, find_tokenizer
from ds4f.engine.text.synthetic import tokenizer_json, write_tokenizer_files

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
TEXTS = [
    "Hello, world! The keeper climbed 112 steps.",
    "crème brûlée, São Paulo, Zürich, coração",
    "日本語の文章：今日は天気がいい。中文句子：山上的风很大。",
    "a wave 🌊, a family 👨‍👩‍👧, a heart ❤️ and −5 °C",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "text never seen: Quixotic zebras jump; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ᚠᚢᚦ runes",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, GEOMETRIES["tiny"])
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.load(tok_dir)


def test_special_tokens_at_the_release_ids(tok):
    assert [tok.special_id(s) for s in SPECIALS] == [0, 1, 2, 3, 4, 5]
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert all(tok.is_special(i) for i in range(6)) and not tok.is_special(6)
    assert tok.vocab_size == GEOMETRIES["tiny"].vocab
    with pytest.raises(Ds4fError, match="no token"):
        tok.special_id("<｜nope｜>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # the HF library's own decoder agrees with the bytes-per-token view
    assert tok._hf.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_byte_level_bytes_of_known_tokens(tok):
    # the 256 single-byte tokens follow the specials: one of them stands for each byte
    singles = {tok.token_bytes(i) for i in range(6, 6 + 256)}
    assert singles == {bytes([b]) for b in range(256)}
    assert tok.encode("A") == [tok._hf.token_to_id("A")] and tok.token_bytes(tok.encode("A")[0]) == b"A"
    # an emoji's four bytes, split over several tokens in a tiny vocabulary
    ids = tok.encode("🌊")
    assert len(ids) > 1 and b"".join(map(tok.token_bytes, ids)) == "🌊".encode()


def test_special_tokens_in_text(tok):
    text = "<｜User｜>hi<｜Assistant｜></think>ok<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert ids == [2] + tok.encode("hi") + [3, 5] + tok.encode("ok") + [1]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "hiok"
    assert tok.encode("") == []


def test_training_is_deterministic():
    a = tokenizer_json(512)
    assert tokenizer_json(512) == a
    # a fresh interpreter (other hash seeds, another thread pool) writes the same bytes
    code = "import sys; from ds4f.engine.text.synthetic import tokenizer_json; sys.stdout.write(tokenizer_json(512))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.decode("utf-8")
    assert out == a


def test_padded_vocabulary_decodes_and_is_never_produced(tmp_path):
    write_tokenizer_files(tmp_path, GEOMETRIES["demo"])
    tok = Tokenizer.load(tmp_path)
    assert tok.vocab_size == GEOMETRIES["demo"].vocab
    corpus = (__import__("ds4f.engine.text.synthetic", fromlist=["x"]).corpus_text())
    ids = tok.encode(corpus)
    assert max(ids) < 512 and tok.decode(ids) == corpus   # encoding uses only the trained tokens
    tail = [tok.decode([i]) for i in range(512, tok.vocab_size)]
    assert all(t and "\ufffd" not in t for t in tail)     # every padded id is text
    assert len(set(tail)) == len(tail)
    assert all(t in corpus or t.count(" ") <= 2 for t in tail)


def test_files_like_the_release(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"]["content"] == SPECIALS[0] and cfg["eos_token"]["content"] == SPECIALS[1]
    assert cfg["model_max_length"] == GEOMETRIES["tiny"].attention.max_position_embeddings
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["do_sample"], gen["temperature"], gen["top_p"]) == \
        (0, 1, True, 1.0, 1.0)
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["decoder"]["type"] == "ByteLevel"
    assert [t["content"] for t in spec["added_tokens"]] == SPECIALS


def test_generation_defaults(tok_dir, tmp_path):
    d = GenerationDefaults.load(tok_dir)
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.do_sample, d.bos_token_id, d.eos_token_id) == \
        (1.0, 1.0, 0, 0.0, True, 0, 1)
    assert d.path is not None
    none = GenerationDefaults.load(tmp_path)          # no file: DeepSeek's recommendation
    assert (none.temperature, none.top_p, none.path) == (1.0, 1.0, None)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "eos_token_id": [1, 7], "do_sample": False}))
    g = GenerationDefaults.load(tmp_path)
    assert (g.temperature, g.top_p, g.top_k, g.eos_token_id, g.eos_token_ids) == (0.6, 0.95, 40, 1, (1, 7))
    assert g.sampling(seed=5).greedy and g.sampling(seed=5).seed == 5
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(Ds4fError, match="generation_config.json: temperature"):
        GenerationDefaults.load(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(Ds4fError, match="generation_config.json"):
        GenerationDefaults.load(tmp_path)


def test_missing_and_corrupt_tokenizer(tok_dir, tmp_path):
    assert find_tokenizer(tmp_path) is None
    with pytest.raises(Ds4fError, match="tokenizer.json: missing") as e:
        Tokenizer.load(tmp_path)
    assert e.value.path == str(tmp_path / "tokenizer.json")
    good = (tok_dir / "tokenizer.json").read_bytes()
    for bad in (good[: len(good) // 2], b"\xff\xfe garbage", b'{"version": "1.0"}'):
        (tmp_path / "tokenizer.json").write_bytes(bad)
        with pytest.raises(Ds4fError, match="tokenizer.json: not a valid tokenizer") as e:
            find_tokenizer(tmp_path)
        assert e.value.path == str(tmp_path / "tokenizer.json")
    # a path to the file itself works like its directory
    assert Tokenizer.load(tok_dir / "tokenizer.json").vocab_size == 512


def test_unknown_ids(tok):
    assert tok.token_bytes(tok.vocab_size + 10) == b""   # past the tokenizer: a model's padding row
    with pytest.raises(Ds4fError) as e:
        tok.token_bytes(-1)
    assert e.value.param == "token"


def _is_valid_piece(s: str) -> bool:
    try:
        s.encode("utf-8")          # a lone surrogate (half a character) cannot be encoded
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("text", TEXTS + ["".join(TEXTS) + "<think>x</think>"])
def test_stream_never_emits_a_broken_sequence(tok, text):
    ids = tok.encode(text)
    for n in range(len(ids) + 1):          # every prefix of the tokens
        stream = TextStream(tok)
        pieces = [stream.push(i) for i in ids[:n]]
        assert all(_is_valid_piece(p) and "\ufffd" not in p for p in pieces)
        full = "".join(pieces)
        # only whole characters: the pushed text is the longest valid prefix of the bytes so far
        data = b"".join(tok.token_bytes(i) for i in ids[:n])
        assert full.encode("utf-8") == data[: len(full.encode("utf-8"))]
        assert len(data) - len(full.encode("utf-8")) <= 3
        assert full + stream.flush() == tok.decode(ids[:n])
    assert tok.decode(ids) == text


def test_stream_on_invalid_bytes(tok):
    # random model output: a stray continuation byte, a lead byte never completed
    lone = next(i for i in range(6, 262) if tok.token_bytes(i) == b"\x80")
    lead = next(i for i in range(6, 262) if tok.token_bytes(i) == b"\xe4")
    ids = [tok.encode("a")[0], lone, lead, tok.encode("b")[0], lead]
    stream = TextStream(tok)
    out = [stream.push(i) for i in ids]
    assert out == ["a", "\ufffd", "", "\ufffdb", ""]
    assert stream.pending == b"\xe4"
    assert "".join(out) + stream.flush() == tok.decode(ids) == "a\ufffd\ufffdb\ufffd"
    skip = TextStream(tok, skip_special=True)
    assert [skip.push(i) for i in (0, tok.encode("a")[0], 1)] == ["", "a", ""]
