"""`ds4f bench structured`: what a response format's constraint (engine.text.constraint) costs.

For each vocabulary (the demo model's, the flash geometry's 129,280 ids, both the synthetic
tokenizer ds4f synth writes, and the checkpoint's own tokenizer when MODEL is given), answers to
a JSON Schema (an object with a string, an integer, an enum, an array of strings and a nested
object) are generated with random logits until the end-of-sentence token, so the walk goes
through the grammar's states as a model's would (inside strings most of the vocabulary is
allowed; between values a few tokens):

- the llguidance tokenizer's build (once per tokenizer), the schema's first compilation, and a
  request's matcher from the kept grammar (every later request with that schema);
- per token: the mask (the matcher's bitmask and the allowed ids) computed in the thread that
  asks, median, 90th percentile and worst, and the share of steps where most of the vocabulary is
  allowed (inside strings); what allowed() waits for the mask computed ahead while the logits are
  made (here drawing random logits stands for the forward pass, far shorter than a model's); and
  a pick's whole cost with the constraint against the same pick without it, greedy and sampled
  (temperature 1), on the same logits;
- a request's memory: the resident set's growth over MEMORY_REQUESTS live constraints, each
  MEMORY_STEPS tokens into the same answer, divided by their number (llguidance's matcher state,
  the mask's words: a bit an id; the allowed ids of a step are transient, up to 8 bytes an id).

The model's forward pass is not in these figures: they are what a token costs on top of it.
"""
from __future__ import annotations

import ctypes
import gc
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.text.constraint import Constraint, ResponseFormat, compiled_for
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.engine.text.synthetic import write_tokenizer_files
from ds4f.engine.text.tokenizer import Tokenizer, find_tokenizer
from ds4f.errors import Ds4fError

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                     "required": ["city", "zip"], "additionalProperties": False}},
          "required": ["name", "age", "color", "tags", "address"], "additionalProperties": False}
ANSWERS = 8                # answers generated per vocabulary
MAX_TOKENS = 600           # an answer's bound (the schema bounds every value)
MEMORY_REQUESTS = 256      # live constraints the memory figure is measured over
MEMORY_STEPS = 40          # tokens each of them has taken


def _synthetic(geometry: str, root: Path) -> Tokenizer:
    d = root / geometry
    d.mkdir()
    write_tokenizer_files(d, GEOMETRIES[geometry])
    return Tokenizer.load(d)


def _answers(tok: Tokenizer, fmt: ResponseFormat, vocab: int) -> dict:
    """Every step's mask computed where it is asked for (seconds), the wait for the one computed
    ahead while the logits are made (the forward pass's stand-in: drawing `vocab` normals), the
    allowed counts, and each answer's tokens."""
    out = {"mask": [], "wait": [], "allowed": [], "lengths": []}
    for seed in range(ANSWERS):
        c = Constraint(tok, fmt, vocab)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        rng = np.random.default_rng(seed)
        for n in range(MAX_TOKENS):
            logits = rng.normal(0, 3, vocab).astype(np.float32)
            t0 = time.perf_counter()
            ids = c.allowed()
            t1 = time.perf_counter()
            c._mask()          # the same mask again, in this thread: its whole cost
            out["mask"].append(time.perf_counter() - t1)
            out["wait"].append(t1 - t0)
            out["allowed"].append(len(ids))
            t = int(ids[sampler.sample(logits[ids])])
            c.advance(t)
            if t == tok.eos_id:
                break
        out["lengths"].append(n + 1)
    return out


def _picks(tok: Tokenizer, fmt: ResponseFormat, vocab: int, temperature: float) -> tuple[float, float]:
    """Median seconds of a pick with the constraint (mask, pick, advance) and of a plain pick, on
    the same logits, over one answer."""
    params = SamplingParams(temperature=temperature, seed=1)
    constrained, plain = Sampler(params, constraint=Constraint(tok, fmt, vocab)), Sampler(params)
    rng = np.random.default_rng(1)
    with_c, without = [], []
    for _ in range(MAX_TOKENS):
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        t0 = time.perf_counter()
        plain.sample(logits)
        t1 = time.perf_counter()
        t = constrained.sample(logits)
        t2 = time.perf_counter()
        without.append(t1 - t0)
        with_c.append(t2 - t1)
        if t == tok.eos_id:
            break
    return float(np.median(with_c)), float(np.median(without))


