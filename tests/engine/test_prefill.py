"""Layer-major prefill: the prompt in chunks, each layer for all of a chunk's tokens, each chosen
expert read once per layer per chunk. Its state dump is byte-identical to token-by-token
processing at every chunk size and thread count; its reads are counted against the routing the
dump itself records."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.native import kernels
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state
from ds4f.engine.text.sampling import SamplingParams

PROMPT = (0, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4, 77, 19, 23, 8)     # 17 tokens, within every vocabulary
BEST = kernels.best_backend()


def _run(model, tmp_path, name, chunk, threads=2, backend=BEST, **kw):
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("gen", 4)
    run = start_run(RunConfig(model=str(model), backend=backend, kernel_threads=threads, probe_floor=False,
                              prefill_chunk=chunk, dump_path=str(tmp_path / f"{name}.bin"), **kw))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


CASES = [("tiny_model", b) for b in ("scalar", "avx2", "avx512", "neon") if b in kernels.available_backends()]


@pytest.mark.parametrize("which, backend", CASES + [("ratios_model", BEST)])
def test_the_dump_is_the_same_at_every_chunk_size_and_thread_count(request, which, backend, tmp_path):
    model = request.getfixturevalue(which)
    token = _run(model, tmp_path, "token", 0, backend=backend)
    assert token.summary_report["summary"]["prefill"] is None
    want = token.dump_path.read_bytes()
    for chunk, threads in ((1, 2), (3, 1), (5, 2), (16, 2), (64, 1)):
        run = _run(model, tmp_path, f"c{chunk}t{threads}", chunk, threads, backend=backend)
        assert run.dump_path.read_bytes() == want, (chunk, threads)
        pre = run.summary_report["summary"]["prefill"]
        assert pre["tokens"] == len(PROMPT) and pre["chunk"] == min(chunk, len(PROMPT))


@pytest.mark.parametrize("which", ["tiny_model", "ratios_model"])
def test_a_long_chunk_shared_with_the_helper_thread_gives_the_same_dump(request, which, tmp_path):
    """More tokens than the blocks the prefill hands to its helper thread (hyper-connections and
    the attention's output projection in halves) and than the attention's window: still
    token-by-token's dump."""
    from ds4f.engine.model.attention import OUTPUT_HALF_ROWS
    from ds4f.engine.model.hyper import HC_BLOCK

    model = request.getfixturevalue(which)
    prompt = tuple((7 * i + 3) % 250 for i in range(80))
    window = open_checkpoint(model).geometry.attention.window
    assert len(prompt) > window and len(prompt) > HC_BLOCK
    assert len(prompt) > OUTPUT_HALF_ROWS
    token = _run(model, tmp_path, "token", 0, prompt=prompt, gen=2)
    layer = _run(model, tmp_path, "layer", len(prompt), prompt=prompt, gen=2)
    assert layer.summary_report["summary"]["prefill"]["chunk"] == len(prompt)
    assert layer.dump_path.read_bytes() == token.dump_path.read_bytes()


@pytest.mark.parametrize("which", ["tiny_model", "ratios_model"])
def test_a_chunks_attention_in_blocks_gives_the_same_dump_and_reads(request, which, tmp_path, monkeypatch):
    """A long chunk's attention taken in blocks of ATTENTION_ROWS rows (13 here: ragged, and fewer
    than the window), its experts read once for the whole chunk: token by token's dump, and the
    reads of the chunk in one block."""
    from ds4f.engine.model import forward

    model = request.getfixturevalue(which)
    prompt = tuple((5 * i + 1) % 250 for i in range(60))
    token = _run(model, tmp_path, "token", 0, prompt=prompt, gen=2)
    whole = _run(model, tmp_path, "whole", len(prompt), prompt=prompt, gen=2)
    rows = []
    sublayer = forward.attention_sublayer

    def counted(la, X, *args, **kw):
        rows.append(len(X))
        return sublayer(la, X, *args, **kw)

    monkeypatch.setattr(forward, "ATTENTION_ROWS", 13)
    monkeypatch.setattr(forward, "attention_sublayer", counted)
    blocks = _run(model, tmp_path, "blocks", len(prompt), prompt=prompt, gen=2)
    layers = open_checkpoint(model).geometry.n_layers
    assert rows[:5 * layers] == [13, 13, 13, 13, 8] * layers        # the prompt's chunk, layer by layer
    assert blocks.dump_path.read_bytes() == token.dump_path.read_bytes() == whole.dump_path.read_bytes()
    pre, one = blocks.summary_report["summary"]["prefill"], whole.summary_report["summary"]["prefill"]
    assert pre["chunk"] == len(prompt) and (pre["hits"], pre["misses"]) == (one["hits"], one["misses"])


def test_each_chosen_expert_is_read_once_per_layer_per_chunk(tiny_model, tmp_path):
    """The cache is asked once per distinct (layer, expert) of each chunk, so the prefill's
    requests equal the distinct experts the dump records per chunk and layer, and its reads are
    at most that."""
    chunk = 8
    run = _run(tiny_model, tmp_path, "layer", chunk)
    ids = read_state(run.dump_path).records["ids"]                  # [steps, layers, top_k]
    distinct = sum(len(set(ids[a:min(a + chunk, len(PROMPT)), layer].reshape(-1).tolist()))
                   for a in range(0, len(PROMPT), chunk) for layer in range(ids.shape[1]))
    pre = run.summary_report["summary"]["prefill"]
    assert pre["hits"] + pre["misses"] == distinct
    assert pre["misses"] <= distinct
    # the whole prompt in one chunk reads each layer's experts at most once: fewer reads than
    # token by token, whose small cache cannot keep what every token needs
    whole = _run(tiny_model, tmp_path, "whole", len(PROMPT)).summary_report["summary"]["prefill"]
    n_experts = int(ids.max()) + 1
    assert whole["misses"] <= ids.shape[1] * n_experts
    token = _run(tiny_model, tmp_path, "token", 0)
    rows = token.report["tokens"][:len(PROMPT)]
    assert whole["misses"] < sum(t["misses"] for t in rows)
    assert whole["gb_per_token"] * 1e9 * len(PROMPT) < sum(t["bytes_read"] for t in rows)
    per_token = [t for t in run.report["tokens"][:len(PROMPT)]]
    assert all(t["prefill"] for t in per_token) and not any(t["prefill"] for t in run.report["tokens"][len(PROMPT):])
    assert sum(t["misses"] for t in per_token) == pre["misses"]     # the chunks' counts shared out, adding up


def test_belady_replays_the_requests_the_prefill_made(tiny_model, tmp_path):
    """Belady's optimum on the run's own request sequence (prefill chunks included) is never
    below the policy's own hit rate on the same requests."""
    run = _run(tiny_model, tmp_path, "belady", 8, gen=12, preset="minimal")
    s = run.summary_report["summary"]
    assert s["optimum_hit_rate"] is not None and s["policy_hit_rate"] is not None
    assert s["optimum_hit_rate"] >= s["policy_hit_rate"] - 1e-12


def test_sampling_after_a_prefill_is_the_same(tiny_model, tmp_path):
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=11)
    a = _run(tiny_model, tmp_path, "tok", 0, text="The cache keeps hot experts near the disk.", prompt=None,
             sampling=params, gen=6, stop_at_eos=False)
    b = _run(tiny_model, tmp_path, "chunk", 4, text="The cache keeps hot experts near the disk.", prompt=None,
             sampling=params, gen=6, stop_at_eos=False)
    assert a.dump_path.read_bytes() == b.dump_path.read_bytes() and a.output_text == b.output_text
    # a chunk without full records keeps only its last row's logits: the draw after the prompt is the same
    for dump in ("compact", "off"):
        c = _run(tiny_model, tmp_path, f"chunk-{dump}", 4, text="The cache keeps hot experts near the disk.",
                 prompt=None, sampling=params, gen=6, stop_at_eos=False, dump=dump)
        assert c.output_text == a.output_text and c.generated_ids == a.generated_ids


