"""The prefix cache keeps states in blocks (engine.kv_blocks): the states of one conversation share
the blocks of their common prefix in RAM and on disk, a new state writes only its new blocks and a
head, a restart reads states back bit for bit, a damaged or missing block makes its states misses
(logged, removed, never used), eviction removes only the blocks no other state uses, and past the
day's write budget states stay in RAM. Blocks of 16 positions on the CSA (4) / HCA (16) fixture."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.prefix_cache import PrefixCache
from ds4f.engine.session_state import _arrays, save_state, with_attached

TOKENS = tuple((5 * i + 11) % 250 + 2 for i in range(90))
SPAN = 16
AT = (20, 40, 77, 90)


@pytest.fixture(scope="module")
def engine(ratios_model):
    eng = Engine(open_checkpoint(ratios_model), load_config(None).get_preset("laptop"), 2, 1, "scalar")
    yield eng
    eng.close()
    eng.ckpt.close()


@pytest.fixture(scope="module")
def states(engine):
    """One conversation's states at AT positions, each with record-like attachments."""
    session, out = engine.new_session(), {}
    for i, t in enumerate(TOKENS):
        session.eval(t)
        if i + 1 in AT:
            s = session.snapshot()
            out[s.position] = with_attached(s, records=(np.arange(s.position * 8) % 251).astype(np.uint8)
                                            .reshape(s.position, 8))
    return out


def _cache(engine, tmp_path, ram=1 << 30, disk=1 << 30, lines=None, **kw):
    return PrefixCache(engine.fingerprint, engine.geometry.to_config(), ram, tmp_path / "kv", disk,
                       log=lines.append if lines is not None else None, span=SPAN, **kw)


def _same(a, b) -> bool:
    x, y = dict(_arrays(a)), dict(_arrays(b))
    return x.keys() == y.keys() and all(x[k].tobytes() == y[k].tobytes() for k in x) and a.tokens == b.tokens


def _files(tmp_path, pattern):
    return sorted((tmp_path / "kv").rglob(pattern))


def test_the_states_of_a_conversation_share_their_blocks_on_disk_and_in_ram(engine, states, tmp_path):
    cache = _cache(engine, tmp_path)
    cache.keep(states[40])
    first = cache.figures()
    assert len(_files(tmp_path, "*.kvb")) == 40 // SPAN
    cache.keep(states[77])
    second = cache.figures()
    assert len(_files(tmp_path, "*.kvb")) == 77 // SPAN        # the first two blocks are shared, not rewritten
    e40 = next(e for e in cache._disk.values() if tuple(e.tokens) == states[40].tokens)
    block_bytes = {p.name[:-len(".kvb")]: p.stat().st_size for p in _files(tmp_path, "*.kvb")}
    assert second.written_blocks - first.written_blocks == sum(
        size for key, size in block_bytes.items() if key not in e40.keys)
    # what keeping the longer state wrote: its new rows' blocks and one head
    head77 = next(e for e in cache._disk.values() if tuple(e.tokens) == states[77].tokens)
    assert second.written_heads - first.written_heads == head77.file_nbytes
    assert second.written_today == second.written_heads + second.written_blocks
    # RAM holds the shared blocks once, each its own copy (no view keeps a whole state's rows alive)
    assert second.ram_bytes < states[40].nbytes + states[77].nbytes
    held = [a for b in cache._ram_blocks.values() for a in b.arrays.values()]
    held += [c.rows for e in cache._ram.values() for layer in e.head.state.layers
             for c in (layer.compressor, layer.indexer) if c is not None]
    assert held and all(a.base is None or a.base.nbytes == a.nbytes for a in held)
    assert second.disk_bytes == sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*") if p.is_file())
    for n in (40, 77):
        assert _same(cache.lookup(TOKENS[:n] + (3,), "scalar"), states[n])