def _heap_bytes() -> int | None:
    """The C heap's bytes in use (glibc's mallinfo2: llguidance allocates there); None elsewhere."""
    try:
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = Info
    info = fn()
    return info.uordblks + info.hblkhd


def _walk(c: Constraint, eos: int) -> Constraint:
    """MEMORY_STEPS tokens into an answer (the same ones for every constraint: seed 0), the next mask made."""
    rng = np.random.default_rng(0)
    for _ in range(MEMORY_STEPS):
        ids = c.allowed()
        t = int(ids[rng.integers(len(ids))])
        if t == eos:
            break
        c.advance(t)
    c.allowed()
    return c


def _memory(tok: Tokenizer, fmt: ResponseFormat, vocab: int) -> float:
    """Bytes per live constraint: MEMORY_REQUESTS of them on the same path, after one walk down it
    (the grammar's shared lexer states built), so what grows is theirs alone: the C heap's bytes
    in use where glibc says them, else the resident set (which reuse of freed memory understates)."""
    _walk(Constraint(tok, fmt, vocab), tok.eos_id)
    gc.collect()
    rss = psutil.Process().memory_info
    heap = _heap_bytes()
    before = heap if heap is not None else rss().rss
    live = [_walk(Constraint(tok, fmt, vocab), tok.eos_id) for _ in range(MEMORY_REQUESTS)]
    gc.collect()
    grown = (_heap_bytes() if heap is not None else rss().rss) - before
    del live
    return max(grown, 0) / MEMORY_REQUESTS


def bench_tokenizer(name: str, tok: Tokenizer, vocab: int | None = None) -> dict:
    """One vocabulary's record (see the module docstring)."""
    vocab = vocab or tok.vocab_size
    t0 = time.perf_counter()
    compiled_for(tok)
    build_s = time.perf_counter() - t0
    fmt = ResponseFormat.json_schema(SCHEMA, name="bench")
    t0 = time.perf_counter()
    Constraint(tok, fmt, vocab)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    Constraint(tok, fmt, vocab)
    copy_s = time.perf_counter() - t0
    memory = _memory(tok, fmt, vocab)
    steps = _answers(tok, fmt, vocab)
    greedy = _picks(tok, fmt, vocab, 0.0)
    sampled = _picks(tok, fmt, vocab, 1.0)
    ms, wait = np.array(steps["mask"]) * 1e6, np.array(steps["wait"]) * 1e6
    allowed = np.array(steps["allowed"])
    return {"vocab": name, "ids": vocab, "tokenizer_build_s": build_s, "compile_ms": compile_s * 1e3,
            "request_ms": copy_s * 1e3, "tokens": len(ms), "answer_tokens_median": float(np.median(steps["lengths"])),
            "mask_us_median": float(np.median(ms)), "mask_us_p90": float(np.percentile(ms, 90)),
            "mask_us_max": float(ms.max()), "wait_us_median": float(np.median(wait)),
            "wait_us_p90": float(np.percentile(wait, 90)),
            "wide_steps": float(np.mean(allowed > vocab // 2)), "allowed_median": float(np.median(allowed)),
            "greedy_pick_us": greedy[0] * 1e6, "greedy_plain_us": greedy[1] * 1e6,
            "sampled_pick_us": sampled[0] * 1e6, "sampled_plain_us": sampled[1] * 1e6,
            "request_kib": memory / 1024}


def bench_structured(model: str | None = None, log=print) -> list[dict]:
    """The records of the demo and flash vocabularies (synthetic tokenizers), and of MODEL's tokenizer."""
    records = []
    with tempfile.TemporaryDirectory(prefix="ds4f-bench-structured-") as root:
        for geometry in ("demo", "flash"):
            log(f"bench structured: the {geometry} vocabulary ({GEOMETRIES[geometry].vocab} ids, synthetic tokenizer)")
            records.append(bench_tokenizer(f"{geometry} (synthetic)", _synthetic(geometry, Path(root))))
    if model is not None:
        tok = find_tokenizer(model)
        if tok is None:
            raise Ds4fError(f"{model}: no tokenizer.json to measure", param="model")
        log(f"bench structured: {model}'s tokenizer ({tok.vocab_size} ids)")
        records.append(bench_tokenizer(Path(model).name or str(model), tok))
    return records