def test_prefill_past_the_context_and_bad_chunks_are_refused(tiny_model, tmp_path):
    with pytest.raises(Ds4fError) as e:
        start_run(RunConfig(model=str(tiny_model), prompt=PROMPT, gen=2, prefill_chunk=-1, probe_floor=False))
    assert e.value.param == "prefill_chunk"
    with pytest.raises(Ds4fError) as e:
        start_run(RunConfig(model=str(tiny_model), prompt=tuple(i % 200 for i in range(2100)), gen=2, preset="minimal",
                            probe_floor=False))
    assert e.value.param == "prompt" and "2100 tokens, past the context of 2048" in str(e.value)
    with pytest.raises(Ds4fError) as e:
        start_run(RunConfig(model=str(tiny_model), prompt=tuple(i % 200 for i in range(2040)), gen=10,
                            preset="minimal", probe_floor=False))
    assert e.value.param == "gen" and "generate at most 9" in str(e.value)


def test_a_cancelled_prefill_leaves_nothing(tiny_model, tmp_path):
    seen = []

    def stop_early(record):
        seen.append(record)
        if len(seen) == 3:
            run.cancel()

    run = start_run(RunConfig(model=str(tiny_model), prompt=PROMPT * 4, gen=2, prefill_chunk=8, probe_floor=False,
                              dump_path=str(tmp_path / "c.bin")), on_token=stop_early)
    assert run.wait(120)
    assert run.state == "cancelled" and len(seen) == 8          # the chunk in progress ends, then the run
    assert not list(tmp_path.iterdir())
    assert all(r.prefill for r in seen) and np.all([r.index for r in seen] == np.arange(8))


