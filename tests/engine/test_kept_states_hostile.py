"""Kept states against what a hostile or careless hand leaves in the kv directory, and against the
checkpoint changing under them: a byte changed in place in a large shard (size and mtime put back)
makes its states unused; a FIFO named like a state never blocks a process; a header with a field
missing or of the wrong type, a header length past the file, an array of the wrong dtype, shape or
offset, a NaN in a window: each is logged once naming the file, removed, and the prompt computed;
a writer killed mid-write leaves a .partial the next cache removes (never a live writer's); two
processes on one directory stay within its budget together, the least recently used first out;
two checkpoints' states of the same tokens live side by side."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.fingerprint import KEPT_BYTES, checkpoint_fingerprint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.prefix_cache import PrefixCache, directory_usage, kept_tokens_on_disk
from ds4f.engine.session_state import MAX_HEADER_BYTES, read_header
from ds4f.errors import Ds4fError

PROMPT = (0, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4, 77, 19, 23, 8, 31, 64, 2, 9, 101, 44)


def _engine(path):
    return Engine(open_checkpoint(path), load_config(None).get_preset("laptop"), 2, 1, "scalar")


@pytest.fixture(scope="module")
def engine(ratios_model):
    eng = _engine(ratios_model)
    yield eng
    eng.close()
    eng.ckpt.close()


def _state(engine, n, tokens=PROMPT):
    s = engine.new_session()
    for t in tokens[:n]:
        s.eval(t)
    return s.snapshot()


def _cache(engine, directory, lines=None, disk=1 << 30, ram=0, fingerprint=None):
    return PrefixCache(fingerprint or engine.fingerprint, engine.geometry.to_config(), ram, directory, disk,
                       log=lines.append if lines is not None else None)


def _child(script: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """A real Python process running `script` with ds4f importable; killed past `timeout`."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def _rewrite(path: Path, header=None, payload=None) -> None:
    """A state file's header and payload edited, then written back as a whole, well-formed container
    (header length and sha256 made to match): what only a deliberate hand, or a bug, leaves."""
    data = path.read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", data)
    head = json.loads(data[16:16 + hlen])
    body = bytearray(data[16 + hlen:-32])
    if header is not None:
        header(head)
    if payload is not None:
        payload(head, body)
    raw = json.dumps(head, separators=(",", ":")).encode()
    out = struct.pack("<8sII", magic, version, len(raw)) + raw + bytes(body)
    path.write_bytes(out + hashlib.sha256(out).digest())


def _array(head: dict, name: str) -> dict:
    return next(e for e in head["arrays"] if e["name"] == name)


