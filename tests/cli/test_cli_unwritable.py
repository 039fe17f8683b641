"""An output where no file can be made (a read-only filesystem, a directory this user may not
write, a directory that is not there, /proc and /sys) is a clear one-line error naming the path,
said before any work where it can be known then, never an internal error, and no file is left."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def ds4f(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def assert_refused(out, *words):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    for w in words:
        assert str(w) in out.stderr, (w, out.stderr)


@pytest.fixture(scope="module")
def dump(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("dump")
    out = ds4f("run", tiny_model, "--gen", "2", "--no-probe", "--dump-state", d / "a.bin")
    assert out.returncode == 0, out.stderr
    return d / "a.bin"


@pytest.fixture
def read_only(tmp_path):
    """(a directory no file can be made in, what the refusal says): mode 0o555 for a user; for
    root, whom modes do not bind, a read-only tmpfs mounted there."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d, "not writable"
        d.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("running as root (modes do not bind) and no read-only tmpfs can be mounted here: "
                    + mounted.stderr.decode(errors="replace").strip())
    try:
        yield d, "read-only filesystem"
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_outputs_on_a_read_only_directory_are_refused_before_any_work(dump, tiny_model, read_only):
    d, why = read_only
    assert_refused(ds4f("replay", dump, "--sweep", "--plot", d / "p.png"), "--plot", d / "p.png", why, "nothing was done")
    assert_refused(ds4f("trace", "export", dump, d / "t.npz"), "OUT", d / "t.npz", why)
    assert_refused(ds4f("run", tiny_model, "-n", "1", "--no-probe", "--dump-state", d / "sub" / "a.bin"),
            "--dump-state", why)
    assert_refused(ds4f("generate", tiny_model, "-p", "hi", "-n", "1", "--json", d / "r.json"), "--json", why)
    assert os.listdir(d) == []


def test_a_missing_directory_is_named(dump, tmp_path):
    target = tmp_path / "absent" / "p.png"
    assert_refused(ds4f("replay", dump, "--sweep", "--plot", target), "no directory", tmp_path / "absent")


@pytest.mark.parametrize("target", ["/proc/ds4f-plot.png", "/proc/version.png", "/sys/ds4f-plot.png"])
def test_a_plot_under_proc_or_sys_is_a_clear_error(dump, target):
    """/proc and /sys take no new files, even from root: known only when the plot is written, the
    error still names the path and leaves nothing."""
    assert_refused(ds4f("replay", dump, "--sweep", "--plot", target), target)
    assert not os.path.exists(target)


def test_a_report_that_cannot_be_written_after_the_run_is_a_clear_error(tiny_model):
    """generate --json /proc/...: nothing says so before the run, the write fails after it; one line."""
    assert_refused(ds4f("generate", tiny_model, "-p", "hi", "-n", "1", "--no-kv", "--json", "/proc/ds4f-report.json"),
            "/proc/ds4f-report.json", "cannot write")
