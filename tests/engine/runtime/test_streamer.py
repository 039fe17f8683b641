"""The streamer's arrivals (runtime.streamer) on the tiny checkpoint's real files and the reader's
real threads: the experts already resident are handed out at once, the shared expert while the
misses are read, the misses in the order they land (not routing order), a batch's experts before
the next batch's, each with its own record's bytes; a failed read raises naming the file and the
expert, or is reported and skipped, and its key is not kept. Reads are held and let go
(runtime_helpers.HeldReads), so the order is seen, not timed."""
from __future__ import annotations

import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import Budget, load_config
from ds4f.engine.engine import Engine
from ds4f.engine.model.weights import expert_weights
from ds4f.engine.runtime.streamer import SHARED

from runtime_helpers import WAIT_S, HeldReads, record

L = 2          # a learned layer of the tiny geometry
TOKEN = 7


@pytest.fixture
def engine():
    made = []

    def make(model, preset="server", cache=None):
        p = replace(load_config(None).get_preset(preset), prefetch=False)   # no guesses: only what is asked is read
        if cache is not None:
            p = replace(p, cache=Budget(fraction=cache), cache_limit=None)
        eng = Engine(open_checkpoint(model), p, 4, 1, "scalar")      # an I/O thread for each held read
        held = HeldReads(eng.ckpt)
        eng.reader.checkpoint = held
        made.append((eng, held))
        return eng, held

    yield make
    for eng, held in made:
        for key in list(held._gates):
            held.release(key)
        eng.close()
        eng.ckpt.close()


def _ids(*rows) -> np.ndarray:
    return np.array(rows, np.int32)


def _same_record(ck, e, weights) -> bool:
    want = expert_weights(record(ck, L, e), ck.expert_layout)
    return all(np.array_equal(a, b) for a, b in zip(weights, want))


def test_resident_first_then_the_shared_expert_then_the_misses_as_they_land(engine, tiny_model):
    eng, held = engine(tiny_model)                # every trunk layer pinned: the shared expert is there
    s = eng.streamer
    a, b, c, d = 3, 9, 12, 14
    s.start_chunk([TOKEN])
    warm = [e for batch in s.chunk_arrivals(L, _ids([a])) for e, _ in batch]
    s.finish_chunk_layer(L)
    assert sorted(warm) == sorted([a, SHARED]) and held.reads_of((L, a)) == 1

    held.hold((L, b), (L, c), (L, d))
    s.start_chunk([TOKEN])                        # the same token again: a's read is not repeated
    arrivals = s.chunk_arrivals(L, _ids([b, a, c, d]))
    order = []

    def take():
        batch = next(arrivals)
        for e, w in batch:
            assert e == SHARED or _same_record(eng.ckpt, e, w), e
        order.append([e for e, _ in batch])

    take()                                        # the resident expert, before any read lands
    take()                                        # the shared expert, while b, c and d are read
    for e in (d, b, c):                           # the misses in the order their reads land
        held.release((L, e))
        take()
    with pytest.raises(StopIteration):
        next(arrivals)
    s.finish_chunk_layer(L)
    assert order == [[a], [SHARED], [d], [b], [c]]
    assert held.reads_of((L, a)) == 1             # a hit costs no read


def test_a_batch_is_handed_out_before_the_next_one_whatever_lands_first(engine, tiny_model):
    eng, held = engine(tiny_model, cache=0.15)    # 9 slots: batches of 4 distinct experts
    s = eng.streamer
    assert eng.cache.n_slots // 2 == 4
    first, second = [0, 1, 2, 3], [4, 5, 6, 7]
    held.hold((L, 3))
    s.start_chunk([TOKEN, TOKEN + 1])
    arrivals = s.chunk_arrivals(L, _ids(first, second))   # two rows: eight experts, two batches
    seen = []
    while not {0, 1, 2, SHARED} <= set(seen):
        seen += [e for e, _ in next(arrivals)]
    for e in second:                              # the next batch's reads were started with the first
        assert eng.cache.peek((L, e)).ready.wait(WAIT_S)
    assert not set(second) & set(seen)
    held.release((L, 3))
    rest = [[e for e, _ in batch] for batch in arrivals]
    s.finish_chunk_layer(L)
    assert rest == [[3], second]


