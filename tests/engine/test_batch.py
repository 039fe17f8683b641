"""Several sequences stepping together (engine.batch, model.forward): each sequence's tokens and state
dump are byte-identical to the same run alone, whoever it shares its steps with, as sequences
join and leave mid-way; a sequence that fails fails alone."""
from __future__ import annotations

import dataclasses
import shutil
import threading

import numpy as np
import pytest

from ds4f.native import kernels
from ds4f.engine.model.forward import ChunkBuffers, Segment, forward_rows
from ds4f.runs.config import RunConfig
from ds4f.runs.host import EngineHost
from ds4f.runs.run import active_runs, start_run
from ds4f.errors import Ds4fError

BACKENDS = [b for b in ("scalar", "avx2", "avx512", "neon") if b in kernels.available_backends()]
# three requests: prompt, tokens to generate (the first one's prompt passes the CSA layers'
# index_topk, so its indexer selects, some of its steps beside sequences that do not)
REQUESTS = [((0, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4, 77, 19, 23, 8), 12),
            ((9, 8, 7, 6, 5, 4, 3, 2, 1), 5),
            ((100, 101, 5, 5, 5, 60, 61, 62, 63, 64, 65, 66, 67), 8)]


def _config(model, path, prompt, gen, backend, **kw):
    return RunConfig(model=str(model), prompt=prompt, gen=gen, backend=backend, kernel_threads=2, probe_floor=False,
                     prefill_chunk=5, dump_path=str(path), **kw)


def _done(run):
    assert run.wait(300), "run did not finish"
    assert run.state == "done", run.error
    return run


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_sequence_is_what_it_is_alone_as_sequences_join_and_leave(ratios_model, backend, tmp_path):
    alone = [_done(start_run(_config(ratios_model, tmp_path / f"alone{i}.bin", p, g, backend)))
             for i, (p, g) in enumerate(REQUESTS)]
    host = EngineHost(parallel=3)
    gates = [threading.Event() for _ in REQUESTS]
    go = [threading.Event() for _ in REQUESTS]

    def hold_at(i, step):
        def on_token(rec):
            if rec.index == step and not gates[i].is_set():   # the next sequence starts while this one runs
                gates[i].set()
                go[i].wait(30)
        return on_token

    runs = []
    try:
        for i, (p, g) in enumerate(REQUESTS):
            hook = hold_at(i, (6, 3, 99)[i])
            runs.append(start_run(_config(ratios_model, tmp_path / f"together{i}.bin", p, g, backend),
                                  engines=host, on_token=hook))
            if i + 1 < len(REQUESTS):
                assert gates[i].wait(60), "the sequence did not reach the step the next one joins at"
            if i:
                go[i - 1].set()
        go[-1].set()
        for run in runs:
            _done(run)
        for a, b in zip(alone, runs):
            assert b.dump_path.read_bytes() == a.dump_path.read_bytes()
            assert b.generated_ids == a.generated_ids
        shared = [r.summary_report["summary"]["batch"]["shared_steps"] for r in runs]
        assert all(s > 0 for s in shared), shared          # each sequence did share steps
        figures = host._engine.batcher.figures()
        assert figures.shared_steps > 0 and figures.last_sequences >= 1
    finally:
        for g in go:
            g.set()
        for run in runs:
            run.cancel()
            run.wait(30)
        host.close()


def test_rows_of_several_sequences_are_their_own_in_one_pass(ratios_model):
    """forward_rows with segments of three sequences at different positions: each row's logits
    and records are those of a pass over that sequence alone."""
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine

    preset = load_config(None).get_preset(None)
    engine = Engine(open_checkpoint(ratios_model), preset, 2, 2, kernels.best_backend())
    try:
        def session_at(prompt):
            s = engine.new_session(8, cold=False)
            s.prefill(list(prompt))
            return s

        prompts = [p[:8] for p, _ in REQUESTS]
        nexts = [[int(t) for t in (3, 4, 5)], [7], [1, 2]]
        want = []
        for p, nx in zip(prompts, nexts):
            s = session_at(p)
            got = s.prefill(nx)
            want.append((got.logits.copy(), got.hidden.copy(), got.ids.copy()))
        sessions = [session_at(p) for p in prompts]
        buf = ChunkBuffers(engine.geometry, 8)
        segs = [Segment(nx, s.position, s.kv) for s, nx in zip(sessions, nexts)]
        logits = forward_rows(engine.streamer, segs, buf, isolate=True)
        row = 0
        for (wl, wh, wi), nx, seg in zip(want, nexts, segs):
            k = len(nx)
            assert seg.error is None
            assert logits[row:row + k].tobytes() == wl.tobytes()
            assert buf.hidden[row:row + k].tobytes() == wh.tobytes()
            assert np.array_equal(buf.ids[row:row + k], wi)
            row += k
    finally:
        engine.close()
        engine.ckpt.close()