# ---- the checkpoint changed in place ------------------------------------------------------------------
def test_a_byte_changed_in_place_in_a_large_shard_makes_its_kept_states_unused(tmp_path):
    """An official checkpoint whose one shard is larger than the old sampling's whole-file bound; a
    byte a quarter of the way in (outside the start, middle and end slices the fingerprint used to
    read) changed in place, the size kept and the mtime put back: the fingerprint changes, so the
    state kept before is not used; the sums of large files are kept for the next process, under
    the file's identity (a file written in place has a new ctime)."""
    from ds4f.engine.checkpoint.synth import synth_checkpoint
    from ds4f.engine.model.geometry import GEOMETRIES

    ck = synth_checkpoint(tmp_path / "official", GEOMETRIES["tiny"].replace(n_experts=96), seed=0)
    shard = max(ck.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    assert size > KEPT_BYTES
    store = Path(os.environ["XDG_CACHE_HOME"]) / "ds4f" / "fingerprints.json"
    eng = _engine(ck)
    try:
        lines = []
        before = checkpoint_fingerprint(ck, log=lines.append)
        assert eng.fingerprint == before
        assert lines and "reading" in lines[0] and str(store) in lines[0]
        cache = _cache(eng, tmp_path / "kv")
        cache.keep(_state(eng, 9))
        assert _cache(eng, tmp_path / "kv").lookup(PROMPT, eng.backend).position == 9
    finally:
        eng.close()
        eng.ckpt.close()
    # a process started now takes the kept sum (no read): shown by a kept sum made different
    kept = json.loads(store.read_text())
    entry = kept[str(shard.resolve())]
    assert entry["identity"][2] == size
    entry["sha256"] = "0" * 64
    store.write_text(json.dumps(kept))
    again = _child(f"""
        from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
        print(checkpoint_fingerprint({str(ck)!r}))""")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() != before               # the (altered) kept sum was used, not a read
    entry["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    store.write_text(json.dumps(kept))
    assert _child(f"""
        from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
        print(checkpoint_fingerprint({str(ck)!r}))""").stdout.strip() == before
    # the change in place
    st = shard.stat()
    at = size // 4
    old_slices = [(0, 1 << 20), ((size - (1 << 20)) // 2, (size + (1 << 20)) // 2), (size - (1 << 20), size)]
    assert not any(lo <= at < hi for lo, hi in old_slices)
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    changed = _engine(ck)
    try:
        assert changed.fingerprint != before
        lines = []
        after = _cache(changed, tmp_path / "kv", lines)
        assert after.lookup(PROMPT, changed.backend) is None       # the state of the old bytes is not used
        assert len(list((tmp_path / "kv").glob("*.kv"))) == 1       # left for the checkpoint it belongs to
    finally:
        changed.close()
        changed.ckpt.close()
    # and a fresh process agrees (its kept sum is of the old identity: read again)
    fresh = _child(f"""
        from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
        print(checkpoint_fingerprint({str(ck)!r}))""")
    assert fresh.stdout.strip() not in ("", before)


def test_the_ds4f_layouts_data_files_count_through_their_crc32s(ratios_model, tmp_path):
    """The ds4f layout's pool and trunk are not read for the fingerprint: their every record's and
    region's crc32 is in its JSON files (hashed whole), and a byte changed in the pool is refused
    when read."""
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(ratios_model, copy)
    base = checkpoint_fingerprint(copy)
    assert checkpoint_fingerprint(ratios_model) == base                  # a copy keeps it
    pool = json.loads((copy / "pool-mxfp4.json").read_text())
    pool["note"] = "changed"
    (copy / "pool-mxfp4.json").write_text(json.dumps(pool))
    assert checkpoint_fingerprint(copy) != base


# ---- what the directory holds ------------------------------------------------------------------------
def test_a_fifo_named_like_a_state_never_blocks_a_process(engine, tmp_path):
    """A FIFO `x.kv` (and one under a block's name) in the directory: a real process opening a cache
    there, looking up and keeping, finishes (a FIFO is never opened), says it once, leaves it."""
    kv = tmp_path / "kv"
    _cache(engine, kv).keep(_state(engine, 13))
    fifo = kv / "zz-not-a-state.kv"
    os.mkfifo(fifo)
    os.mkfifo(kv / "blocks" / ("ab" * 32 + ".kvb"))
    assert kept_tokens_on_disk(kv, engine.fingerprint, engine.geometry.to_config()) == [PROMPT[:13]]
    with pytest.raises(Ds4fError, match="a FIFO"):
        read_header(fifo)
    geometry = json.dumps(engine.geometry.to_config())
    done = _child(f"""
        import json
        from ds4f.engine.prefix_cache import PrefixCache
        lines = []
        cache = PrefixCache({engine.fingerprint!r}, json.loads({geometry!r}), 0, {str(kv)!r}, 1 << 30, log=lines.append)
        state = cache.lookup({PROMPT!r}, "scalar")
        print(state.position)
        print("\\n".join(lines))""", timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "13"
    said = [line for line in out[1:] if str(fifo) in line]
    assert len(said) == 1 and "a FIFO" in said[0] and "left alone" in said[0]
    assert fifo.is_fifo()


def _header_cases():
    def drop(key):
        return lambda h: h.pop(key)

    def put(key, value):
        return lambda h: h.__setitem__(key, value)

    def entry(name, key, value):
        return lambda h: _array(h, name).__setitem__(key, value)

    return {
        "no checkpoint": (drop("checkpoint"), "'checkpoint'"),
        "checkpoint a number": (put("checkpoint", 12), "'checkpoint'"),
        "no tokens": (drop("tokens"), "'tokens'"),
        "tokens a string": (put("tokens", "0,17,42"), "'tokens'"),
        "a token negative": (lambda h: h["tokens"].__setitem__(0, -1), "'tokens'"),
        "no layers": (drop("layers"), "'layers'"),
        "a layer's tokens a string": (lambda h: h["layers"][0].__setitem__("tokens", "13"), "'layers'"),
        "no geometry": (drop("geometry"), "'geometry'"),
        "backend a list": (put("backend", ["scalar"]), "'backend'"),
        "blocks not keys": (put("blocks", [1, 2]), "'blocks'"),
        "an object dtype": (entry("0.window", "dtype", "|O"), "dtype"),
        "an offset past the payload": (entry("logits", "offset", 1 << 40), "offset"),
        "a negative shape": (entry("0.window", "shape", [-5, 32]), "shape"),
        "arrays overlapping": (lambda h: h["arrays"][2].__setitem__("offset", h["arrays"][1]["offset"]), "offset"),
        # the same bytes described as float64: a header that holds together, refused when read
        "a window of float64": (lambda h: (_array(h, "0.window").__setitem__("dtype", "<f8"),
                                           _array(h, "0.window").__setitem__("shape", [5, 16])), "float64"),
    }


WHEN_READ = {"a window of float64"}      # the cases only the whole file's read refuses


@pytest.mark.parametrize("case", list(_header_cases()))
def test_a_header_field_missing_or_of_the_wrong_type_is_a_damaged_state_logged_once_and_removed(engine, tmp_path,
                                                                                                case):
    edit, says = _header_cases()[case]
    kv = tmp_path / "kv"
    first = _cache(engine, kv)
    first.keep(_state(engine, 7))
    first.keep(_state(engine, 13))
    victim = max(kv.glob("*.kv"), key=lambda p: p.stat().st_size)    # the 13-token state
    _rewrite(victim, header=edit)
    listed = kept_tokens_on_disk(kv, engine.fingerprint, engine.geometry.to_config())
    assert listed == ([PROMPT[:13], PROMPT[:7]] if case in WHEN_READ else [PROMPT[:7]])
    lines = []
    cache = _cache(engine, kv, lines)
    got = cache.lookup(PROMPT, engine.backend)
    assert got is not None and got.position == 7                          # the prompt's rest is computed
    named = [line for line in lines if str(victim) in line]
    assert len(named) == 1 and says in named[0] and "removed and not used" in named[0], lines
    assert not victim.exists()
    again = []
    _cache(engine, kv, again).lookup(PROMPT, engine.backend)
    assert again == []                                                     # said once: it is gone


def test_a_header_length_past_the_file_is_refused_before_it_is_read(engine, tmp_path):
    """A 1 GiB header length in a small file, and in a sparse file large enough for it: both
    refused from the first 16 bytes, logged and removed; a fresh process opening the directory
    peaks far below the 1 GiB it names (VmHWM)."""
    kv = tmp_path / "kv"
    kv.mkdir()
    small = kv / "small.kv"
    small.write_bytes(b"DS4FKVST" + struct.pack("<II", 2, 1 << 30) + b"{}" + bytes(64))
    sparse = kv / "sparse.kv"
    with open(sparse, "wb") as f:
        f.write(b"DS4FKVST" + struct.pack("<II", 2, 1 << 30))
        f.truncate((1 << 30) + (256 << 20))
    for path in (small, sparse):
        with pytest.raises(Ds4fError, match="header length") as e:
            read_header(path)
        assert str(path) in str(e.value)
    geometry = json.dumps(engine.geometry.to_config())
    done = _child(f"""
        import json
        from ds4f.engine.prefix_cache import PrefixCache
        lines = []
        PrefixCache({engine.fingerprint!r}, json.loads({geometry!r}), 0, {str(kv)!r}, 1 << 40, log=lines.append)
        print(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
        print("\\n".join(lines))""")
    assert done.returncode == 0, done.stderr
    rss_kib, *lines = done.stdout.splitlines()
    assert int(rss_kib) < MAX_HEADER_BYTES * 4 // 1024, rss_kib           # far below the 1 GiB it names
    assert sum(str(small) in line for line in lines) == 1 and sum(str(sparse) in line for line in lines) == 1
    assert not small.exists() and not sparse.exists()


def test_a_nan_window_is_the_states_fault_dropped_and_the_prompt_computed(engine, tmp_path):
    """A kept state whose window holds a NaN (the file otherwise whole: its sha256 matches): refused
    when read, removed, logged naming the file and the array; the next longest is used, and a run
    from it continues as a cold session. A state with a NaN is never kept in the first place."""
    kv = tmp_path / "kv"
    first = _cache(engine, kv)
    first.keep(_state(engine, 7))
    first.keep(_state(engine, 13))
    victim = max(kv.glob("*.kv"), key=lambda p: p.stat().st_size)

    def poison(head, body):
        e = _array(head, "2.window")
        np.frombuffer(body, np.float32, 1, e["offset"] + 4 * 7)[0] = np.nan

    _rewrite(victim, payload=poison)
    lines = []
    cache = _cache(engine, kv, lines, ram=1 << 30)
    got = cache.lookup(PROMPT, engine.backend)
    assert got.position == 7 and not victim.exists()
    assert len(lines) == 1 and str(victim) in lines[0] and "2.window" in lines[0] and "NaN" in lines[0]
    cold = engine.new_session()
    want = [cold.step(t).logits.copy() for t in PROMPT][7:]
    session = engine.fork(got)
    assert all(np.array_equal(session.step(t).logits, w) for t, w in zip(PROMPT[7:], want))
    bad = _state(engine, 13)
    window = bad.layers[1].window.copy()
    window[0, 0] = np.inf
    bad = dataclasses.replace(bad, layers=(bad.layers[0], dataclasses.replace(bad.layers[1], window=window),
                                           *bad.layers[2:]))
    with pytest.raises(Ds4fError, match="1.window holds NaN or infinite"):
        cache.keep(bad)
    assert cache.lookup(PROMPT, engine.backend).position == 7 and not any(kv.glob(victim.name))


def test_a_state_the_model_refuses_is_dropped_from_ram_and_disk(engine, tmp_path):
    """A state whose arrays are whole but do not fit the model (its rows one short: written by a
    hand, checked when joined) and one the session refuses afterwards (discard): both gone from
    RAM and disk, logged naming the file."""
    kv = tmp_path / "kv"
    cache = _cache(engine, kv, ram=1 << 30)
    cache.keep(_state(engine, 13))
    victim = next(kv.glob("*.kv"))

    def short(head, body):
        e = _array(head, "1.compressor.rows")
        e["shape"][0] -= 1
        size = 4 * e["shape"][1]
        at = e["offset"] + 4 * e["shape"][0] * e["shape"][1]
        del body[at:at + size]
        for later in head["arrays"][head["arrays"].index(e) + 1:]:
            later["offset"] -= size
        head["payload_nbytes"] -= size

    _rewrite(victim, payload=short)
    lines = []
    assert _cache(engine, kv, lines).lookup(PROMPT, engine.backend) is None
    assert not victim.exists() and len(lines) == 1 and "compressed rows" in lines[0] and str(victim) in lines[0]
    lines = []
    cache = _cache(engine, kv, lines, ram=1 << 30)
    cache.keep(_state(engine, 13))
    path = next(kv.glob("*.kv"))
    assert cache.lookup(PROMPT, engine.backend).position == 13
    cache.discard(PROMPT[:13], engine.backend, "layer 1 window of shape [4, 32], the model's is [5, 32]")
    assert not path.exists() and cache.lookup(PROMPT, engine.backend) is None
    assert any(str(path) in line and "cannot be used" in line for line in lines), lines


# ---- writers killed, processes sharing the directory ---------------------------------------------------
def test_a_writer_killed_mid_write_leaves_a_partial_the_next_cache_removes(engine, tmp_path):
    """A real process writing a kept state, held inside its write (its fsync made to wait): the
    next cache leaves its .partial (a live writer holds its lock); killed with SIGKILL, the
    .partial stays behind, and the next cache removes it. A stale .partial nobody holds (an old
    writer's) goes too."""
    kv = tmp_path / "kv"
    _cache(engine, kv)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time, json
        import numpy as np
        from ds4f.engine import session_state
        real = os.fsync
        def stall(fd):
            print("writing", flush=True)
            time.sleep(600)
        os.fsync = stall
        session_state.write_arrays({str(kv / "x.kv")!r}, session_state.MAGIC, {{"format": "ds4f.session"}},
                                   [("a", np.zeros(1 << 20, np.float32))])
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        partial = next(kv.glob("*.partial"))
        lines = []
        _cache(engine, kv, lines)
        assert partial.exists() and lines == []                        # a live writer's: left
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(60)
    assert partial.exists()
    (kv / "blocks" / "old.kvb.1.2.partial").write_bytes(b"an old writer's bytes")
    lines = []
    _cache(engine, kv, lines)
    assert not partial.exists() and not (kv / "blocks" / "old.kvb.1.2.partial").exists()
    assert any("unfinished files" in line for line in lines), lines


_KEEPER = """
    import sys
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine
    from ds4f.engine.prefix_cache import PrefixCache
    model, kv, budget, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    eng = Engine(open_checkpoint(model), load_config(None).get_preset("laptop"), 2, 1, "scalar")
    cache = PrefixCache(eng.fingerprint, eng.geometry.to_config(), 0, kv, budget)
    for k in range(4):
        s = eng.new_session()
        for t in range(24):
            s.eval((first + 7 * k + t) % 250 + 2)
        cache.keep(s.snapshot())
    print(cache.figures().disk_bytes)
"""


def test_two_processes_on_one_directory_stay_within_its_budget_together(engine, ratios_model, tmp_path):
    """Two real processes, each keeping four states of its own in one directory with a budget for
    about three: together they hold at most the budget (each counts the directory, not its own
    files), the least recently used first out, the newest of each kept."""
    probe = _cache(engine, tmp_path / "probe")
    probe.keep(_state(engine, 24, tuple(range(2, 30))))
    one = probe.figures().disk_bytes
    budget = 3 * one + one // 2
    kv = tmp_path / "kv"
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KEEPER), str(ratios_model), str(kv), str(budget),
                               str(first)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for first in (0, 100)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    used = directory_usage(kv)
    assert used <= budget and len(list(kv.glob("*.kv"))) == 3
    # least recently used first out: of each process's four (in the order it wrote them) what is
    # left is its last ones, and the newest file is a process's last state
    left = {read_header(p)["tokens"][0] for p in kv.glob("*.kv")}
    for first in (0, 100):
        mine = [k for k in range(4) if (first + 7 * k) % 250 + 2 in left]
        assert mine == list(range(4 - len(mine), 4)), (first, sorted(left))
    newest = max(kv.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    assert read_header(newest)["tokens"][0] in (2 + 21, 102 + 21)


def test_a_lookup_makes_a_state_the_most_recently_used(engine, tmp_path):
    """Oldest first out counts use, not only writing: a state read by a lookup outlives one written
    after it."""
    probe = _cache(engine, tmp_path / "probe")
    probe.keep(_state(engine, 13))
    one = probe.figures().disk_bytes
    kv = tmp_path / "kv"
    cache = _cache(engine, kv, disk=2 * one + one // 2)
    cache.keep(_state(engine, 13))
    cache.keep(_state(engine, 13, tuple(t + 1 for t in PROMPT)))
    reader = _cache(engine, kv, disk=2 * one + one // 2)                   # another process's cache
    assert reader.lookup(PROMPT, engine.backend).position == 13            # the first is used now
    cache.keep(_state(engine, 13, tuple(t + 2 for t in PROMPT)))          # over the budget: one goes
    left = {read_header(p)["tokens"][1] for p in kv.glob("*.kv")}
    assert left == {PROMPT[1], PROMPT[1] + 2}


# ---- two checkpoints ---------------------------------------------------------------------------------
def test_two_checkpoints_keep_the_same_tokens_side_by_side(tiny_model, tmp_path):
    """Two tiny checkpoints of one geometry (two seeds) in one directory, the same tokens kept by
    both: two files, each cache gets its own state back, continuing as its own cold session."""
    from ds4f.engine.checkpoint.convert import convert_checkpoint
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    other = convert_checkpoint(synth_checkpoint(tmp_path / "seed1", "tiny", seed=1), tmp_path / "seed1-ds4f",
                               progress=False)
    kv = tmp_path / "kv"
    engines = [_engine(tiny_model), _engine(other)]
    try:
        assert engines[0].fingerprint != engines[1].fingerprint
        tokens = tuple(t % 500 + 2 for t in PROMPT)
        for eng in engines:
            _cache(eng, kv).keep(_state(eng, 13, tokens))
        assert len(list(kv.glob("*.kv"))) == 2
        for eng in engines:
            got = _cache(eng, kv).lookup(tokens, eng.backend)
            assert got.position == 13 and got.checkpoint == eng.fingerprint
            cold = eng.new_session()
            want = [cold.step(t).logits.copy() for t in tokens][13:]
            session = eng.fork(got)
            assert all(np.array_equal(session.step(t).logits, w) for t, w in zip(tokens[13:], want))
    finally:
        for eng in engines:
            eng.close()
            eng.ckpt.close()


# ---- a run --------------------------------------------------------------------------------------------
def test_a_run_whose_kept_states_hold_nan_computes_its_prompt_and_writes_a_cold_runs_dump(tiny_model, tmp_path):
    """A chat's first turn keeps its states on disk; every head then gets a NaN in a window (whole
    files, matching sums). The next turn, after a restart: done, nothing reused, each file named in
    its events and removed, its dump the cold run's byte for byte; the turn after reuses again."""
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[kv]\nram = "64 MiB"\ndir = "{tmp_path / "kv"}"\nbudget = "1 GB"\n')

    def run(name, messages, **kw):
        r = start_run(RunConfig(model=str(tiny_model), messages=tuple(messages), gen=4, probe_floor=False,
                                config_path=str(cfg), dump_path=str(tmp_path / f"{name}.bin"), backend="scalar", **kw))
        assert r.wait(120) and r.state == "done", r.error
        return r

    question = {"role": "user", "content": "Hello there"}
    first = run("first", [question])
    turn = [question, first.assistant_message, {"role": "user", "content": "And why keep it warm?"}]
    heads = sorted((tmp_path / "kv").glob("*.kv"))
    assert heads

    def poison(head, body):
        at = _array(head, "1.window")["offset"]
        body[at:at + 4] = np.float32(np.nan).tobytes()

    for path in heads:
        _rewrite(path, payload=poison)
    second = run("second", turn)
    assert second.prompt_tokens_reused == 0
    events = "\n".join(second.report["events"])
    assert all(str(p) in events for p in heads) and "1.window holds NaN" in events, events
    assert not any(p.exists() for p in heads)
    cold = run("cold", turn, reuse_prefix=False)
    assert open(second.dump_path, "rb").read() == open(cold.dump_path, "rb").read()
    after = [*turn, second.assistant_message, {"role": "user", "content": "Thanks"}]
    assert run("third", after).prompt_tokens_reused >= second.prompt_tokens     # the state the second turn kept


def test_a_nan_in_a_blocks_rows_makes_its_states_misses(engine, tmp_path):
    """A block file (blocks of 16 positions) whose rows hold a NaN, its sum made to match: the
    state that needs it is refused when read, the block and the head removed, each named once in
    the log; a state the NaN is handed to in RAM is refused before it is kept."""
    kv = tmp_path / "kv"
    tokens = tuple((5 * i + 11) % 250 + 2 for i in range(40))
    state = _state(engine, 40, tokens)
    PrefixCache(engine.fingerprint, engine.geometry.to_config(), 0, kv, 1 << 30, span=16).keep(state)
    block = sorted((kv / "blocks").glob("*.kvb"))[0]

    def poison(head, body):
        e = next(e for e in head["arrays"] if e["name"].endswith(".rows"))
        body[e["offset"]:e["offset"] + 4] = np.float32(np.nan).tobytes()

    _rewrite(block, payload=poison)
    lines = []
    cache = PrefixCache(engine.fingerprint, engine.geometry.to_config(), 0, kv, 1 << 30, log=lines.append, span=16)
    assert cache.lookup(tokens, engine.backend) is None
    assert not block.exists() and not list(kv.glob("*.kv"))
    assert sum(str(block) in line and "NaN" in line for line in lines) >= 1, lines
    rows = state.layers[1].compressor.rows.copy()
    rows[0, 0] = np.nan
    bad = dataclasses.replace(state, layers=(state.layers[0], dataclasses.replace(
        state.layers[1], compressor=dataclasses.replace(state.layers[1].compressor, rows=rows)), *state.layers[2:]))
    with pytest.raises(Ds4fError, match="block 1 1.compressor.rows holds NaN"):
        PrefixCache(engine.fingerprint, engine.geometry.to_config(), 1 << 30, kv, 1 << 30, span=16).keep(bad)
