"""What the Pilot-driven console tests share: async tests without a plugin, a fresh app on a
model, waiting for a condition, and no run left behind after a test."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from ds4f.console.app import Ds4fConsole
from ds4f.runs.history import History


def async_test(fn):
    """Run an async test with asyncio (the project has no pytest async plugin)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    yield
    from ds4f.runs.run import active_run

    run = active_run()
    if run is not None:
        run.cancel()
        run.wait(30)


@pytest.fixture
def history_path(tmp_path):
    return tmp_path / "history.sqlite3"


def make_app(model, history_path, **kw) -> Ds4fConsole:
    kw.setdefault("refresh_s", 0.1)
    return Ds4fConsole(model=str(model), history=History(history_path), **kw)


async def wait_for(pilot, cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)
