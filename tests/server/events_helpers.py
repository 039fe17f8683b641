"""Helpers of the /events and /operator tests: a gate that holds runs at a step boundary, and a
reader of a text/event-stream answer read with httpx."""
from __future__ import annotations

import json
import threading

import pytest

from ds4f.api import Run

OPERATOR_TOKEN = "op-token-for-the-ds4f-tests_0123456789"


class StepGate:
    """Holds a run once at a step boundary, before the step's switches land (Run._apply_switches
    is where they land), until released: a switch sent while it holds lands exactly at that step,
    and a run stays live for as long as a test needs, without a clock."""

    def __init__(self) -> None:
        self.when = None                 # when(run, step) -> hold here (once); None: never
        self.held = threading.Event()    # set: not holding (or released)
        self.held.set()
        self.reached = threading.Event()
        self.step: int | None = None     # the step a run was held before
        self.run_id: str | None = None

    def close(self, when=lambda run, step: True) -> None:
        """Hold the first run for which when(run, step) is true, once."""
        self.reached.clear()
        self.step = self.run_id = None
        self.when = when

    def release(self) -> None:
        """Let the held run go on (a close() since holds it again where it says)."""
        self.held.set()

    def open(self) -> None:
        self.when = None
        self.held.set()

    def wait(self, timeout: float = 60.0) -> tuple[str, int]:
        assert self.reached.wait(timeout), "no run reached the gate"
        return self.run_id, self.step

    def wrap(self, apply):
        def gated(run, eng, step):
            when = self.when
            if when is not None and when(run, step):
                self.when = None
                hold = self.held = threading.Event()
                self.run_id, self.step = run.id, step
                self.reached.set()
                hold.wait(120)
            return apply(run, eng, step)
        return gated


@pytest.fixture()
def gate(monkeypatch):
    g = StepGate()
    monkeypatch.setattr(Run, "_apply_switches", g.wrap(Run._apply_switches))
    yield g
    g.open()


class Events:
    """The events of an open text/event-stream answer (httpx's streaming response)."""

    def __init__(self, response) -> None:
        self.response = response
        self.lines = response.iter_lines()
        self.seen: list[tuple[str, object]] = []

    def next(self) -> tuple[str, object]:
        """The next event: (its name, its data parsed as JSON)."""
        name, data = "message", []
        for line in self.lines:
            if line == "":
                if data:
                    event = (name, json.loads("\n".join(data)))
                    self.seen.append(event)
                    return event
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        raise EOFError("the stream ended")

    def until(self, match, limit: int = 300) -> tuple[str, object]:
        """The first event from here for which match(name, data) is true (at most `limit` read)."""
        for _ in range(limit):
            name, data = self.next()
            if match(name, data):
                return name, data
        raise AssertionError(f"no matching event in {limit}")

    def snapshot(self, match=lambda d: True) -> dict:
        return self.until(lambda n, d: n == "snapshot" and match(d))[1]

    def log(self, match=lambda d: True) -> dict:
        return self.until(lambda n, d: n == "log" and match(d))[1]

    def logged(self, match=lambda d: True) -> list[dict]:
        """The log events read so far that match."""
        return [d for n, d in self.seen if n == "log" and match(d)]


def operator_headers(token: str = OPERATOR_TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}