def test_a_sequence_whose_row_fails_fails_alone(ratios_model):
    """A row that turns non-finite (its residual poisoned, as a corrupt weight would) fails its
    sequence with a message naming the token; the other sequences' rows are untouched."""
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine

    preset = load_config(None).get_preset(None)
    engine = Engine(open_checkpoint(ratios_model), preset, 2, 2, kernels.best_backend())
    try:
        sessions = [engine.new_session(4, cold=False) for _ in range(3)]
        for s, (p, _) in zip(sessions, REQUESTS):
            s.prefill(list(p[:4]))
        want = []
        for s, (p, _) in zip([engine.new_session(4, cold=False) for _ in range(3)], REQUESTS):
            s.prefill(list(p[:4]))
            want.append(s.prefill([30 + len(want)]).logits.copy())
        buf = ChunkBuffers(engine.geometry, 4)
        segs = [Segment([30 + i], s.position, s.kv) for i, s in enumerate(sessions)]   # a token of its own each
        embed = engine.streamer.globals.embed
        poisoned = np.array(embed, copy=True)
        poisoned[segs[1].token_ids[0]] = np.nan
        engine.streamer.globals = dataclasses.replace(engine.streamer.globals, embed=poisoned)
        with np.errstate(invalid="ignore"):      # the poisoned row's NaNs, on their way
            logits = forward_rows(engine.streamer, segs, buf, isolate=True)
        assert segs[1].error is not None and "non-finite" in segs[1].error.message
        assert segs[0].error is None and segs[2].error is None
        assert logits[0].tobytes() == want[0].tobytes() and logits[2].tobytes() == want[2].tobytes()
        with pytest.raises(Ds4fError, match="non-finite"), np.errstate(invalid="ignore"):
            forward_rows(engine.streamer, [Segment([31], 5, sessions[1].kv)], buf)
    finally:
        engine.close()
        engine.ckpt.close()


def test_a_host_for_several_sequences_refuses_one_more(ratios_model, tmp_path):
    host = EngineHost(parallel=2)
    hold = threading.Event()
    started = [threading.Event(), threading.Event()]
    runs = []
    try:
        for i in range(2):
            def on_token(rec, i=i):
                started[i].set()
                hold.wait(30)
            p, g = REQUESTS[i]
            runs.append(start_run(_config(ratios_model, tmp_path / f"r{i}.bin", p, g, BACKENDS[-1]),
                                  engines=host, on_token=on_token))
            assert started[i].wait(60)
        assert len(active_runs()) == 2
        with pytest.raises(Ds4fError, match="2 sequences step together at most") as err:
            start_run(_config(ratios_model, tmp_path / "r2.bin", *REQUESTS[2], BACKENDS[-1]), engines=host)
        assert err.value.kind == "busy"
        with pytest.raises(Ds4fError, match="still active"):       # a run on no host waits for them too
            start_run(_config(ratios_model, tmp_path / "r3.bin", *REQUESTS[2], BACKENDS[-1]))
        with pytest.raises(Ds4fError, match="at least 1"):
            EngineHost(parallel=0)
    finally:
        hold.set()
        for run in runs:
            run.wait(60)
        host.close()
    assert not (tmp_path / "r2.bin").exists() and not (tmp_path / "r3.bin").exists()


