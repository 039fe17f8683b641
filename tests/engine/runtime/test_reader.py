"""The reader (runtime.reader) on its own, on the tiny checkpoints' real files with its real I/O
threads: what it coalesces (a key in flight, a read queued twice, an official expert's adjacent
tensors), its prefetch lane (a guess starts only while the disk is idle; one never started costs
no read; a promoted one is read at once), and failed reads (the error names the file; the threads
go on). Reads are held and let go (runtime_helpers.HeldReads), so order is seen, not timed."""
from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.tensors import layer_prefix
from ds4f.engine.runtime.expert_cache import ExpertCache
from ds4f.engine.runtime.reader import DEMAND, PREFETCH, Reader

from runtime_helpers import QUIET_S, WAIT_S, HeldReads, record

L = 2    # a learned layer of the tiny geometry (layer 0 is its hash layer)


class Rig:
    """A checkpoint, its held reads, a cache to read into and a reader of n threads."""

    def __init__(self, path, threads: int) -> None:
        self.ck = open_checkpoint(path)
        self.held = HeldReads(self.ck)
        g = self.ck.geometry
        self.cache = ExpertCache(16 * self.ck.slot_nbytes, self.ck.slot_nbytes, g.n_layers, n_experts=g.n_experts)
        self.reader = Reader(self.held, threads)
        self.landed = threading.Event()
        self.protected: set = set()

    def read(self, key, priority=DEMAND):
        [(slot, hit)] = self.cache.request([key], self.protected)
        assert not hit
        job = self.reader.read_expert(slot, key[0], key[1], self.cache.pool[slot.index], self.landed, priority)
        return slot, job

    def bytes_of(self, slot) -> np.ndarray:
        return self.cache.pool[slot.index][:self.ck.expert_nbytes]

    def close(self) -> None:
        self.reader.close()      # queued reads finish first
        self.cache.close()
        self.ck.close()


@pytest.fixture
def rig(request, tiny_model):
    made = []

    def make(threads: int, path=tiny_model) -> Rig:
        made.append(Rig(path, threads))
        return made[-1]

    yield make
    for r in made:
        for key in list(r.held._gates):
            r.held.release(key)      # a failed test never leaves a thread held
        r.close()


# -- coalescing ---------------------------------------------------------------------------------------
def test_a_second_request_for_an_expert_in_flight_shares_its_slot_and_its_read(rig):
    r = rig(2)
    key = (L, 3)
    r.held.hold(key)
    slot, _job = r.read(key)
    assert r.held.started(key)
    [(again, hit)] = r.cache.request([key], r.protected)      # another row asks while it is read
    assert hit and again is slot and not slot.ready.is_set()
    r.held.release(key)
    assert slot.ready.wait(WAIT_S) and slot.error is None
    r.reader.close()
    assert r.held.reads_of(key) == 1
    assert np.array_equal(r.bytes_of(slot), record(r.ck, *key))


def test_a_read_queued_more_than_once_reads_once(rig):
    r = rig(1)
    first, wanted = (L, 0), (L, 5)
    r.held.hold(first)
    r.read(first)
    assert r.held.started(first)              # the only I/O thread is busy: what follows waits in the queue
    slot, job = r.read(wanted)
    r.reader.promote(job)                     # queued twice more, as demand reads
    r.reader.promote(job)
    r.held.release(first)
    assert slot.ready.wait(WAIT_S) and slot.error is None
    r.reader.close()                          # every queued copy has been taken
    assert r.held.reads_of(wanted) == 1 and r.reader.started_reads == 2
    assert np.array_equal(r.bytes_of(slot), record(r.ck, *wanted))


def test_an_official_experts_adjacent_tensors_are_read_together_and_land_in_place(rig, tiny_official):
    r = rig(2, tiny_official)
    key = (L, 7)
    extents = r.ck.expert_extents(*key)
    assert len(extents) < len(r.ck.expert_layout)             # six tensors, fewer reads
    slot, _ = r.read(key)
    assert slot.ready.wait(WAIT_S) and slot.error is None
    got = r.cache.pool[slot.index]
    for name, (offset, shape) in r.ck.expert_layout.items():   # each tensor read alone, from its shard
        t = r.ck.tensors[layer_prefix(r.ck.geometry, L) + f"ffn.experts.{key[1]}.{name}"]
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            want = np.frombuffer(f.read(t.nbytes), np.uint8)
        assert np.array_equal(got[offset:offset + t.nbytes], want), name


# -- the prefetch lane --------------------------------------------------------------------------------
def test_a_guess_starts_only_once_the_demand_read_has_ended(rig):
    r = rig(2)                                 # a free I/O thread: only the lane holds the guess back
    demand, guess = (L, 1), (L, 2)
    r.held.hold(demand)
    r.read(demand)
    assert r.held.started(demand)
    slot, _ = r.read(guess, PREFETCH)
    assert not r.held.started(guess, QUIET_S), "a guess started while the disk was busy"
    r.held.release(demand)
    assert slot.ready.wait(WAIT_S) and slot.error is None
    assert r.held.index("end", demand) < r.held.index("start", guess)
    assert np.array_equal(r.bytes_of(slot), record(r.ck, *guess))


