"""The unpinned trunk layers' read-ahead (runtime.streamer): two buffers, layer i of a pass read into
buffer i % 2 while the layer before computes. A pass that stops part way (a cancel, an error)
leaves its next read-ahead behind; it must never land over a layer a later pass has read into the
same buffer since, or that pass computes a layer's shared expert with another layer's weights."""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.model.forward import Stopped

TOKENS = [3, 17, 42, 99, 5]
LATE_S = 2.0     # how long the left-behind read waits, at most, for its moment to land


def _engine(model):
    # nothing pinned: every layer's trunk is read ahead; no guesses (the read left behind would
    # hold their lane, and the pass would wait for it whatever the read-ahead does)
    preset = replace(load_config(None).get_preset("minimal"), prefetch=False)
    return Engine(open_checkpoint(model), preset, 4, 1, "scalar")


def test_a_stopped_passs_read_ahead_never_lands_over_a_later_pass(tiny_official):
    eng = _engine(tiny_official)
    try:
        assert eng.streamer.unpinned == [0, 1, 2, 3]       # buffer 1 holds layer 1, then layer 3
        ref = eng.new_session()
        want = [ref.step(t).logits.copy() for t in TOKENS]
        reader_ck = eng.reader.checkpoint
        read = reader_ck.read_trunk_layer
        phase = {"stopping": False, "next": False}
        layer3_read, stale_landed = threading.Event(), threading.Event()

        def slow_read(layer, buf):
            if phase["stopping"] and layer == 1:   # the stopped pass's read-ahead: it lands late, once
                phase["stopping"] = False          # the next pass has read layer 3 into the same buffer
                layer3_read.wait(LATE_S)
                out = read(layer, buf)
                stale_landed.set()
                return out
            out = read(layer, buf)
            if phase["next"] and layer == 3:
                layer3_read.set()
                stale_landed.wait(LATE_S)
            return out

        reader_ck.read_trunk_layer = slow_read
        try:
            stopped = eng.new_session(prefill_chunk=4)
            phase["stopping"] = True
            asked = iter(range(100))
            try:
                stopped.prefill(TOKENS[:4], should_stop=lambda: next(asked) >= 1)   # stops before layer 1
                raise AssertionError("the chunk was not stopped")
            except Stopped:
                pass
            phase["next"] = True
            later = eng.new_session(cold=False)        # on the cache as it is: nothing waits for reads
            got = [later.step(t).logits.copy() for t in TOKENS]
        finally:
            reader_ck.read_trunk_layer = read
        for a, b in zip(want, got):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    finally:
        eng.close()
        eng.ckpt.close()
