"""Structured outputs: an answer held to JSON, or to JSON that follows a JSON Schema, token by token.

    fmt = ResponseFormat.json_schema(schema, name="person")     # or ResponseFormat.json_object()
    check_response_format(fmt)        # Ds4fError(param="response_format") when the schema cannot be compiled
    c = Constraint(tokenizer, fmt, vocab=geometry.vocab, thinking=False)
    sampler = Sampler(params, constraint=c)    # each pick among c.allowed() only; then c.advance(token)

The grammar is llguidance's (the library llama.cpp and vLLM use): a JSON Schema compiled to a
grammar over bytes, and a matcher that, for the tokenizer's vocabulary, gives at each step the
set of tokens that keep the text a prefix of some valid answer (an Earley parser over a lazy
lexer; the mask of a step costs tens of microseconds on DeepSeek's 129,280 ids). The end-of-
sentence token is in that set only where the text so far is a whole valid answer, so an answer
that ends by itself (not at the token limit) parses and validates. Ids past the tokenizer's
vocabulary (a model's padded ids) are never allowed.

A pick among the allowed tokens is the pick on the logits with every other token at -inf: the
sampler takes the allowed ids' logits in id order and draws among them as it would among all
(greedy: their argmax, the lowest id on ties; sampled: the same filters and one uniform), so a
seed reproduces a constrained run byte for byte too.

JSON is written compactly with Python's separators (", " and ": ", no other whitespace), which
also keeps a model from filling its token budget with whitespace. A schema may change these
with llguidance's "x-guidance" options. Keywords the library does not implement (uniqueItems,
if/then, ...), unknown formats, unresolvable $refs and unsatisfiable bounds are refused with the
library's reason. OpenAI's `strict` is accepted either way: the schema is always enforced.

Thinking mode: the reasoning is free (only the end-of-sentence token is held back, so the model
cannot end before it answers) and the constraint starts after the </think> token; chat mode's
prompt ends with </think>, so its answer is constrained from the first token. DeepSeek's prompt
format is not changed: the mask alone makes the answer valid.

Compiled grammars are kept by schema text (per tokenizer, the last MAX_GRAMMARS); a request's
matcher is a copy of the kept one, so a repeated schema costs no compilation.

The next step's mask is computed as soon as a token is taken (advance), on a helper thread
(llguidance releases the GIL), so it overlaps the forward pass that makes the next logits;
allowed() waits for it. The mask depends on the tokens taken only, so this changes no pick.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.text.tokenizer import END_THINK

KINDS = ("json_object", "json_schema")
MAX_GRAMMARS = 32          # compiled grammars kept per tokenizer (by schema text)
MAX_SCHEMA_CHARS = 1 << 20
# how the JSON is written: Python's json.dumps separators, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'
PARAM = "response_format"
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ds4f-mask")   # the next masks, computed ahead


def _llg():
    try:
        import llguidance
    except ImportError as exc:    # a dependency of the package: only a broken install lacks it
        raise Ds4fError(f"{PARAM}: structured outputs need the llguidance package ({exc})", kind="internal") from None
    return llguidance


@dataclass(frozen=True)
class ResponseFormat:
    """What the answer must be: any JSON object (json_object), or JSON valid against `schema`
    (json_schema; the schema as JSON text, its keys in the order given: properties are written in
    that order)."""
    kind: str                      # json_object | json_schema
    schema: str = ANY_OBJECT       # JSON text of the JSON Schema
    name: str | None = None        # the schema's name (OpenAI's json_schema.name)
    strict: bool | None = None     # OpenAI's strict (accepted either way: the schema is always enforced)

    @classmethod
    def json_object(cls) -> "ResponseFormat":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema, name: str | None = None, strict: bool | None = None) -> "ResponseFormat":
        """schema: a JSON Schema object (a dict), or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise Ds4fError(f"{PARAM}: the schema is not JSON: {exc}", param=PARAM) from None
        if not isinstance(schema, dict):
            raise Ds4fError(f"{PARAM}: the schema must be a JSON Schema object, got {type(schema).__name__}",
                            param=PARAM)
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise Ds4fError(f"{PARAM}: the schema is not JSON: {exc}", param=PARAM) from None
        return cls("json_schema", text, name, strict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_response_format(fmt) -> ResponseFormat:
    """`fmt` if the library compiles its grammar; else a Ds4fError naming response_format and the
    library's reason."""
    if not isinstance(fmt, ResponseFormat):
        raise Ds4fError(f"{PARAM}: expected a ResponseFormat, got {type(fmt).__name__}", param=PARAM)
    if fmt.kind not in KINDS:
        raise Ds4fError(f"{PARAM}: {fmt.kind!r} is not one of {', '.join(KINDS)}", param=PARAM)
    if not isinstance(fmt.schema, str) or len(fmt.schema) > MAX_SCHEMA_CHARS:
        raise Ds4fError(f"{PARAM}: the schema must be JSON text of at most {MAX_SCHEMA_CHARS} characters",
                        param=PARAM)
    _checked_grammar(fmt.schema)
    return fmt


_CHECKED_LOCK = threading.Lock()
_CHECKED: OrderedDict[str, str] = OrderedDict()      # schema text -> its grammar, compiled once without a tokenizer


def _checked_grammar(schema: str) -> str:
    """The llguidance grammar of a schema, validated (no tokenizer needed); Ds4fError if it does not compile."""
    with _CHECKED_LOCK:
        if schema in _CHECKED:
            _CHECKED.move_to_end(schema)
            return _CHECKED[schema]
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise Ds4fError(f"{PARAM}: the schema cannot be compiled: {exc}", param=PARAM) from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = "; ".join(m.strip() for m in messages) or "no reason given"
        raise Ds4fError(f"{PARAM}: the schema cannot be compiled: {reason}", param=PARAM)
    with _CHECKED_LOCK:
        _CHECKED[schema] = grammar
        while len(_CHECKED) > 4 * MAX_GRAMMARS:
            _CHECKED.popitem(last=False)
    return grammar


class _Compiled:
    """One tokenizer's side of llguidance: its LLTokenizer (built once: about a second for
    DeepSeek's vocabulary) and the matchers of the last MAX_GRAMMARS schemas, fresh, to copy."""

    def __init__(self, tokenizer) -> None:
        llg = _llg()
        if tokenizer.eos_id is None:
            raise Ds4fError(f"{PARAM}: the tokenizer has no end-of-sentence token, so no answer could end",
                            param=PARAM)
        self.llg_tokenizer = llg.LLTokenizer(tokenizer._hf.to_str(), eos_token=int(tokenizer.eos_id))
        self.lock = threading.Lock()
        self.matchers: OrderedDict[str, object] = OrderedDict()

    def matcher(self, schema: str):
        """A fresh matcher of `schema`'s grammar (a copy of the kept one)."""
        with self.lock:
            kept = self.matchers.get(schema)
            if kept is not None:
                self.matchers.move_to_end(schema)
                return kept.deep_copy()
        grammar = _checked_grammar(schema)
        kept = _llg().LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if kept.is_error():
            raise Ds4fError(f"{PARAM}: the schema cannot be compiled for this tokenizer: {kept.get_error()}",
                            param=PARAM)
        with self.lock:
            self.matchers[schema] = kept
            while len(self.matchers) > MAX_GRAMMARS:
                self.matchers.popitem(last=False)
        return kept.deep_copy()


_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # Tokenizer -> _Compiled


def compiled_for(tokenizer) -> _Compiled:
    with _TOKENIZERS_LOCK:
        got = _TOKENIZERS.get(tokenizer)
        if got is None:
            got = _TOKENIZERS[tokenizer] = _Compiled(tokenizer)
        return got


def prepare(tokenizer, fmt: ResponseFormat) -> None:
    """Compile `fmt` for `tokenizer` now (kept for the run that follows): a Ds4fError naming
    response_format before a run starts, rather than in its first step."""
    check_response_format(fmt)
    compiled_for(tokenizer).matcher(fmt.schema)


class Constraint:
    """One answer's constraint: the tokens its next pick may be (allowed), and its progress
    (advance, after each pick). vocab: the model's vocabulary (the logits' length)."""

    def __init__(self, tokenizer, fmt: ResponseFormat, vocab: int, thinking: bool = False) -> None:
        check_response_format(fmt)
        comp = compiled_for(tokenizer)
        self.format = fmt
        self.vocab = int(vocab)
        self.eos_id = int(tokenizer.eos_id)
        self.matcher = comp.matcher(fmt.schema)
        n = min(comp.llg_tokenizer.vocab_size, self.vocab)   # ids past the tokenizer's: never allowed
        self._n = n
        self._words = np.zeros((comp.llg_tokenizer.vocab_size + 31) // 32, dtype="<i4")  # the mask, a bit an id
        # thinking mode: free reasoning (no end-of-sentence) until </think>, then the answer
        self.end_think = tokenizer.special_id(END_THINK) if thinking else None
        self.answering = not thinking
        self.tokens = 0          # the answer's tokens consumed so far
        self._reasoning_ids = None
        self._next = _MASKS.submit(self._mask) if self.answering else None   # the next step's allowed ids

    def allowed(self) -> np.ndarray:
        """The ids the next pick may be, ascending."""
        if not self.answering:
            if self._reasoning_ids is None:
                self._reasoning_ids = np.delete(np.arange(self.vocab, dtype=np.int32), self.eos_id)
            return self._reasoning_ids
        nxt, self._next = self._next, None
        return nxt.result() if nxt is not None else self._mask()

    def advance(self, token: int) -> None:
        """The pick was `token`; the next step's mask is begun."""
        if not self.answering:
            self.answering = token == self.end_think
        else:
            if self._next is not None:     # a mask computed and not asked for (advance without allowed)
                self._next.result()
                self._next = None
            if not self.matcher.consume_token(int(token)):
                raise self._failed()
            self.tokens += 1
        if self.answering and not self.matcher.is_stopped():
            self._next = _MASKS.submit(self._mask)

    def _mask(self) -> np.ndarray:
        """The allowed ids of the matcher's state: its bitmask (a bit an id), unpacked."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise self._failed()
        ids = np.flatnonzero(np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self._n).view(bool))
        if ids.size == 0:
            raise self._failed("no token can continue the answer")
        return ids

    @property
    def accepting(self) -> bool:
        """The answer so far is a whole valid answer."""
        return self.answering and self.matcher.is_accepting()

    @property
    def nbytes(self) -> int:
        """The buffers this constraint holds in Python (the mask's words; the reasoning's ids once
        made); the matcher's own state lives in llguidance."""
        return self._words.nbytes + (self._reasoning_ids.nbytes if self._reasoning_ids is not None else 0)

    def state(self) -> dict:
        return {"kind": self.format.kind, "answering": self.answering, "tokens": self.tokens,
                "accepting": self.accepting}

    def _failed(self, why: str | None = None) -> Ds4fError:
        why = why or self.matcher.get_error() or "the grammar refused the token"
        return Ds4fError(f"{PARAM}: the constrained answer failed after {self.tokens} tokens: {why}",
                         kind="internal")
