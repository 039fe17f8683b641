"""A stream that has nothing to send for a while (a long prefill, here a run held at a step
boundary) gets keep-alives: an SSE comment on the OpenAI APIs, a `ping` event on Anthropic's, so a
client's idle timeout does not end it; the answer that follows is whole."""
from __future__ import annotations

import threading

import httpx
import pytest

from ds4f.api import Run
from ds4f.server import generation

from server_helpers import HELLO, serve_config, srv, start  # noqa: F401 (fixtures)


@pytest.fixture()
def held(monkeypatch):
    """Every run waits at its second step until `release` is set."""
    release, reached = threading.Event(), threading.Event()
    apply = Run._apply_switches

    def gated(run, eng, step):
        if step >= 1 and not release.is_set():
            reached.set()
            release.wait(120)
        return apply(run, eng, step)

    monkeypatch.setattr(Run, "_apply_switches", gated)
    monkeypatch.setattr(generation, "KEEPALIVE_S", 0.2)
    yield release, reached
    release.set()


@pytest.mark.parametrize("path,body,alive", [
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "stream": True}, ": working"),
    ("/v1/responses", {"input": HELLO, "max_output_tokens": 4, "stream": True}, ": working"),
    ("/v1/messages", {"messages": HELLO, "max_tokens": 4, "stream": True}, "event: ping"),
])
def test_a_silent_stream_gets_keep_alives(srv, held, path, body, alive):
    release, reached = held
    lines: list[str] = []
    with httpx.stream("POST", srv.url + path, json={"model": srv.service.model_id, **body},
                      headers={"anthropic-version": "2023-06-01"}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if reached.is_set() and sum(1 for x in lines if x.startswith(alive)) >= 3:
                release.set()          # three keep-alives while held: let the run finish
    assert release.is_set(), "no keep-alive came while the run was held"
    text = "\n".join(lines)
    ends = {"/v1/chat/completions": ("[DONE]",), "/v1/responses": ("response.completed", "response.incomplete"),
            "/v1/messages": ("message_stop",)}[path]
    assert any(e in text for e in ends), text[-500:]
