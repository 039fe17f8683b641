"""The console in a real pseudo-terminal: what it costs an SSH link.

The dashboard is fed a fixed Snapshot (unchanging) or one whose progress moves every poll;
we count the bytes the app writes to the terminal once it has drawn its first screen.
"""
from __future__ import annotations

import os
import select
import struct
import sys
import time
from pathlib import Path

import pytest

pty = pytest.importorskip("pty")
fcntl = pytest.importorskip("fcntl")
termios = pytest.importorskip("termios")

APP = """
import dataclasses, itertools, os, sys, tempfile
sys.path.insert(0, {tests!r})
from test_console_data import MODEL, builtin_config, fixed_history, fixed_snapshot
from ds4f.console.app import Ds4fConsole
snap = fixed_snapshot()
count = itertools.count()
def source():
    if sys.argv[1] == "moving":
        n = next(count)
        return dataclasses.replace(snap, tokens_done=n % 32, elapsed_s=n * 1.0)
    return snap
history = fixed_history(os.path.join(tempfile.mkdtemp(), "h.sqlite3"))
Ds4fConsole(config=builtin_config(), history=history, model=MODEL, validate_model=False,
            snapshot_source=source, refresh_s=1.0, theme="ds4f-dark").run()
"""


def _bytes_written(mode: str, settle: float, window: float) -> int:
    script = APP.format(tests=str(Path(__file__).parent))
    pid, fd = pty.fork()
    if pid == 0:  # the child: an 80x24 terminal running the console
        os.environ["TERM"] = "xterm-256color"
        os.environ.pop("NO_COLOR", None)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        os.execv(sys.executable, [sys.executable, "-c", script, mode])

    def drain(seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    n += len(os.read(fd, 65536))
                except OSError:
                    break
        return n

    try:
        first = drain(settle)
        assert first > 2000, "the console drew its first screen"
        return drain(window)
    finally:
        os.write(fd, b"q")
        drain(0.5)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        os.close(fd)


def test_an_unchanging_dashboard_sends_nothing():
    assert _bytes_written("idle", settle=4.0, window=3.0) == 0


def test_a_moving_run_costs_about_a_kilobyte_per_refresh():
    n = _bytes_written("moving", settle=4.0, window=5.0)
    assert 0 < n < 5 * 3000, f"{n} bytes in 5 s at a 1 s refresh"
