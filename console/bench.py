"""What the console costs while a run decodes: how long a key takes to act, and how many bytes
each refresh sends to the terminal (what an SSH link carries).

    from ds4f.console.bench import bench_console
    figures = bench_console("/path/to/checkpoint")     # a dict; prints nothing

Both measurements drive the real console over a real run of the given checkpoint. The key
latency is measured in this process, with Textual's headless driver; the bytes per refresh in
a child process whose console draws into a pseudo-terminal (POSIX only), counted per refresh
rather than per second, so the figure does not depend on how fast the machine is.

`count_refresh_bytes` and `reporting_source` are the pseudo-terminal half on its own, for a
console fed by any snapshot source (tests/test_console_tty.py uses them with fixed data).
"""
from __future__ import annotations

import asyncio
import os
import select
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ds4f.api import Ds4fError, History, Snapshot, checkpoint_summary

from .app import Ds4fConsole
from .screens import DashboardScreen

REFRESH_FD_ENV = "DS4F_CONSOLE_REFRESH_FD"
MORE_KEYS = 20     # at most this many times the keys asked for, while the run has not decoded a token
LIVE, IDLE = b"R", b"."   # what a child reports per refresh: a running run's snapshot, or anything else


def bench_console(model: str, *, keys: int = 30, refreshes: int = 10, refresh_s: float = 0.25,
                  size: tuple[int, int] = (80, 24), warm_tokens: int = 20, timeout_s: float = 300.0) -> dict:
    """Measure the console over a live run of `model`.

    Arguments:
        model: checkpoint path (the official shards or the ds4f layout).
        keys: key presses to time during the run (alternately + and -, which change the
            refresh period and write a line in the event log).
        refreshes: refreshes of a live run over which the terminal's bytes are counted.
        refresh_s: the dashboard's refresh period for both measurements.
        size: the terminal's (columns, lines).
        warm_tokens: tokens the run decodes before the keys are timed.
        timeout_s: a step that takes longer than this raises Ds4fError.

    The runs are recorded in a throw-away history, not the user's.

    Returns a dict:
        key_latency_s: the seconds from each key reaching the app to the app acting on it
        key_latency_median_s, key_latency_max_s: their median and maximum
        keys: how many keys were timed: `keys`, or more (up to MORE_KEYS times as many) until the run
            decoded a token while they were
        tokens_during_keys: tokens the run decoded while the keys were timed (it was busy)
        refresh_bytes: bytes the console wrote to the terminal over the counted refreshes
        refreshes: how many refreshes those were
        bytes_per_refresh: refresh_bytes / refreshes
        first_screen_bytes: bytes written before the counting began (the first full screen)
        terminal: "columns x lines"
        refresh_s, model: as given
    The four byte figures are None where there are no pseudo-terminals (not POSIX).
    """
    out: dict = {"model": str(model), "refresh_s": refresh_s, "terminal": f"{size[0]}x{size[1]}"}
    with tempfile.TemporaryDirectory(prefix="ds4f-bench-console-") as tmp:
        out.update(asyncio.run(_key_latency(str(model), Path(tmp) / "history.sqlite3", keys, refresh_s, size,
                                            warm_tokens, timeout_s)))
        try:
            import pty  # noqa: F401  (POSIX only)
        except ImportError:
            out.update(refresh_bytes=None, refreshes=None, bytes_per_refresh=None, first_screen_bytes=None)
            return out
        argv = [sys.executable, "-c", "from ds4f.console.bench import _bench_child; _bench_child()",
                str(model), str(Path(tmp) / "history-tty.sqlite3"), str(refresh_s)]
        tty = count_refresh_bytes(argv, settle=2, refreshes=refreshes, live_only=True, size=size,
                                  timeout_s=timeout_s)
    out.update(tty)
    return out