def test_a_sequence_whose_expert_read_fails_fails_alone(ratios_model, tmp_path):
    """An expert record that turns corrupt on disk (its crc32 no longer matches) fails the one
    sequence whose row chose it, naming the expert and the file; the others' rows are those
    they get alone."""
    import json

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine

    broken = tmp_path / "broken"
    shutil.copytree(ratios_model, broken)
    preset = load_config(None).get_preset(None)
    engine = Engine(open_checkpoint(broken), preset, 2, 2, kernels.best_backend())
    g = engine.geometry
    try:
        sessions = [engine.new_session(4, cold=False) for _ in range(3)]
        for s, (p, _) in zip(sessions, REQUESTS):
            s.prefill(list(p[:4]))
        want, ids = [], []
        for i, (s, (p, _)) in enumerate(zip([engine.new_session(4, cold=False) for _ in range(3)], REQUESTS)):
            s.prefill(list(p[:4]))
            got = s.prefill([30 + i])
            want.append(got.logits.copy())
            ids.append(got.ids[0].copy())          # [n_layers, top_k]
        # an expert the second sequence chose at a layer past the hash layers, and no other
        layer, expert = next((L, int(e)) for L in range(g.n_hash_layers, g.n_layers) for e in ids[1][L]
                             if e not in ids[0][L] and e not in ids[2][L])
        offset = json.loads((broken / "pool-mxfp4.json").read_text())["records"][layer * g.n_experts + expert][0]
        with open(broken / "pool-mxfp4.bin", "r+b") as f:
            f.seek(offset + g.expert_nbytes // 2)
            byte = f.read(1)
            f.seek(offset + g.expert_nbytes // 2)
            f.write(bytes([byte[0] ^ 0x01]))        # one flipped bit in the weights
        engine.cache.reset()                        # every expert read again, from the file as it is now
        buf = ChunkBuffers(g, 4)
        segs = [Segment([30 + i], s.position, s.kv) for i, s in enumerate(sessions)]
        with np.errstate(invalid="ignore"):
            logits = forward_rows(engine.streamer, segs, buf, isolate=True)
        assert segs[1].error is not None, "the corrupt record was not read"
        assert f"expert {expert}" in segs[1].error.message and "crc32" in segs[1].error.message, segs[1].error
        assert segs[0].error is None and segs[2].error is None
        assert logits[0].tobytes() == want[0].tobytes() and logits[2].tobytes() == want[2].tobytes()
    finally:
        engine.close()
        engine.ckpt.close()


class _Geometry:
    """What a StepBatcher needs of an engine to be made (its buffers' shapes)."""

    def __init__(self, ratios_model):
        from ds4f.engine.checkpoint import open_checkpoint

        with open_checkpoint(ratios_model) as ck:
            self.geometry = ck.geometry


def test_the_cap_is_the_largest_batch_that_paid(ratios_model):
    """A decode step of k sequences that takes at least k steps of one does not pay: steps are
    capped below the smallest such k, with the figures in the reason; when it pays again (its
    running mean falls), the cap goes back up."""
    from ds4f.engine.batch import StepBatcher

    b = StepBatcher(_Geometry(ratios_model), parallel=4, rows=8)
    b._step_s = {2: 1.5}
    b._decide_cap()
    assert b.cap == 4 and b.cap_reason == ""            # no step of one measured yet: no yardstick
    b._step_s = {1: 1.0, 2: 1.5, 3: 3.3, 4: 3.0}
    b._decide_cap()
    assert b.cap == 2 and "a step of 3 sequences took 3.300 s, 3 steps of one 3.000 s" in b.cap_reason
    b._step_s[3] = 2.5
    b._decide_cap()
    assert b.cap == 4 and b.cap_reason == ""
    b._step_s[2] = 2.0                                  # exactly two steps' time: does not pay
    b._decide_cap()
    assert b.cap == 1 and "a step of 2 sequences" in b.cap_reason


@pytest.mark.parametrize("dump", ["full", "compact"])
def test_prompt_chunks_split_across_steps_are_what_they_are_alone(ratios_model, tmp_path, dump):
    """Steps of few rows (a preset's prefill chunk of 4: 2 decode rows and 4 prompt rows a step):
    prompt chunks of 5 go in parts, a part of one row alone, streamed as a token; every
    sequence's dump is its alone one. A compact dump's prompt rows are kept compact as each
    layer ends alone, and from the batched step's full rows in a batch: the same records."""
    config = tmp_path / "ds4f.toml"
    config.write_text('[engine]\nprobe_floor = false\npreset = "small"\n\n'
                      f'[history]\npath = "{tmp_path / "h.sqlite3"}"\n\n'
                      '[presets.small]\npinned_layers = "all"\ncache = "50%"\ncontext = 256\nprefill_chunk = 4\n')
    prompts = [(3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5), tuple(range(40, 56)), (7, 7, 7, 8, 8, 8)]

    def cfg(i, prompt, name):
        return _config(ratios_model, tmp_path / f"{name}{i}.bin", prompt, 6, BACKENDS[-1], config_path=str(config),
                       preset="small", dump=dump)

    alone = [_done(start_run(cfg(i, p, "alone"))) for i, p in enumerate(prompts)]
    host = EngineHost(parallel=2)
    try:
        first = [start_run(cfg(i, p, "split"), engines=host) for i, p in enumerate(prompts[:2])]
        for run in first:
            _done(run)
        third = _done(start_run(cfg(2, prompts[2], "split"), engines=host))
        for a, b in zip(alone, first + [third]):
            assert b.dump_path.read_bytes() == a.dump_path.read_bytes()
        assert host.batch_figures().rows == 2 + 4
    finally:
        host.close()
