"""The prefix cache: the longest kept prefix of a prompt's tokens on its backend, from RAM or from
disk (across a restart), continues byte for byte as a cold session; the bounds hold and the least
valuable state goes first; damaged files are logged, removed and never used; an unwritable
directory leaves the RAM tier working; two caches may share one directory."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.prefix_cache import PrefixCache
from ds4f.native import kernels

PROMPT = (0, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4, 77, 19, 23, 8, 31, 64, 2, 9, 101, 44)


@pytest.fixture(scope="module")
def engine(ratios_model):
    eng = Engine(open_checkpoint(ratios_model), load_config(None).get_preset("laptop"), 2, 2, kernels.best_backend())
    yield eng
    eng.close()
    eng.ckpt.close()


def _state(engine, n):
    s = engine.new_session()
    for t in PROMPT[:n]:
        s.eval(t)
    return s.snapshot()


def _logits_after(session, tokens):
    return [session.step(t).logits.copy() for t in tokens]


def _cache(engine, ram, disk_dir=None, disk=0, lines=None):
    return PrefixCache(engine.fingerprint, engine.geometry.to_config(), ram, disk_dir, disk,
                       log=(lines.append if lines is not None else None))


def test_the_longest_prefix_on_the_same_backend_continues_as_a_cold_session(engine):
    states = {n: _state(engine, n) for n in (5, 9, 13)}
    cache = _cache(engine, ram=1 << 30)
    for st in states.values():
        cache.keep(st)
    assert cache.lookup(PROMPT, engine.backend).position == 13
    assert cache.lookup(PROMPT[:12], engine.backend).position == 9
    assert cache.lookup(PROMPT, engine.backend, at_most=12).position == 9
    assert cache.lookup((1, 2, 3, 4, 5, 6), engine.backend) is None
    assert cache.lookup(PROMPT, "no-such-backend") is None
    assert cache.stats.hits == 3 and cache.stats.misses == 2 and cache.stats.tokens_reused == 13 + 9 + 9
    cold = engine.new_session()
    want = _logits_after(cold, PROMPT)[13:]
    got = _logits_after(engine.fork(cache.lookup(PROMPT, engine.backend)), PROMPT[13:])
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(got, want))


def test_ram_holds_its_bound_and_the_least_valuable_state_goes_first(engine):
    a, b, c = _state(engine, 5), _state(engine, 9), _state(engine, 13)
    assert a.nbytes < b.nbytes < c.nbytes            # the compressed rows grow with the position
    bound = a.nbytes + c.nbytes + 1                  # a and b fit, or a and c; not all three
    cache = _cache(engine, ram=bound)
    cache.keep(a)
    cache.keep(b)
    assert cache.lookup(PROMPT[:6], engine.backend).position == 5    # a: one hit now, more value than b
    cache.keep(c)                                                     # over the bound: b goes
    assert cache.stats.ram_bytes <= bound and cache.stats.evictions == 1
    assert cache.lookup(PROMPT[:10], engine.backend).position == 5   # b is gone, a is there
    assert cache.lookup(PROMPT, engine.backend).position == 13
    tiny = _cache(engine, ram=100)                                    # nothing fits: nothing kept
    tiny.keep(a)
    assert tiny.lookup(PROMPT, engine.backend) is None and tiny.stats.ram_bytes == 0


def test_states_on_disk_survive_a_restart_within_the_budget(engine, tmp_path):
    lines = []
    first = _cache(engine, ram=1 << 30, disk_dir=tmp_path / "kv", disk=1 << 30, lines=lines)
    for n in (7, 13):
        first.keep(_state(engine, n))
    files = sorted((tmp_path / "kv").glob("*.kv"))
    assert len(files) == 2 and not list((tmp_path / "kv").glob("*.partial"))
    again = _cache(engine, ram=1 << 30, disk_dir=tmp_path / "kv", disk=1 << 30, lines=lines)   # a restart
    assert again.stats.disk_bytes == sum(f.stat().st_size for f in files)
    state = again.lookup(PROMPT, engine.backend)
    assert state.position == 13 and again.stats.hits == 1
    cold = engine.new_session()
    want = _logits_after(cold, PROMPT)[13:]
    got = _logits_after(engine.fork(state), PROMPT[13:])
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(got, want))
    # a budget for the larger file alone: the older goes from the disk
    one = max(f.stat().st_size for f in files)
    small = _cache(engine, ram=1 << 30, disk_dir=tmp_path / "one", disk=one + 10)
    small.keep(_state(engine, 7))
    small.keep(_state(engine, 13))
    assert len(list((tmp_path / "one").glob("*.kv"))) == 1 and small.stats.disk_bytes <= one + 10
    assert lines == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_file_is_logged_removed_and_not_used(engine, tmp_path, damage):
    lines = []
    cache = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30)
    cache.keep(_state(engine, 7))
    cache.keep(_state(engine, 13))
    files = {p.stat().st_mtime_ns: p for p in tmp_path.glob("*.kv")}
    newest = files[max(files)]                                        # the 13-token state
    data = newest.read_bytes()
    mid = len(data) // 2
    newest.write_bytes({"truncate": data[:len(data) // 3], "flip": data[:mid] + bytes([data[mid] ^ 4]) + data[mid + 1:],
                        "garbage": b"\x00" * 64}[damage])
    restarted = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30, lines=lines)
    state = restarted.lookup(PROMPT, engine.backend)
    assert state is not None and state.position == 7                  # the damaged one refused, the next used
    assert not newest.exists() and restarted.stats.rejected_files == 1
    assert len(lines) == 1 and str(newest) in lines[0] and "not used" in lines[0]


def test_another_checkpoints_files_are_left_alone(engine, tmp_path):
    cache = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30)
    cache.keep(_state(engine, 7))
    other = PrefixCache("f" * 64, engine.geometry.to_config(), 0, tmp_path, 1 << 30)
    assert other.lookup(PROMPT, engine.backend) is None and len(list(tmp_path.glob("*.kv"))) == 1


def test_an_unwritable_directory_is_logged_and_ram_goes_on(engine, tmp_path):
    (tmp_path / "file").write_text("a file, not a directory")
    lines = []
    cache = _cache(engine, ram=1 << 30, disk_dir=tmp_path / "file" / "kv", disk=1 << 30, lines=lines)
    assert cache.dir is None and len(lines) == 1 and "cannot write there" in lines[0]
    cache.keep(_state(engine, 9))
    assert cache.lookup(PROMPT, engine.backend).position == 9


def test_a_file_put_where_the_directory_was_is_said_once_per_log_and_ram_goes_on(engine, tmp_path):
    """The directory opened, then replaced by a regular file (another program, a mistaken `mv`):
    the next states are kept in RAM, and each log (a run's) is told once, naming the file."""
    kv = tmp_path / "kv"
    first, second = [], []
    cache = _cache(engine, ram=1 << 30, disk_dir=kv, disk=1 << 30, lines=first)
    shutil.rmtree(kv)
    kv.write_text("a file now")
    for n in (5, 9):
        cache.keep(_state(engine, n))
    said = f"prefix cache: {kv}: cannot write there ({kv} is a regular file, not a directory); states kept in RAM only"
    assert first == [said]
    cache.log = second.append               # the next run's log
    cache.keep(_state(engine, 13))
    assert second == [said] and first == [said]
    assert cache.lookup(PROMPT, engine.backend).position == 13 and kv.read_text() == "a file now"


def test_two_caches_share_one_directory(engine, tmp_path):
    lines = []
    a = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30, lines=lines)
    b = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30, lines=lines)
    a.keep(_state(engine, 9))
    c = _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30, lines=lines)   # sees a's file
    for f in tmp_path.glob("*.kv"):
        f.unlink()                                                    # another process evicted it
    assert c.lookup(PROMPT, engine.backend) is None
    assert any("gone" in line for line in lines)
    b.keep(_state(engine, 13))
    assert a.lookup(PROMPT, engine.backend) is None                   # a does not know b's file yet
    assert _cache(engine, ram=0, disk_dir=tmp_path, disk=1 << 30).lookup(PROMPT, engine.backend).position == 13