def _copy(src, tmp_path):
    dst = tmp_path / "ds4f"
    shutil.copytree(src, dst)
    return dst


def test_a_failed_expert_read_names_the_file_and_the_expert_and_is_not_kept(engine, tiny_model, tmp_path):
    eng, held = engine(_copy(tiny_model, tmp_path))
    s = eng.streamer
    pool, off, _n = eng.ckpt.expert_extents(L, 13)[0]
    saved = open(pool, "rb").read()
    os.truncate(pool, off + 100)                  # records after it are cut off: layer 2's 13 and on

    s.start_chunk([TOKEN])
    with pytest.raises(Ds4fError) as caught:
        for _ in s.chunk_arrivals(L, _ids([1, 13])):
            pass
    msg = str(caught.value)
    assert str(pool) in msg and f"layer {L}, expert 13" in msg and "truncated" in msg
    assert (L, 13) not in eng.cache               # a failed read leaves no expert behind
    s.finish_chunk_layer(L)

    reported = {}
    s.start_chunk([TOKEN])
    got = [e for batch in s.chunk_arrivals(L, _ids([2, 13]), on_error=lambda e, err: reported.setdefault(e, err))
           for e, _ in batch]
    s.finish_chunk_layer(L)
    assert sorted(got) == sorted([2, SHARED]) and list(reported) == [13]
    assert str(pool) in str(reported[13])

    with open(pool, "wb") as f:                   # the file whole again: the expert is read afresh
        f.write(saved)
    s.start_chunk([TOKEN])
    got = {e: w for batch in s.chunk_arrivals(L, _ids([13])) for e, w in batch}
    s.finish_chunk_layer(L)
    assert _same_record(eng.ckpt, 13, got[13]) and held.reads_of((L, 13)) == 3


def test_a_failed_trunk_read_names_the_trunk_file(engine, tiny_model, tmp_path):
    eng, held = engine(_copy(tiny_model, tmp_path), preset="minimal")   # nothing pinned: trunks read ahead
    s = eng.streamer
    trunk = eng.ckpt.trunk_path
    off, _n = eng.ckpt.regions["layer.0"]
    os.truncate(trunk, off + 10)
    s.start_chunk([TOKEN])
    with pytest.raises(Ds4fError) as caught:
        for _ in s.chunk_arrivals(0, _ids([1])):
            pass
    assert str(trunk) in str(caught.value) and "truncated" in str(caught.value)


def test_a_step_of_several_rows_guesses_each_rows_own_top_experts(tiny_model):
    """guess_rows routes the rows in one call: what it starts reading is, row by row, the top
    PREFETCH_RANKS experts of that row's routing, recomputed here in float64 numpy."""
    p = replace(load_config(None).get_preset("server"), prefetch=True)
    eng = Engine(open_checkpoint(tiny_model), p, 4, 1, "scalar")
    try:
        s, g = eng.streamer, eng.ckpt.geometry
        tokens = [5, 11, 17]
        H = np.random.default_rng(3).standard_normal((len(tokens), g.hidden)).astype(np.float32)
        s.start_chunk(tokens)
        s.guess_rows(L, H)
        router = s.routers[L]
        gate = np.asarray(router.gate)
        gate64 = ((gate.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if gate.dtype.itemsize == 2
                  else gate).astype(np.float64)
        want = set()
        for c in range(len(tokens)):
            h = H[c].astype(np.float64)
            x = h / np.sqrt(np.mean(h * h) + g.rms_norm_eps) * router.ffn_norm
            scores = np.sqrt(np.logaddexp(0.0, gate64 @ x))
            top = np.argsort(-(scores + router.bias), kind="stable")[:s.PREFETCH_RANKS]
            want |= {(L, int(e)) for e in top}
        assert {key for key in s._prefetched if key[0] == L} == want     # (the hash layers' come with the step)
        s.finish_chunk_layer(L)
    finally:
        eng.close()
        eng.ckpt.close()
