"""The synthetic checkpoints' tokenizer: a byte-level BPE trained with HF `tokenizers` on corpus.txt.

    write_tokenizer_files(directory, geometry)    # tokenizer.json, tokenizer_config.json, generation_config.json

Like DeepSeek's: a ByteLevel pre-tokenizer (GPT-2's split, no prefix space) and decoder, the
special tokens at ids 0..5 (BOS, EOS, <｜User｜>, <｜Assistant｜>, <think>, </think>), then the
256 bytes, then merges learned on corpus.txt (a few KB of English prose with some accented
letters, other scripts and emoji) up to TRAINED_VOCAB tokens. Training takes milliseconds and is
deterministic: the same JSON on every run (for one `tokenizers` version).

The tokenizer's vocabulary is made exactly the model's (geometry.vocab), so every id a model
emits is text: past the trained tokens it is padded with pieces of the corpus (its words as the
pre-tokenizer splits them, runs of 2 to 8 consecutive words, then pairs of words), each a vocabulary entry
that encoding never produces (no merge makes it) but decoding reads. A model's weights are
random, so what it writes is noise made of these pieces.
"""
from __future__ import annotations

import itertools
import json
import os
from importlib import resources
from pathlib import Path

from ds4f.errors import Ds4fError
from ds4f.engine.text.tokenizer import (BOS, EOS, GENERATION_CONFIG_NAME, SPECIAL_TOKENS, TOKENIZER_CONFIG_NAME,
                                        TOKENIZER_NAME)

TRAINED_VOCAB = 512          # special tokens + 256 bytes + merges
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
DEFAULT_MAX_LENGTH = 1048576
MAX_RUN = 8                   # the longest run of corpus words a padding entry holds


def corpus_text() -> str:
    return resources.files("ds4f.engine.text").joinpath("corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int = TRAINED_VOCAB):
    """A byte-level BPE of `vocab_size` tokens (at most what the corpus supports) trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok


def _padding(known: set[str], count: int) -> list[str]:
    """`count` new vocabulary entries (byte-level strings): the corpus's words, runs of 2..MAX_RUN
    consecutive words, then pairs of its words."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pieces = [p for line in corpus_text().splitlines(keepends=True) for p, _ in split.pre_tokenize_str(line)]
    words = list(dict.fromkeys(pieces))
    runs = ("".join(pieces[i:i + n]) for n in range(1, MAX_RUN + 1) for i in range(len(pieces) - n + 1))
    pairs = (a + b for a in words for b in words)
    out: list[str] = []
    seen = set(known)
    for s in itertools.chain(runs, pairs):
        if s not in seen:
            seen.add(s)
            out.append(s)
            if len(out) == count:
                return out
    raise Ds4fError(f"the synthetic tokenizer cannot fill a vocabulary of {len(known) + count} tokens")


def tokenizer_json(vocab_size: int) -> str:
    """The tokenizer.json of a model with `vocab_size` ids (see the module docstring)."""
    from tokenizers import Tokenizer

    if vocab_size < MIN_VOCAB:
        raise Ds4fError(f"a byte-level tokenizer needs a vocabulary of at least {MIN_VOCAB} tokens, "
                        f"the model has {vocab_size}")
    spec = json.loads(train_tokenizer(min(vocab_size, TRAINED_VOCAB)).to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    extra = vocab_size - len(vocab) - sum(1 for t in spec["added_tokens"] if t["content"] not in vocab)
    if extra > 0:
        start = max(vocab.values()) + 1
        for i, s in enumerate(_padding(set(vocab), extra)):
            vocab[s] = start + i
    tok = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str(pretty=True)


def _added(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}


def tokenizer_config(max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    """tokenizer_config.json in the release's style."""
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": _added(BOS),
            "clean_up_tokenization_spaces": False, "eos_token": _added(EOS), "legacy": True,
            "model_max_length": max_length, "pad_token": _added(EOS), "sp_model_kwargs": {}, "unk_token": None,
            "tokenizer_class": "LlamaTokenizerFast",
            "ds4f_synthetic": {"note": "a byte-level BPE trained by ds4f synth on a short text; not DeepSeek's"}}


def generation_config() -> dict:
    """generation_config.json as the release's: DeepSeek's recommended sampling."""
    return {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
            "temperature": 1.0, "top_p": 1.0}


def write_tokenizer_files(directory: Path | str, geometry) -> list[str]:
    """Write the three files for a model of `geometry` into `directory` (each via a temporary file
    renamed into place); returns their names."""
    d = Path(directory)
    att = getattr(geometry, "attention", None)
    max_len = getattr(att, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
    files = {TOKENIZER_NAME: tokenizer_json(geometry.vocab) + "\n",
             TOKENIZER_CONFIG_NAME: json.dumps(tokenizer_config(max_len), indent=2, ensure_ascii=False) + "\n",
             GENERATION_CONFIG_NAME: json.dumps(generation_config(), indent=2) + "\n"}
    for name, text in files.items():
        tmp = d / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, d / name)
    return list(files)