# ------------------------------------------------------------------------------ key latency
class _TimedConsole(Ds4fConsole):
    """The console, noting when each refresh-period key reaches the app. Textual calls the
    handler of every class in the app's MRO, so this one runs just before the console's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.acted: list[float] = []

    def on_dashboard_screen_step_refresh_period(self, _message: DashboardScreen.StepRefreshPeriod) -> None:
        self.acted.append(time.perf_counter())


async def _key_latency(model: str, history_path: Path, keys: int, refresh_s: float, size: tuple[int, int],
                       warm_tokens: int, timeout_s: float) -> dict:
    from textual import events

    checkpoint_summary(model)  # a bad checkpoint is an error here, not an error screen to wait on
    app = _TimedConsole(model=model, history=History(history_path), refresh_s=refresh_s, gen=2000)  # outlasts the measurement, within every built-in preset's context

    async def until(cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise Ds4fError(f"bench console: timed out waiting for {what}")
            await asyncio.sleep(0.01)

    latencies: list[float] = []
    async with app.run_test(size=size) as pilot:
        await until(lambda: app.controller is not None or not isinstance(app.screen, DashboardScreen),
                    "the console to start")
        if app.controller is None:
            raise Ds4fError(f"bench console: {model}: the console shows an error instead of the dashboard")
        await pilot.press("r")
        await until(lambda: app.controller.run is not None, "the run to start")
        run = app.controller.run
        await until(lambda: run.snapshot().tokens_done >= warm_tokens or run.finished, f"{warm_tokens} tokens")
        if run.state != "running":
            raise Ds4fError(f"bench console: the run is {run.state}: {run.error or 'too short to measure'}")
        tokens0 = run.snapshot().tokens_done
        i = 0
        # `keys` keys, and more while the run has not decoded a token since the first (a loaded
        # machine's token outlasts a few keys): the keys are timed while the run decodes
        while i < keys or (run.snapshot().tokens_done == tokens0 and not run.finished and i < MORE_KEYS * keys):
            key, char = ("plus", "+") if i % 2 == 0 else ("minus", "-")
            i += 1
            n = len(app.acted)
            event = events.Key(key, char)
            event.set_sender(app)
            t0 = time.perf_counter()
            app.post_message(event)  # as the terminal driver delivers a key
            await until(lambda: len(app.acted) > n, "a key's action")
            latencies.append(app.acted[-1] - t0)
            await asyncio.sleep(0.03)
        tokens = run.snapshot().tokens_done - tokens0
        await pilot.press("s")
        await until(lambda: run.finished, "the run to stop")
    return {"key_latency_s": latencies, "key_latency_median_s": statistics.median(latencies) if latencies else None,
            "key_latency_max_s": max(latencies) if latencies else None, "keys": len(latencies),
            "tokens_during_keys": tokens}


# ------------------------------------------------------------------------------ bytes per refresh
def reporting_source(source: Callable[[], Snapshot | None]) -> Callable[[], Snapshot | None]:
    """Wrap a console's snapshot source so that each poll (each refresh) is reported to the
    process that runs `count_refresh_bytes`, on the descriptor it names in the environment."""
    fd = int(os.environ[REFRESH_FD_ENV])

    def polled() -> Snapshot | None:
        snap = source()
        os.write(fd, LIVE if snap is not None and snap.state == "running" else IDLE)
        return snap

    return polled


def count_refresh_bytes(argv: list[str], *, refreshes: int = 5, settle: int = 3, live_only: bool = False,
                        size: tuple[int, int] = (80, 24), timeout_s: float = 120.0) -> dict:
    """Run a console (`argv`, whose snapshot source is wrapped by `reporting_source`) in a
    pseudo-terminal of `size` (columns, lines) and count the bytes it writes per refresh.

    After `settle` refreshes (with live_only: refreshes showing a running run) the bytes of
    the next `refreshes` refreshes are counted; then q is typed and the child is ended. The
    waits are counted in refreshes, not seconds: `timeout_s` only bounds a console that stops
    refreshing (Ds4fError).

    Returns {refresh_bytes, refreshes, bytes_per_refresh, first_screen_bytes}.
    """
    import fcntl
    import pty
    import termios

    rd, wr = os.pipe()
    os.set_inheritable(wr, True)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of the given size running the console
        os.close(rd)
        os.environ["TERM"] = "xterm-256color"
        os.environ[REFRESH_FD_ENV] = str(wr)
        os.environ.pop("NO_COLOR", None)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        os.execv(argv[0], argv)
    os.close(wr)
    written = 0       # bytes the console wrote to the terminal
    polls = b""       # one byte per refresh, in order
    deadline = time.monotonic() + timeout_s

    def read_until(cond: Callable[[], bool], what: str) -> None:
        nonlocal written, polls
        while not cond():
            if time.monotonic() > deadline:
                raise Ds4fError(f"console in a pseudo-terminal: timed out waiting for {what} "
                                f"({len(polls)} refreshes, {written} bytes)")
            ready, _, _ = select.select([fd, rd], [], [], 0.1)
            if fd in ready:
                try:
                    written += len(os.read(fd, 65536))
                except OSError as exc:
                    raise Ds4fError(f"console in a pseudo-terminal: the console ended ({exc})") from None
            if rd in ready:
                chunk = os.read(rd, 4096)
                if not chunk:
                    raise Ds4fError("console in a pseudo-terminal: the console ended")
                polls += chunk

    def counted() -> int:
        return polls.count(LIVE) if live_only else len(polls)

    try:
        read_until(lambda: counted() >= settle and written > 0, f"{settle} refreshes")
        first, start = written, counted()
        read_until(lambda: counted() >= start + refreshes, f"{refreshes} more refreshes")
        n = written - first
    finally:
        try:
            os.write(fd, b"q")
        except OSError:
            pass
        _drain_and_end(pid, fd)
        os.close(rd)
    return {"refresh_bytes": n, "refreshes": refreshes, "bytes_per_refresh": n / refreshes,
            "first_screen_bytes": first}


def _drain_and_end(pid: int, fd: int, grace_s: float = 10.0) -> None:
    """Read what the child still writes until it exits (q was typed), else kill it."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:
                pass
    else:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    os.close(fd)


def _bench_child() -> None:
    """The console of bench_console's pseudo-terminal half (argv: model, history path,
    refresh_s). It starts a run as soon as its config is loaded, as the r key would."""
    model, history_path, refresh_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    app: Ds4fConsole | None = None
    asked = False

    def snapshot() -> Snapshot | None:
        nonlocal asked
        ctl = app.controller if app is not None else None
        if ctl is None:
            return None
        if not asked:
            asked = True
            app.post_message(DashboardScreen.StartRun())
        return ctl.snapshot()

    app = Ds4fConsole(model=model, history=History(history_path), refresh_s=refresh_s, gen=2000,
                      snapshot_source=reporting_source(snapshot))
    app.run()