def test_a_restart_reads_the_states_back_bit_for_bit_and_continues_as_a_cold_session(engine, states, tmp_path):
    cache = _cache(engine, tmp_path)
    for n in (20, 77):
        cache.keep(states[n])
    again = _cache(engine, tmp_path)
    assert again.figures().states == 2 and again.figures().blocks_disk == 77 // SPAN
    got = again.lookup(TOKENS, "scalar", at_most=80)
    assert _same(got, states[77]) and again.stats.hits == 1
    cold = engine.new_session()
    want = [cold.step(t).logits.copy() for t in TOKENS][77:]
    session = engine.fork(got)
    assert all(np.array_equal(session.step(t).logits.view(np.uint8), w.view(np.uint8)) for t, w in zip(TOKENS[77:], want))


@pytest.mark.parametrize("how", ["flip", "truncate", "remove"])
def test_a_damaged_or_missing_block_makes_its_states_misses_never_wrong(engine, states, tmp_path, how):
    cache = _cache(engine, tmp_path)
    for n in (20, 40, 77):
        cache.keep(states[n])
    e40 = next(e for e in cache._disk.values() if tuple(e.tokens) == states[40].tokens)
    victim = tmp_path / "kv" / "blocks" / f"{e40.keys[1]}.kvb"      # block 2: states 40 and 77 hold it, 20 not
    data = bytearray(victim.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif how == "truncate":
        victim.write_bytes(bytes(data[:len(data) // 3]))
    else:
        victim.unlink()
    lines = []
    again = _cache(engine, tmp_path, lines=lines)
    got = again.lookup(TOKENS, "scalar")
    assert got is not None and _same(got, states[20]), "the longest state whose blocks are whole"
    assert again.stats.rejected_files >= 1 and any("removed and not used" in line for line in lines), lines
    assert not victim.exists()
    # a state that needed the block is gone for good: the next cache on the directory never sees it
    third = _cache(engine, tmp_path)
    assert third.lookup(TOKENS, "scalar").position == 20


def test_eviction_removes_only_the_blocks_no_other_state_uses(engine, states, tmp_path):
    probe = _cache(engine, tmp_path / "probe")
    probe.keep(states[90])
    one_conversation = probe.figures().disk_bytes
    cache = _cache(engine, tmp_path, disk=one_conversation + one_conversation // 3)
    cache.keep(states[40])
    cache.keep(states[90])       # shares 2 blocks with 40: both fit
    assert cache.figures().states == 2
    other = states[77]
    forked = [t + 1 for t in other.tokens]      # another conversation: no block in common
    session = engine.new_session()
    for t in forked[:40]:
        session.eval(t)
    cache.keep(session.snapshot())
    f = cache.figures()
    assert f.evictions >= 1 and f.disk_bytes <= one_conversation + one_conversation // 3
    on_disk = {p.name[:-4] for p in _files(tmp_path, "*.kvb")}
    used = {k for e in cache._disk.values() for k in e.keys}
    assert on_disk == used, "no block is left that no state on disk uses"


def test_past_the_days_write_budget_states_stay_in_ram(engine, states, tmp_path):
    lines = []
    probe = _cache(engine, tmp_path / "probe")
    probe.keep(states[40])
    cache = _cache(engine, tmp_path, lines=lines, write_budget=probe.figures().written_today + 1000)
    cache.keep(states[40])
    cache.keep(states[77])
    cache.keep(states[90])
    f = cache.figures()
    assert f.written_today <= f.write_budget and f.states == 3
    assert sum("write budget" in line for line in lines) == 1, lines
    assert _same(cache.lookup(TOKENS, "scalar"), states[90])       # from RAM
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 1


def test_an_older_ds4fs_state_file_is_refused_file_by_file(engine, states, tmp_path):
    (tmp_path / "kv").mkdir()
    old = tmp_path / "kv" / "old.kv"
    save_state(states[20], old)
    data = bytearray(old.read_bytes())
    data[8:12] = (1).to_bytes(4, "little")        # the version of states that carried full records
    old.write_bytes(bytes(data))
    lines = []
    cache = _cache(engine, tmp_path, lines=lines)
    assert cache.lookup(TOKENS, "scalar") is None and not old.exists()
    assert any("version 1" in line and "removed and not used" in line for line in lines), lines


def test_a_cache_evicting_keeps_the_blocks_another_process_uses(engine, states, tmp_path):
    """Two caches (two processes) on one directory: one evicts a state whose blocks a state the other
    kept shares; the blocks stay, and the other's state is still whole on disk."""
    session = engine.new_session()
    for t in TOKENS[:40]:
        session.eval(t + 1)
    another = session.snapshot()             # another conversation: no block in common
    probe = _cache(engine, tmp_path / "probe")
    probe.keep(states[77])
    probe.keep(another)
    room = probe.figures().disk_bytes        # the 77 and the other conversation, not a's first 40 too
    probe40 = _cache(engine, tmp_path / "probe40")
    probe40.keep(states[40])
    a = _cache(engine, tmp_path, disk=room + probe40.figures().disk_bytes // 4)
    b = _cache(engine, tmp_path)
    a.keep(states[40])
    b.keep(states[77])                      # shares the first two blocks with a's state
    a.keep(another)                         # over a's budget, the directory counted whole: a's 40 goes
    assert a.figures().evictions == 1 and a.figures().disk_bytes <= room + probe40.figures().disk_bytes // 4
    fresh = _cache(engine, tmp_path)
    assert _same(fresh.lookup(TOKENS, "scalar", at_most=80), states[77])
    assert fresh.lookup(TOKENS, "scalar", at_most=50) is None and fresh.figures().states == 2   # the 40 went


def test_two_checkpoints_sharing_a_directory_keep_their_blocks_apart(engine, states, tmp_path):
    """The same tokens on two checkpoints: blocks of their own keys, and opening a cache for one
    removes nothing of the other's (the default kv directory serves every model)."""
    import dataclasses

    mine = _cache(engine, tmp_path)
    mine.keep(states[77])
    other_state = dataclasses.replace(states[77], checkpoint="another-checkpoint")
    theirs = PrefixCache("another-checkpoint", engine.geometry.to_config(), 1 << 30, tmp_path / "kv", 1 << 30,
                         span=SPAN)
    theirs.keep(other_state)
    assert len(_files(tmp_path, "*.kvb")) == 2 * (77 // SPAN)
    assert len(list((tmp_path / "kv").glob("*.kv"))) == 2
    again = _cache(engine, tmp_path)                      # opening mine leaves theirs whole
    assert _same(again.lookup(TOKENS, "scalar", at_most=80), states[77])
    back = PrefixCache("another-checkpoint", engine.geometry.to_config(), 1 << 30, tmp_path / "kv", 1 << 30, span=SPAN)
    assert _same(back.lookup(TOKENS, "scalar", at_most=80), other_state)
    assert back.figures().blocks_disk == again.figures().blocks_disk == 77 // SPAN    # each counts its own


def test_runs_that_start_together_share_one_cache_and_its_directory(engine, tmp_path):
    """The first runs of a batch ask for the prefix cache at once: one cache comes of it, and caches
    opened at the same moment on one directory each find it writable (no probe of one is another's)."""
    import threading

    engine.prefix_cache = None
    barrier, got = threading.Barrier(8), []

    def ask():
        barrier.wait()
        got.append(engine.use_prefix_cache(1 << 20, str(tmp_path / "kv"), 1 << 30))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 8 and len({id(c) for c in got}) == 1 and got[0].dir is not None
    engine.prefix_cache = None
    opened = []
    barrier = threading.Barrier(8)

    def open_one():
        barrier.wait()
        opened.append(_cache(engine, tmp_path / "shared"))

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(opened) == 8 and all(c.dir is not None for c in opened)