def test_a_guess_waits_for_the_demand_reads_queued_before_it(rig):
    r = rig(0)                                 # no I/O thread yet: the demand read waits in the queue
    demand, guess = (L, 2), (L, 3)
    r.read(demand)
    slot, _ = r.read(guess, PREFETCH)
    assert not r.held.started(guess, QUIET_S), "a guess started with a demand read still queued"
    r.reader.resize(1)                         # a worker takes the demand read; the guess comes after
    assert slot.ready.wait(WAIT_S) and slot.error is None
    assert r.held.index("end", demand) < r.held.index("start", guess), r.held.log


def test_a_guess_waits_while_a_worker_holds_a_read_it_has_not_begun(rig):
    # between a worker taking a read from the queue and the read beginning, the queue is empty and
    # nothing is in flight: the lane must still see the disk busy
    r = rig(0)
    taken, let_go = threading.Event(), threading.Event()
    queue_get = r.reader._queue.get

    def get_then_pause(*a, **k):
        item = queue_get(*a, **k)
        if item[2] is not None and item[2].layer == L and getattr(item[2], "expert", None) == 5:
            taken.set()
            let_go.wait(WAIT_S)
        return item

    r.reader._queue.get = get_then_pause
    r.reader.resize(1)
    demand, guess = (L, 5), (L, 8)
    r.read(demand)
    assert taken.wait(WAIT_S)
    slot, _ = r.read(guess, PREFETCH)
    assert not r.held.started(guess, QUIET_S), "a guess started while a worker held a demand read"
    let_go.set()
    assert slot.ready.wait(WAIT_S) and slot.error is None
    assert r.held.index("end", demand) < r.held.index("start", guess), r.held.log


def test_a_guess_never_started_costs_no_read(rig):
    r = rig(2)
    demand, guess = (L, 1), (L, 4)
    r.held.hold(demand)
    r.read(demand)
    assert r.held.started(demand)
    _, job = r.read(guess, PREFETCH)
    assert job.cancel()                        # the router chose otherwise before the lane took it
    r.held.release(demand)
    r.reader.close()
    assert r.held.reads_of(guess) == 0 and r.held.reads_of(demand) == 1


def test_a_promoted_guess_is_read_at_once_even_on_a_busy_disk(rig):
    r = rig(2)
    demand, guess = (L, 1), (L, 6)
    r.held.hold(demand)
    r.read(demand)
    assert r.held.started(demand)
    slot, job = r.read(guess, PREFETCH)
    r.reader.promote(job)                      # the forward pass needs it now: a demand read
    assert slot.ready.wait(WAIT_S) and slot.error is None
    assert r.held.index("start", guess) < len(r.held.log) and ("end", demand) not in r.held.log
    r.held.release(demand)
    r.reader.close()                           # the lane never reads it a second time
    assert r.held.reads_of(guess) == 1
    assert np.array_equal(r.bytes_of(slot), record(r.ck, *guess))


# -- failed reads -------------------------------------------------------------------------------------
def _copy(src, tmp_path):
    dst = tmp_path / "ds4f"
    shutil.copytree(src, dst)
    return dst


def test_a_read_past_a_truncated_pool_names_the_file_and_the_threads_go_on(rig, tiny_model, tmp_path):
    root = _copy(tiny_model, tmp_path)
    r = rig(2, root)
    pool, off, _n = r.ck.expert_extents(L, 9)[0]
    os.truncate(pool, off + 100)               # after the checkpoint was opened: the read itself fails
    slot, _ = r.read((L, 9))
    assert slot.ready.wait(WAIT_S)
    err = slot.error
    assert isinstance(err, Ds4fError) and str(pool) in str(err) and "truncated" in str(err)
    assert f"layer {L}, expert 9" in str(err)
    ok, _ = r.read((0, 1))                     # an earlier record: the I/O threads still read
    assert ok.ready.wait(WAIT_S) and ok.error is None
    assert np.array_equal(r.bytes_of(ok), record(r.ck, 0, 1))


def test_a_corrupt_record_names_the_file_and_the_record(rig, tiny_model, tmp_path):
    root = _copy(tiny_model, tmp_path)
    r = rig(2, root)
    pool, off, _n = r.ck.expert_extents(L, 11)[0]
    with open(pool, "r+b") as f:
        f.seek(off + 17)
        b = f.read(1)
        f.seek(off + 17)
        f.write(bytes([b[0] ^ 0x40]))
    slot, _ = r.read((L, 11))
    assert slot.ready.wait(WAIT_S)
    assert isinstance(slot.error, Ds4fError)
    msg = str(slot.error)
    assert str(pool) in msg and "corrupt" in msg and f"layer {L}, expert 11" in msg and "ds4f verify" in msg


def test_a_failed_trunk_read_names_the_trunk_file(rig, tiny_model, tmp_path):
    root = _copy(tiny_model, tmp_path)
    r = rig(1, root)
    trunk = r.ck.trunk_path
    off, _n = r.ck.regions[f"layer.{L}"]
    os.truncate(trunk, off + 10)
    buf = np.zeros(r.ck.trunk_layer_buf_nbytes + 4096, np.uint8)
    job = r.reader.read_trunk_layer(L, buf, r.landed)
    assert r.landed.wait(WAIT_S) and job.done()
    with pytest.raises(Ds4fError) as caught:
        job.result()
    assert str(trunk) in str(caught.value)
    later = r.reader.read_trunk_layer(0, buf, r.landed)   # layer 0 lies before the cut
    assert later.future.exception(WAIT_S) is None and set(later.result())
