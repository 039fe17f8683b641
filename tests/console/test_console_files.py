"""Files the operator names in the console (/tools FILE): a FIFO, a device, a directory, a file past
the bound (whatever st_size says) and JSON nested without end are refused with a line in the
transcript naming the file; the console, its conversation and its interface stay."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ds4f.console.core.chat import CHECKING, MAX_TOOLS_FILE, Chat
from ds4f.console.widgets.chat import PromptInput, Transcript
from ds4f.errors import Ds4fError

from console_helpers import _no_run_left_behind, async_test, history_path, make_app, wait_for  # noqa: F401 (fixtures)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _nested(depth: int) -> str:
    """A tools list whose one function's parameters nest `depth` objects deep."""
    inner = "{}"
    for _ in range(depth):
        inner = '{"type": "object", "properties": {"x": ' + inner + "}}"
    return '[{"type": "function", "function": {"name": "deep", "parameters": ' + inner + "}}]"


@pytest.fixture
def bad_files(tmp_path):
    """Every kind of file /tools must refuse, made for real."""
    fifo = tmp_path / "tools.fifo"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)                  # past the JSON parser's own limit
    schema = tmp_path / "schema.json"
    schema.write_text(_nested(300))                            # parses, but nests past the bound
    big = tmp_path / "big.json"
    big.write_text(json.dumps(TOOLS) + " " * MAX_TOOLS_FILE)   # one byte past the bound, all real
    folder = tmp_path / "folder.json"
    folder.mkdir()
    return {"a FIFO": fifo, "nested too deeply": deep, "more than the 64 levels": schema, "larger than": big,
            "a directory": folder, "a character device": "/dev/null", "no such file": tmp_path / "absent.json"}


def _free(fifo) -> None:
    """Open the FIFO's other end (without blocking: nothing happens when no reader waits)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _load_in_thread(chat: Chat, path, fifo=None):
    """chat.load_tools(path) in a thread, given 10 s: (the exception it raised, whether it returned)."""
    out = {}

    def load():
        try:
            chat.load_tools(str(path))
        except Exception as exc:   # what the test looks at
            out["exc"] = exc
        out["done"] = True

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive() and fifo is not None:    # blocked in open(): a writer lets it go, the test fails below
        _free(fifo)
        t.join(10)
    return out.get("exc"), out.get("done", False)


def test_load_tools_refuses_what_is_not_a_tools_file(bad_files):
    chat = Chat()
    good = bad_files["a directory"].parent / "good.json"
    good.write_text(json.dumps(TOOLS))
    assert chat.load_tools(str(good)) == 1
    for what, path in bad_files.items():
        exc, done = _load_in_thread(chat, path, fifo=path if what == "a FIFO" else None)
        assert done, f"{what}: load_tools blocked"
        assert isinstance(exc, Ds4fError), (what, exc)
        assert what in exc.message and str(path) in exc.message and "/tools" in exc.message, exc.message
        assert [t["name"] for t in chat.tools] == ["get_weather"], "a refused file leaves the tools as they were"


def test_load_tools_reads_no_more_of_dev_zero_than_its_bound(tmp_path):
    """/dev/zero says st_size 0 and never ends: refused after at most the bound, in a child process
    whose address space is capped (an unbounded read fails there, not on this machine)."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))
        from ds4f.console.core.chat import Chat
        from ds4f.errors import Ds4fError
        try:
            Chat().load_tools("/dev/zero")
        except Ds4fError as exc:
            print(exc.message)
            sys.exit(0)
        sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "/dev/zero" in done.stdout and "a character device, not a regular file" in done.stdout


@async_test
async def test_tools_files_refused_in_the_console_which_stays(tiny_model, history_path, bad_files):
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        await wait_for(pilot, lambda: app.controller.text is not CHECKING, 30, "the tokenizer check")
        ctl = app.controller
        ctl.chat.messages = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "kept"}]
        await pilot.press("i")                 # the prompt line
        await pilot.pause(0.1)
        prompt = app.dashboard.query_one(PromptInput)
        transcript = app.dashboard.query_one(Transcript)
        for what, path in bad_files.items():
            freer = threading.Timer(10, _free, (path,)) if what == "a FIFO" else None
            if freer is not None:            # a console blocked in open() is let go after 10 s, to fail below
                freer.daemon = True
                freer.start()
            prompt.value = f"/tools {path}"
            await pilot.press("enter")
            await wait_for(pilot, lambda: str(path) in transcript.plain.splitlines()[-1], 15, f"the refusal of {what}")
            line = transcript.plain.splitlines()[-1]
            assert what in line, line
            assert app.is_running and app._exception is None
            if freer is not None:
                freer.cancel()
        assert ctl.chat.messages[-1]["content"] == "kept", "the conversation stays"
        assert ctl.chat.tools == ()
