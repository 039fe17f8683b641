"""A done run's disk replay (its I/O efficiency, runs.report.replay_last_reads) reads the run's last
reads again into buffers the idle engine lends (Engine.read_scratch): expert cache slots taken out
of the cache, and the trunk read-ahead buffers. The experts a kept engine's cache serves are then
still what their keys say, so the next run on it (a server's next request, on the warm cache)
writes the state dump a fresh engine writes."""
from __future__ import annotations

import numpy as np

from ds4f.engine.checkpoint.base import aligned_buffer
from ds4f.runs.config import RunConfig
from ds4f.runs.host import EngineHost
from ds4f.runs.run import start_run

FIRST = [3, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4]
NEXT = [3, 17, 42, 8, 8, 31, 64, 2, 9]


def _run(model, tmp_path, tag: str, prompt, engines=None, **fields):
    fields = {"probe_floor": False, **fields}
    run = start_run(RunConfig(model=str(model), prompt=prompt, gen=12, preset="laptop", kernel_threads=1, io_threads=4,
                              dump_path=str(tmp_path / f"{tag}.bin"), **fields), engines=engines)
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


def _slots_not_their_experts(eng) -> list:
    """The cache slots whose bytes are not a fresh read of the expert their key names."""
    fresh = aligned_buffer(eng.ckpt.slot_nbytes)
    bad = []
    for slot in eng.cache.slots:
        if slot.key is None or not slot.ready.is_set():
            continue
        eng.ckpt.read_expert(*slot.key, fresh)
        if not np.array_equal(fresh, eng.cache.pool[slot.index]):
            bad.append(slot.key)
    return bad


def test_the_disk_replay_leaves_the_kept_engines_experts_their_own(tiny_model, tmp_path):
    cold = _run(tiny_model, tmp_path, "cold", NEXT)           # a fresh engine of its own
    host = EngineHost()
    try:
        first = _run(tiny_model, tmp_path, "first", FIRST, engines=host, probe_floor=True)
        assert first.report["summary"]["disk_replay"]["reads"] > 0     # it replayed into the engine's buffers
        eng = host._engine
        assert eng.cache.resident > 0 and _slots_not_their_experts(eng) == []
        warm = _run(tiny_model, tmp_path, "warm", NEXT, engines=host)
        assert warm.report["cache"]["start"] == "warm"
        assert warm.report["state_sha256"] == cold.report["state_sha256"]
    finally:
        host.close()


def test_the_engine_lends_read_buffers_only_while_no_other_session_steps(tiny_model):
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine
    from ds4f.engine.checkpoint import open_checkpoint

    eng = Engine(open_checkpoint(tiny_model), load_config(None).get_preset("laptop"), 2, 1, "scalar")
    try:
        mine, other = eng.new_session(), eng.new_session()
        batcher = eng.use_batcher(2, 4)
        mine.join(batcher)
        with eng.read_scratch(2, mine) as lent:          # the caller's own session alone: lent
            assert lent is not None and len(lent[0]) == 2
            assert sum(s.key is None for s in eng.cache.slots) >= 2
        other.join(batcher)
        with eng.read_scratch(2, mine) as lent:          # another session steps: nothing lent
            assert lent is None
        other.leave()
        mine.leave()
    finally:
        eng.close()
        eng.ckpt.close()