def test_a_full_disk_while_saving_is_logged_and_leaves_no_file(engine, tmp_path):
    """The directory on a filesystem too small for a state: the save fails (ENOSPC), is logged,
    leaves no partial file, and RAM keeps the state."""
    import os
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("needs root and mount to make a small filesystem")
    try:
        lines = []
        cache = _cache(engine, ram=1 << 30, disk_dir=small, disk=1 << 30, lines=lines)
        state = _state(engine, 13)
        assert state.nbytes > 16 << 10
        cache.keep(state)
        assert any("not saved" in line and "cannot save" in line for line in lines), lines
        assert [p for p in small.rglob("*") if p.is_file() and p.name != ".lock"] == [] and cache.stats.disk_bytes == 0
        assert cache.lookup(PROMPT, engine.backend).position == 13
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_the_index_of_kept_states_is_compact_and_in_the_engines_resident_bytes(engine, tmp_path):
    """Every kept state leaves an entry in RAM, on disk alone too: its token ids as 4-byte ints (a
    30,000-token prompt as Python ints would be ~1.1 MB an entry), counted in what the engine says
    it holds, so a server keeping states request after request stays within its own figures."""
    first = _cache(engine, ram=1 << 30, disk_dir=tmp_path / "kv", disk=1 << 30)
    for n in (7, 13, 23):
        first.keep(_state(engine, n))
    again = _cache(engine, ram=0, disk_dir=tmp_path / "kv", disk=1 << 30)     # a restart: on disk alone
    entries = list(again._disk.values())
    assert sorted(len(e.tokens) for e in entries) == [7, 13, 23]
    assert all(e.tokens.itemsize == 4 for e in entries)
    assert again.index_nbytes >= 4 * (7 + 13 + 23)
    before, kept = engine.prefix_cache, engine.figures().resident_bytes
    try:
        engine.prefix_cache = None
        bare = engine.figures().resident_bytes
        engine.prefix_cache = again
        assert engine.figures().resident_bytes - bare == again.ram_bytes + again.index_nbytes
    finally:
        engine.prefix_cache = before
    assert engine.figures().resident_bytes == kept
