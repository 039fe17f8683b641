"""ds4f-console --serve: a `ds4f serve` in the console's own process (ds4f.cli.console.serve_here),
watched and steered by the attached console with the operator token the two share; the one engine
is the server's. Driven by Pilot against the real server on loopback (the tiny checkpoint)."""
from __future__ import annotations

import http.client
import json

import pytest

from ds4f.cli.console import main as entry_main, serve_here

from console_helpers import async_test, wait_for
from test_console_attach import Stream, attached, log_text, make, status_line, SIZE


@pytest.fixture()
def here(tiny_model, tmp_path):
    config = tmp_path / "ds4f.toml"
    config.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'
                      f'[history]\npath = "{tmp_path / "history.sqlite3"}"\n')
    server, token = serve_here(model=str(tiny_model), config_path=str(config), port=0)
    yield server, token
    server.stop(timeout=30)


def health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


@async_test
async def test_the_console_steers_the_server_it_started(here):
    server, token = here
    assert server.url.startswith("http://127.0.0.1:")
    # the token is the server's operator token: no file was written for it
    status = json.loads(_get(server.port, "/status"))
    assert status["operator"]["token_file"] in (None, "")
    app = make([server.url], operator_token=token)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        stream = Stream(server.port, max_tokens=4)          # a client of the same process's server
        assert stream.done.wait(60) and stream.status == 200
        await wait_for(pilot, lambda: " done" in log_text(app), 30, "the request's end in the log")
        await pilot.press("d")
        await wait_for(pilot, lambda: "DRAINING" in status_line(app), 30, "draining")
        assert health(server.port) == 503
        await pilot.press("u")
        await wait_for(pilot, lambda: "DRAINING" not in status_line(app), 30, "resumed")
        assert health(server.port) == 200


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def test_serve_goes_alone_and_only_through_the_entry_point(capsys):
    for argv in (["--serve", "--attach", "x:1"], ["--serve", "0", "--operator-token", "t"], ["--serve", "70000"]):
        with pytest.raises(SystemExit) as e:
            entry_main(argv)
        assert e.value.code == 2
    assert "--serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        entry_main(["--serve"], serve_here=None)  # the console alone does not bring the server
    assert "entry point" in capsys.readouterr().err
