"""The state dump's readers trust no length the file states: a FIFO or a device under a dump's name
is refused without blocking (every reader, not only read_state), a header length past the file or
past the bound is refused from the first 16 bytes, and a record count past what the file holds is
refused before anything is allocated for it."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading

import pytest

from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.statedump import MAX_HEADER_BYTES, read_records, read_routing, read_state

READERS = {"read_state": lambda p: read_state(p, check_report=False), "read_records": lambda p: read_records(p, 0, 2),
           "read_routing": read_routing}


@pytest.fixture(scope="module")
def dump(tiny_model, tmp_path_factory):
    run = start_run(RunConfig(model=str(tiny_model), gen=2, prompt=(0, 17), backend="scalar", probe_floor=False,
                              dump_path=str(tmp_path_factory.mktemp("dump") / "base.bin"), dump="compact"))
    assert run.wait(120) and run.state == "done", run.error
    return run.dump_path


def _parts(path):
    data = open(path, "rb").read()
    magic, version, hlen = struct.unpack_from("<8sII", data)
    return magic, version, json.loads(data[16:16 + hlen]), data[16 + hlen:]


@pytest.mark.parametrize("reader", list(READERS))
def test_a_fifo_or_a_device_is_refused_without_blocking(reader, tmp_path):
    fifo = tmp_path / "dump.bin"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        got = []
        t = threading.Thread(target=lambda: got.append(_outcome(READERS[reader], path)), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), f"{reader} blocked on {path}"
        assert isinstance(got[0], Ds4fError) and "not a regular file" in str(got[0]) and str(path) in str(got[0])


def _outcome(fn, path):
    try:
        return fn(path)
    except Exception as exc:   # the test asserts which
        return exc


@pytest.mark.parametrize("reader", list(READERS))
def test_a_header_length_past_the_file_or_the_bound_is_refused_before_it_is_read(reader, dump, tmp_path):
    magic, version, _, _ = _parts(dump)
    small = tmp_path / "small.bin"
    small.write_bytes(struct.pack("<8sII", magic, version, 1 << 30) + b"{}")
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.write(struct.pack("<8sII", magic, version, MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + (64 << 20))
    for path in (small, sparse):
        with pytest.raises(Ds4fError, match="header says") as e:
            READERS[reader](path)
        assert str(path) in str(e.value)


def test_a_record_count_past_the_file_is_refused_before_it_is_allocated(dump, tmp_path):
    """n_tokens of 10^12 in a dump of two records: refused from the header and the file's size (a
    fresh process's peak memory stays far below what the count would need)."""
    magic, version, header, records = _parts(dump)
    header["n_tokens"] = 10 ** 12
    raw = json.dumps(header).encode()
    big = tmp_path / "big.bin"
    big.write_bytes(struct.pack("<8sII", magic, version, len(raw)) + raw + records)
    for name in ("read_state", "read_routing"):        # (read_records reads the span asked for)
        with pytest.raises(Ds4fError, match="truncated state dump: its header says") as e:
            READERS[name](big)
        assert str(big) in str(e.value), name
    assert len(read_records(big, 0, 2)) == 2
    with pytest.raises(Ds4fError, match="fewer than"):
        read_records(dump, 0, 10 ** 12)
    peak = subprocess.run([sys.executable, "-c", "import sys\nfrom ds4f.runs.statedump import read_routing\n"
                           "try:\n    read_routing(sys.argv[1])\nexcept Exception as e:\n    print(e)\n"
                           "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))",
                           str(big)], capture_output=True, text=True, timeout=60)
    said, peak_kib = peak.stdout.splitlines()
    assert "truncated state dump" in said and int(peak_kib) < 400_000, peak.stdout