def test_bench_prefill_writes_one_record_per_length_and_mode(tiny_model, tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_DATA_HOME=str(tmp_path / "data"))
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "prefill", str(tiny_model), "--lengths", "8,20",
                          "-n", "3", "--json", str(tmp_path / "p.json"), "-o", "csv"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    records = json.loads((tmp_path / "p.json").read_text())
    assert [(r["prompt_tokens"], r["mode"]) for r in records] == [(8, "token"), (8, "layer"), (20, "token"),
                                                                   (20, "layer")]
    for r in records:
        assert {"prompt_tokens", "mode", "tokens_per_s", "gb_per_token", "decode_tokens_per_s", "read_gb_per_s"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["gb_per_token"] > 0
        # bytes over the time a read was in flight: at least the rate over the prompt's whole time
        assert r["read_gb_per_s"] >= r["gb_per_token"] * r["tokens_per_s"] * (1 - 1e-9)
    by = {(r["prompt_tokens"], r["mode"]): r for r in records}
    assert by[(20, "layer")]["chunk"] == 20 and by[(20, "token")]["chunk"] == 1
    assert by[(20, "layer")]["gb_per_token"] < by[(20, "token")]["gb_per_token"]   # one chunk: each expert once
    assert out.stdout.startswith("prompt_tokens,mode,chunk,")


@pytest.mark.parametrize("geometry", ["tiny", "bench", "flash"])
def test_the_memory_plan_counts_the_chunk_buffers_a_session_allocates(geometry):
    from ds4f.engine.model.geometry import get_geometry
    from ds4f.engine.model.forward import ChunkBuffers

    g = get_geometry(geometry)
    for n in (1, 7, 64) if geometry != "flash" else (2,):
        for records in ("full", "compact", "none"):
            assert ChunkBuffers(g, n, records).nbytes == ChunkBuffers.nbytes_for(g, n, records), records


@pytest.mark.parametrize("which", ["tiny_model", "tiny_moe_only"])
def test_a_compact_dump_made_layer_by_layer_is_the_full_runs_compact_records(request, which, tmp_path):
    """A run with a compact dump keeps its prompt chunks' records compact as each layer ends (the
    chunk never holds the layers' states); what it writes is, byte for byte, the compact records
    of a full run's dump (each digest a blake2b of that layer's exact bits: checked here with
    hashlib on the full record). Without a dump the run's tokens are the same."""
    import hashlib

    from ds4f.runs.statedump import compact_records

    model = request.getfixturevalue(which)
    kw = {"moe_only": True} if which == "tiny_moe_only" else {}
    full = _run(model, tmp_path, "full", 4, dump="full", **kw)
    compact = _run(model, tmp_path, "compact", 4, dump="compact", **kw)
    off = _run(model, tmp_path, "off", 4, dump="off", **kw)
    sf, sc = read_state(full.dump_path), read_state(compact.dump_path)
    assert sc.mode == "compact" and len(sc.records) == len(PROMPT) + 4 - 1     # a step per token fed
    assert compact_records(sf.records, sf.header["geometry"]).tobytes() == sc.records.tobytes()
    c, layer = 6, 1                                       # a prompt token of the second chunk
    rec = sf.records[c]
    h = hashlib.blake2b(rec["hidden"][layer].tobytes(), digest_size=8)
    if "attn" in sf.records.dtype.names:
        h.update(rec["attn"][layer].tobytes())
    assert int(sc.records[c]["digest"][layer]) == int.from_bytes(h.digest(), "little")
    assert off.generated_ids == full.generated_ids and len(full.generated_ids) == 4
    # the session's prompt chunk was of its run's kind: without the 4 tokens' layer states,
    # attention outputs and logits, with their digests, sketches and top logits (compact) or not (off)
    from ds4f.engine.model.forward import ChunkBuffers

    g = open_checkpoint(model).geometry
    nbytes = {r.config.dump: r._lease.session_nbytes for r in (full, compact, off)}
    for dump, records in (("compact", "compact"), ("off", "none")):
        assert nbytes["full"] - nbytes[dump] == ChunkBuffers.nbytes_for(g, 4, "full") - ChunkBuffers.nbytes_for(g, 4, records)


def test_the_moe_only_model_prefills_to_the_same_dump(tiny_moe_only, tmp_path):
    runs = [_run(tiny_moe_only, tmp_path, f"m{chunk}", chunk, moe_only=True) for chunk in (0, 3, len(PROMPT))]
    dumps = [r.dump_path.read_bytes() for r in runs]
    assert dumps[0] == dumps[1] == dumps[2]
    assert runs[2].summary_report["summary"]["prefill"]["chunk"] == len(PROMPT)


def test_a_cancel_stops_a_chunk_between_layers(tiny_model, tmp_path):
    """A chunk of the real model takes minutes: a cancel lands at the next layer, not the next chunk."""
    import threading

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine
    from ds4f.engine.model.forward import Stopped

    preset = load_config(None).get_preset("laptop")
    with open_checkpoint(tiny_model) as ck:
        eng = Engine(ck, preset, 2, 1, "scalar")
        try:
            session = eng.new_session(prefill_chunk=8)
            asked = []

            def stop_at_layer_2():
                asked.append(True)
                return len(asked) > 2

            with pytest.raises(Stopped, match="before layer 2"):
                session.prefill(list(PROMPT[:8]), should_stop=stop_at_layer_2)
            assert session.position == 0 and len(asked) == 3
        finally:
            eng.close()
    # through the run API: a cancel before or while the one chunk computes ends the run with no record
    started = threading.Event()
    run = start_run(RunConfig(model=str(tiny_model), prompt=PROMPT * 3, gen=2, prefill_chunk=len(PROMPT) * 3,
                              probe_floor=False, dump_path=str(tmp_path / "c.bin")), on_token=lambda r: started.set())
    run.cancel()
    assert run.wait(120) and run.state == "cancelled"
    assert not started.is_set() and not list(tmp_path.iterdir())    # no record of the chunk, no files


@pytest.mark.parametrize("which", ["tiny_model", "ratios_model"])
def test_a_chunks_temporaries_stay_within_what_the_plan_counts(request, which):
    """numpy's allocations while a chunk runs (traced: numpy reports them to tracemalloc), beyond
    the session's buffers, peak within model.forward.transient_nbytes, which the memory plan and
    the session's budget count; and not far below it, so the bound says something."""
    import tracemalloc

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine
    from ds4f.engine.model.forward import transient_nbytes

    model = request.getfixturevalue(which)
    cfg = load_config()
    engine = Engine(open_checkpoint(model), cfg.get_preset("laptop"), 2, 2, BEST)
    try:
        g = engine.geometry
        chunk = 96                      # the per-token temporaries well above the fixed blocks
        session = engine.new_session(chunk)
        tokens = [int(t) % g.vocab for t in np.random.default_rng(5).integers(8, 10**6, chunk)]
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            session.prefill(tokens)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    finally:
        engine.close()
    bound = transient_nbytes(g, chunk)
    assert bound / 4 < peak <= bound, (peak, bound)
