"""ds4f.safe_read, the one way ds4f reads a file it did not just write (one the user names, or one
of its own it finds again): a FIFO with no writer, a device, a socket or a directory under the name
is refused without blocking, naming what the file is, its path and the key that named it; no more
than the bound is read whatever st_size says (/proc's files say 0); a missing file is kind
not_found; JSON nested past the bound is refused. And the readers of ds4f's own files (the
fingerprint store, the disk floor store, the demo marker) take a FIFO in their file's place as no
file, never waiting on it."""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from ds4f.errors import Ds4fError
from ds4f.safe_read import MAX_JSON_DEPTH, open_regular, read_regular, read_regular_json, read_regular_text


def _read_open(path, what, param=None):
    with open_regular(path, what, param=param) as (f, _st):
        return f.read(10)


READERS = {
    "read_regular": lambda path, what, param=None: read_regular(path, what, 1 << 20, param=param),
    "read_regular_text": lambda path, what, param=None: read_regular_text(path, what, 1 << 20, param=param),
    "read_regular_json": lambda path, what, param=None: read_regular_json(path, what, 1 << 20, param=param),
    "open_regular": _read_open,
}


def _outcome(fn, *args):
    """fn(*args) in a thread that must end (a read blocked on a FIFO would not): what it gave or raised."""
    got = []

    def call():
        try:
            got.append(fn(*args))
        except Exception as exc:     # the test asserts which
            got.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{fn} blocked on {args}"
    return got[0]


@pytest.fixture
def not_regular_files(tmp_path):
    fifo = tmp_path / "tools.fifo"
    os.mkfifo(fifo)                               # no writer: a blocking open would wait forever
    sock_path = tmp_path / "server.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    sock.listen(1)
    (tmp_path / "adir").mkdir()
    try:
        yield {"a FIFO": fifo, "a character device": "/dev/zero", "a socket": sock_path, "a directory": tmp_path / "adir"}
    finally:
        sock.close()


@pytest.mark.parametrize("reader", list(READERS))
def test_what_is_not_a_regular_file_is_refused_at_once_naming_it(reader, not_regular_files):
    for kind, path in not_regular_files.items():
        exc = _outcome(READERS[reader], path, "--token-file", "token_file")
        assert isinstance(exc, Ds4fError), (kind, exc)
        assert str(exc) == f"--token-file {path}: cannot read: {kind}, not a regular file"
        assert exc.param == "token_file" and exc.path == str(path)


def test_the_bound_holds_whatever_st_size_says(tmp_path):
    maps = "/proc/self/maps"                      # a regular file whose st_size is 0, holding kilobytes
    assert os.stat(maps).st_size == 0
    with pytest.raises(Ds4fError, match=r"process map /proc/self/maps: larger than 100 bytes; not read"):
        read_regular(maps, "process map", 100)
    assert len(read_regular(maps, "process map", 16 << 20)) > 100
    exact = tmp_path / "exact.bin"
    exact.write_bytes(b"x" * 4096)
    assert read_regular(exact, "kept state", 4096) == b"x" * 4096
    with pytest.raises(Ds4fError, match=r"larger than 4095 bytes"):
        read_regular(exact, "kept state", 4095)
    sparse = tmp_path / "sparse.json"             # 1 GiB of nothing: refused before a byte is read
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(Ds4fError, match=r"config file .*sparse.json: larger than 1 MiB; not read"):
        read_regular_text(sparse, "config file", 1 << 20)


def test_a_missing_file_a_nul_byte_and_bad_text(tmp_path):
    absent = tmp_path / "absent.kv"
    with pytest.raises(Ds4fError) as e:
        read_regular(absent, "kept state", 100)
    assert str(e.value) == f"kept state {absent}: cannot read: no such file" and e.value.kind == "not_found"
    with pytest.raises(Ds4fError) as e:
        with open_regular(absent, "state dump", missing=f"{absent}: state dump not found"):
            pass
    assert str(e.value) == f"{absent}: state dump not found" and e.value.kind == "not_found"
    with pytest.raises(Ds4fError, match="a path with a NUL byte names no file") as e:
        read_regular(str(tmp_path / "a\x00b"), "trace", 100, param="trace")
    assert e.value.param == "trace"
    latin = tmp_path / "token"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(Ds4fError, match=r"token .*token: not UTF-8 text \(byte 3\)"):
        read_regular_text(latin, "token", 100)


def test_json_nested_past_the_bound_is_refused_naming_the_file(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(Ds4fError, match=f"/tools {deep}: JSON nested {MAX_JSON_DEPTH + 1} levels deep") as e:
        read_regular_json(deep, "/tools", 1 << 20)
    assert e.value.path == str(deep)
    ok = tmp_path / "ok.json"
    ok.write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert read_regular_json(ok, "/tools", 1 << 20) == json.loads(ok.read_text())
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(Ds4fError, match=f"/tools {broken}: malformed JSON"):
        read_regular_json(broken, "/tools", 1 << 20)


# ---- ds4f's own files, found again -------------------------------------------------------------------
def test_the_fingerprint_store_a_fifo_is_no_store(tmp_path):
    from ds4f.engine.checkpoint.fingerprint import KEPT_BYTES, checkpoint_fingerprint

    ck = tmp_path / "ck"
    ck.mkdir()
    with open(ck / "model.safetensors", "wb") as f:
        f.truncate(KEPT_BYTES + 1)                 # large enough that its sum goes to the store
    store = tmp_path / "fingerprints.json"
    os.mkfifo(store)
    fp = _outcome(checkpoint_fingerprint, ck, None, store)
    assert isinstance(fp, str) and len(fp) == 64
    assert store.is_file() and str((ck / "model.safetensors").resolve()) in json.loads(store.read_text())


def test_the_disk_floor_store_a_fifo_is_no_store(tiny_model, tmp_path, monkeypatch):
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.runtime.disk_floor import cached_floor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "cache" / "ds4f" / "floor.json"
    store.parent.mkdir(parents=True)
    os.mkfifo(store)
    with open_checkpoint(tiny_model) as ck:
        result = _outcome(cached_floor, ck, 2, 0.2)
    assert not isinstance(result, Exception), result
    assert store.is_file() and len(json.loads(store.read_text())) == 1      # measured, and written whole
    left = sorted(p.name for p in store.parent.iterdir())
    assert left == ["floor.json"], left


def test_a_fifo_as_the_demo_marker_is_no_finished_demo(tmp_path):
    from ds4f.engine.checkpoint.demo import MARKER, is_complete

    os.mkfifo(tmp_path / MARKER)
    assert _outcome(is_complete, tmp_path) is False
