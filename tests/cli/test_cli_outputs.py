"""Every command that writes a file refuses, before any work, what would lose something or land
where the user did not say: a device or FIFO (even with --force), one of its own inputs, an
existing file without --force, a directory, a name a library would extend."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def ds4f(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dump(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("dump")
    out = ds4f("run", tiny_model, "--gen", "2", "--no-probe", "--dump-state", d / "a.bin")
    assert out.returncode == 0, out.stderr
    return d / "a.bin"


def refused(out, *words):
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_a_device_is_never_a_state_dump(tiny_model, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in ("/dev/null", fifo):
        refused(ds4f("run", tiny_model, "--gen", "2", "--no-probe", "--dump-state", target, "--force"),
                "not a regular file", str(target))
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert not os.path.exists("/dev/null.report.json")


def test_trace_export_refuses_its_input_an_existing_file_and_a_name_it_would_extend(dump, tmp_path):
    before = dump.read_bytes()
    refused(ds4f("trace", "export", dump, dump, "--force"), "must end in .npz")
    same = tmp_path / "t.npz"
    assert ds4f("trace", "export", dump, same).returncode == 0
    refused(ds4f("trace", "export", same, same, "--force"), "which this command reads")
    refused(ds4f("trace", "export", dump, same), "already exists", "--force")
    assert ds4f("trace", "export", dump, same, "--force").returncode == 0
    refused(ds4f("trace", "export", dump, tmp_path / "t"), "must end in .npz")
    assert not (tmp_path / "t.npz.npz").exists() and not (tmp_path / "t").exists()
    assert dump.read_bytes() == before


def test_replay_plot_is_written_under_its_own_name_only(dump, tmp_path):
    (tmp_path / "d").mkdir()
    refused(ds4f("replay", dump, "--sweep", "--plot", tmp_path / "d"), "must end in")
    refused(ds4f("replay", dump, "--sweep", "--plot", tmp_path / "plot"), "must end in")
    (tmp_path / "p.png").write_bytes(b"keep")
    refused(ds4f("replay", dump, "--sweep", "--plot", tmp_path / "p.png"), "already exists")
    assert (tmp_path / "p.png").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "p.png"]


def test_a_benchmarks_json_is_not_overwritten_unasked(tmp_path):
    kept = tmp_path / "k.json"
    kept.write_text("{}")
    refused(ds4f("bench-kernels", "--json", kept), "already exists")
    refused(ds4f("bench", "engine", "--json", kept), "already exists")
    assert kept.read_text() == "{}"


def test_a_run_without_a_state_dump_still_writes_the_report_json_names(tiny_model, tmp_path):
    """--dump off writes no state dump, so no report beside one: --json PATH gets the report itself
    (the run's own tokens), and nothing else is left in the directory."""
    report = tmp_path / "r.json"
    out = ds4f("run", tiny_model, "--gen", "3", "--no-probe", "--dump", "off", "--json", report)
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["state"] == "done" and data["summary"]["tokens"] == 3 and len(data["generated"]) == 3
    assert data["state_path"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
