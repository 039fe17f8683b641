"""A checkpoint's tokenizer: its tokenizer.json through HF `tokenizers` (the Rust library).

    tok = Tokenizer.load(model_dir)          # official release or ds4f layout: the same file names
    ids = tok.encode("Hello")                # no BOS added; special token strings become their ids
    tok.decode(ids); tok.token_bytes(ids[0]); tok.special_id("<｜User｜>"); tok.bos_id, tok.eos_id
    find_tokenizer(model_dir)                # None when the checkpoint has no tokenizer.json
    GenerationDefaults.load(model_dir)       # generation_config.json, else DeepSeek's recommendation

Byte-level BPE (DeepSeek's, and the synthetic checkpoints'): each vocabulary entry is a string of
the GPT-2 byte alphabet, one character per byte, so `token_bytes` maps it back to the raw bytes a
token stands for, which may be part of a UTF-8 character (TextStream joins them). Added tokens
(BOS, EOS, the chat markers) stand for the UTF-8 of their text. Ids the tokenizer does not know
(a model's vocabulary is often padded past the tokenizer's) stand for no bytes. `decode` is the
tokens' bytes joined and decoded with errors="replace", so it always equals what a TextStream
emits for the same ids.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from ds4f.errors import Ds4fError
from ds4f.safe_read import read_regular

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER_NAME, TOKENIZER_CONFIG_NAME, GENERATION_CONFIG_NAME)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # the release's order: BOS 0, EOS 1


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character standing for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def byte_level(data: bytes) -> str:
    """Bytes written in the byte-level alphabet (how a byte-level BPE vocabulary spells them)."""
    enc = {b: c for c, b in byte_decoder().items()}
    return "".join(enc[b] for b in data)


MAX_TOKENIZER_BYTES = 256 << 20    # tokenizer.json (~8 MB on the real model) and its config files


def _read_json(path: Path, what: str) -> dict:
    try:
        obj = json.loads(read_regular(path, what, MAX_TOKENIZER_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise Ds4fError(f"{path}: not a valid {what} (corrupt JSON: {exc})", path=path) from None
    except RecursionError:
        raise Ds4fError(f"{path}: not a valid {what} (JSON nested too deeply to read)", path=path) from None
    if not isinstance(obj, dict):
        raise Ds4fError(f"{path}: not a valid {what} (a JSON object expected)", path=path)
    return obj


def _token_text(value) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _checkpoint_dir(path: Path | str) -> Path:
    p = Path(path)
    return p.parent if p.is_file() else p


class Tokenizer:
    """A loaded tokenizer.json (see the module docstring)."""

    def __init__(self, hf, path: Path | None = None, config: dict | None = None,
                 generation: dict | None = None) -> None:
        self._hf = hf
        self.path = path
        config = config or {}
        generation = generation or {}
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        self.vocab_size = int(hf.get_vocab_size(with_added_tokens=True))
        spec = json.loads(hf.to_str())
        dec = spec.get("decoder") or {}
        kinds = [d.get("type") for d in dec.get("decoders", [])] if dec.get("type") == "Sequence" else [dec.get("type")]
        self.byte_level = "ByteLevel" in kinds
        self._bytes: dict[int, bytes] = {}
        self._as_text = None       # a copy without the added tokens: reads every string as text (encode_text)
        self.bos_id = self._find(_token_text(config.get("bos_token")), BOS, generation.get("bos_token_id"))
        eos = generation.get("eos_token_id")
        self.eos_id = self._find(_token_text(config.get("eos_token")), EOS, eos[0] if isinstance(eos, list) and eos
                                 else eos)

    def _find(self, configured: str | None, default: str, gen_id) -> int | None:
        for s in (configured, default):
            if s is not None and self._hf.token_to_id(s) is not None:
                return int(self._hf.token_to_id(s))
        if isinstance(gen_id, int) and not isinstance(gen_id, bool) and 0 <= gen_id < self.vocab_size:
            return gen_id
        return None

    @classmethod
    def load(cls, path: Path | str) -> "Tokenizer":
        """The tokenizer of a checkpoint directory (either form; a path to its tokenizer.json works too),
        with bos/eos from tokenizer_config.json and generation_config.json where present."""
        from tokenizers import Tokenizer as HFTokenizer

        root = _checkpoint_dir(path)
        file = root / TOKENIZER_NAME
        if not file.is_file():
            raise Ds4fError(f"{file}: missing: the checkpoint has no tokenizer.json, so it runs on token ids only",
                            path=file)
        try:
            text = read_regular(file, "tokenizer", MAX_TOKENIZER_BYTES).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Ds4fError(f"{file}: not a valid tokenizer (not UTF-8: {exc})", path=file) from None
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as exc:  # the Rust library raises plain Exception
            raise Ds4fError(f"{file}: not a valid tokenizer ({str(exc).strip() or type(exc).__name__})",
                            path=file) from None
        config = _read_json(root / TOKENIZER_CONFIG_NAME, "tokenizer config") \
            if (root / TOKENIZER_CONFIG_NAME).is_file() else {}
        generation = _read_json(root / GENERATION_CONFIG_NAME, "generation config") \
            if (root / GENERATION_CONFIG_NAME).is_file() else {}
        return cls(hf, file, config, generation)

    # ---- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS added (special token strings in it become their ids)."""
        if not isinstance(text, str):
            raise Ds4fError(f"text: a string expected, got {type(text).__name__}", param="text")
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as text only, with none of the tokenizer's added tokens: a
        marker's string in it ("<｜User｜>", "</think>", "｜DSML｜"; the release's tokenizer marks some
        of them `"special": false`, which HF `tokenizers` would still match) is split as ordinary
        text by the BPE alone, never its control token. What every run of prompt text is encoded
        with (engine.text.chat), so no content can forge the chat format's turns."""
        if not isinstance(text, str):
            raise Ds4fError(f"text: a string expected, got {type(text).__name__}", param="text")
        if self._as_text is None:
            spec = json.loads(self._hf.to_str())
            spec["added_tokens"] = []
            self._as_text = type(self._hf).from_str(json.dumps(spec))
        return list(self._as_text.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (maybe part of a UTF-8 character); b"" for an unknown id."""
        got = self._bytes.get(token_id)
        if got is not None:
            return got
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise Ds4fError(f"token: a non-negative integer id expected, got {token_id!r}", param="token")
        if token_id in self._added:
            got = self._added[token_id].encode("utf-8")
        else:
            piece = self._hf.id_to_token(token_id)
            if piece is None:
                got = b""
            elif self.byte_level and all(c in byte_decoder() for c in piece):
                table = byte_decoder()
                got = bytes(table[c] for c in piece)
            else:
                got = self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._bytes[token_id] = got
        return got

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of `ids`: their bytes joined, decoded with errors="replace" (what a TextStream emits)."""
        data = b"".join(b"" if skip_special and self.is_special(i) else self.token_bytes(i) for i in ids)
        return data.decode("utf-8", errors="replace")

    # ---- special tokens
    def special_id(self, text: str) -> int:
        """The id of a token given by its string (e.g. "<｜User｜>"); Ds4fError if the tokenizer lacks it."""
        got = self._hf.token_to_id(text)
        if got is None:
            raise Ds4fError(f"{self.path or 'tokenizer'}: has no token {text!r}", param="token",
                            path=self.path)
        return int(got)

    def has_token(self, text: str) -> bool:
        """Whether the vocabulary has `text` as one token (a marker such as "｜DSML｜")."""
        return self._hf.token_to_id(text) is not None

    def is_special(self, token_id: int) -> bool:
        """An added (control) token: BOS, EOS, the chat and thinking markers and the like."""
        return token_id in self._added

    @property
    def special_tokens(self) -> dict[int, str]:
        """Every added token: id -> text."""
        return dict(self._added)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


_LOADED: dict[tuple, Tokenizer] = {}   # the last tokenizers loaded, by their files' identity
_KEEP = 4


def find_tokenizer(path: Path | str) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None if it has no tokenizer.json (a corrupt one is a Ds4fError).
    A tokenizer whose files are unchanged (path, size, mtime) is loaded once and reused: the
    release's tokenizer.json takes a moment to parse, and a server asks for it every request."""
    root = _checkpoint_dir(path)
    if not (root / TOKENIZER_NAME).is_file():
        return None
    stamps = []
    for name in (TOKENIZER_NAME, TOKENIZER_CONFIG_NAME, GENERATION_CONFIG_NAME):
        try:
            st = (root / name).stat()
            stamps.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            stamps.append((name, None))
    key = (str(root.resolve()), tuple(stamps))
    tok = _LOADED.get(key)
    if tok is None:
        tok = Tokenizer.load(root)
        if len(_LOADED) >= _KEEP:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = tok
    return tok


# DeepSeek's recommendation for local use (and the release's generation_config.json)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class GenerationDefaults:
    """Default sampling and bos/eos from a checkpoint's generation_config.json."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    min_p: float = 0.0
    do_sample: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (1,)
    path: str | None = field(default=None, compare=False)   # the file read, None: the built-in defaults

    @classmethod
    def load(cls, path: Path | str) -> "GenerationDefaults":
        """From the checkpoint directory's generation_config.json; without one, DeepSeek's recommendation
        (temperature 1.0, top_p 1.0). A corrupt file or a value out of range is a Ds4fError naming it."""
        file = _checkpoint_dir(path) / GENERATION_CONFIG_NAME
        if not file.is_file():
            return cls()
        cfg = _read_json(file, "generation config")

        def num(key: str, default: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
            v = cfg.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
                raise Ds4fError(f"{file}: {key} {v!r} is out of range", path=file)
            return float(v)

        top_k = cfg.get("top_k", 0)
        if top_k is None:
            top_k = 0
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise Ds4fError(f"{file}: top_k {top_k!r} is not a non-negative integer", path=file)
        do_sample = cfg.get("do_sample", True)
        if not isinstance(do_sample, bool):
            raise Ds4fError(f"{file}: do_sample {do_sample!r} is not true or false", path=file)

        def ids(key: str, default: tuple[int, ...]) -> tuple[int, ...]:
            v = cfg.get(key, list(default))
            v = [] if v is None else ([v] if not isinstance(v, list) else v)
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in v):
                raise Ds4fError(f"{file}: {key} {cfg.get(key)!r} is not a token id or a list of them", path=file)
            return tuple(v)

        bos = ids("bos_token_id", (0,))
        eos = ids("eos_token_id", (1,))
        return cls(temperature=num("temperature", DEFAULT_TEMPERATURE, 0.0, math.inf),
                   top_p=num("top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
                   top_k=top_k, min_p=num("min_p", 0.0, 0.0, 1.0, hi_open=True),
                   do_sample=do_sample, bos_token_id=bos[0] if bos else None,
                   eos_token_id=eos[0] if eos else None, eos_token_ids=eos, path=str(file))

    def sampling(self, seed: int = 0):
        """SamplingParams from these defaults (do_sample false: greedy)."""
        from ds4f.engine.text.sampling import SamplingParams

        if not self.do_sample:
            return SamplingParams(temperature=0.0, seed=seed)
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=seed)
