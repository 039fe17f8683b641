"""The console's chat: a prompt line and a transcript on the dashboard, driven by Pilot against
the real engine on the tiny checkpoint (which ships a tokenizer; its weights are random, so its
text is noise, but it is the run's text all the same).

What a test expects comes from elsewhere than the console: the run's own output_text and
config, the history file, the checkpoint's generation_config.json read with json.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from textual.command import CommandPalette
from textual.widgets import Static

from ds4f.api import parse_reply
from ds4f.console.core import figures as F
from ds4f.console.app import Ds4fConsole
from ds4f.console.core.bindings import CHAT_BINDINGS, DASHBOARD_BINDINGS, PROMPT_BINDINGS, typed
from ds4f.console.core.chat import CHECKING, Chat, parse_command
from ds4f.console.screens import DashboardScreen, DiffScreen, HelpScreen, HistoryScreen
from ds4f.console.widgets.chat import PromptInput, Transcript
from ds4f.console.widgets.common import KeyBar
from ds4f.native import kernels
from ds4f.errors import Ds4fError
from ds4f.runs.history import History

from console_helpers import _no_run_left_behind, async_test, history_path, make_app, wait_for  # noqa: F401 (fixtures)

SIMD = [b for b in kernels.available_backends() if b != "scalar"]




async def ready(pilot) -> None:
    """Booted, and the checkpoint's tokenizer looked at."""
    app = pilot.app
    await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
    await wait_for(pilot, lambda: app.controller.text is not CHECKING, 30, "the tokenizer check")
    await pilot.pause(0.1)


async def type_line(pilot, text: str) -> None:
    await pilot.press(*["space" if ch == " " else ch for ch in text])


async def send(pilot, text: str):
    """Type a prompt, press enter, wait for the answer's run to end; returns the run."""
    app = pilot.app
    before = app.controller.run
    await type_line(pilot, text)
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.controller.run is not before and app.controller.run is not None, 30,
                   "the run to start")
    await wait_for(pilot, lambda: app.controller.run.finished and app._answer is None, 120, "the answer to end")
    await pilot.pause(0.1)
    return app.controller.run


def transcript(app) -> Transcript:
    return app.dashboard.query_one(Transcript)


def answers(app) -> list[str]:
    return [e.content.plain for e in transcript(app).query(".answer").results(Static)]


def endings(app) -> list[str]:
    return [e.content.plain for e in transcript(app).query(".ending").results(Static)]


def bar_text(app) -> str:
    return " ".join(f"{k} {label}" for k, label in app.screen.query_one(KeyBar).items())


def generation_config(model) -> dict:
    return json.loads((Path(model) / "generation_config.json").read_text())


# ------------------------------------------------------------------------------ a prompt, an answer
@async_test
async def test_a_prompt_streams_its_answer_into_the_transcript(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=40)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert app.controller.text.ok, app.controller.text.detail
        await pilot.press("i")
        await pilot.pause(0.1)
        prompt = app.dashboard.query_one(PromptInput)
        assert prompt.has_focus and app.dashboard.has_class("-chat")
        # at 80x24 the panels the operator watches are still there beside the transcript
        for panel in ("#p-speed", "#p-io", "#p-hits", "#p-mem", "#p-kern", "#p-chat"):
            region = app.dashboard.query_one(panel).region
            assert region.height >= 3 and region.bottom <= 24, (panel, region)
        assert app.dashboard.query_one("#transcript").region.height >= 3
        run = await send(pilot, "Hello there")
        assert run.state == "done", run.error
        assert run.output_text, "the tiny model wrote something"
        # the transcript shows the run's text (control characters as their visible pictures)
        assert answers(app) == [F.printable(run.output_text)]
        assert "Hello there" in transcript(app).plain
        assert endings(app)[-1].startswith("✓ token limit · 40 tokens")
        # the run is a chat run, sampled with the checkpoint's defaults and the seed
        assert run.config.messages == ({"role": "user", "content": "Hello there"},)
        assert run.config.thinking is False and run.config.gen == 40
        cfg = generation_config(tiny_model)
        s = run.config.sampling
        assert (s.temperature, s.top_p, s.seed) == (cfg.get("temperature", 1.0), cfg.get("top_p", 1.0), 0)
        # the panels updated from the same run meanwhile
        assert str(app.dashboard.query_one("#speed-digits").value) != "-.---"
        # a second prompt carries the conversation
        run2 = await send(pilot, "And then?")
        assert run2.state == "done", run2.error
        assert run2.config.messages == ({"role": "user", "content": "Hello there"},
                                        {"role": "assistant", "content": run.output_text,
                                         "tokens": list(run.generated_ids)},
                                        {"role": "user", "content": "And then?"})
        assert answers(app) == [F.printable(run.output_text), F.printable(run2.output_text)]
        # and reuses it: the first turn's prompt from the prefix cache, said in the run panel's lines
        # and its answer, as the ids it was generated as: all that was fed (not the last answer token)
        assert run2.prompt[:run.prompt_tokens + 40] == run.prompt + run.generated_ids
        assert run2.prompt_tokens_reused == run.prompt_tokens + 40 - 1
        lines, _ = F.run_lines(run2.snapshot())
        assert f"prompt {run2.prompt_tokens_reused} reused" in " · ".join(lines)
    rec = History(history_path).get(run2.id)
    assert rec.config["output_text"] == run2.output_text and rec.config["finish_reason"] == "length"


@async_test
async def test_the_stop_key_stops_the_answer_and_keeps_it(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=2000)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("i")
        await type_line(pilot, "Tell me a long story.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.controller.run is not None, 30, "the run to start")
        run = app.controller.run
        # text streams in while the run goes on
        await wait_for(pilot, lambda: run.generated_tokens > 20 and answers(app) and answers(app)[0] not in
                       ("", "…") and not answers(app)[0].startswith("reading the prompt"), 60, "streamed text")
        assert run.state == "running" and not run.finished
        assert app.dashboard.query_one(PromptInput).has_focus
        assert "^c stop" in bar_text(app)
        await pilot.press("ctrl+c")   # with the cursor in the prompt line
        assert run.wait(30)
        await wait_for(pilot, lambda: app._answer is None, 30, "the answer to end")
        await pilot.pause(0.1)
        assert run.state == "cancelled"
        assert 20 < run.generated_tokens < 2000
        assert answers(app) == [F.printable(run.output_text)] and run.output_text
        assert endings(app)[-1].startswith(f"■ stopped after {run.generated_tokens} tokens")
        # the partial answer stays in the conversation
        kept = app.controller.chat.messages[-1]
        assert kept == run.assistant_message and (kept["role"], kept["content"]) == ("assistant", run.output_text)
        assert set(kept) <= {"role", "content", "tokens"}
        # with nothing live, ctrl+c is Textual's copy again: nothing is stopped, nothing breaks
        await pilot.press("ctrl+c")
        assert app.controller.run is run
    rec = History(history_path).get(run.id)
    assert rec.state == "cancelled" and rec.config["output_text"] == run.output_text


@async_test
async def test_typed_letters_do_not_act_as_keys(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=3)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        ctl = app.controller
        preset, backend, theme, refresh = ctl.preset, ctl.next_backend(), app.theme, app.refresh_s
        await pilot.press("i")
        await pilot.pause(0.1)
        prompt = app.dashboard.query_one(PromptInput)
        assert prompt.has_focus
        # every single-character key of the dashboard and the app, typed
        keys = ["p", "colon", "r", "s", "k", "n", "h", "d", "c", "t", "q", "m", "i", "space", "plus", "minus",
                "left_square_bracket", "right_curly_bracket", "question_mark"]
        await pilot.press(*keys)
        await pilot.pause(0.3)
        assert prompt.value == "p:rsknhdctqmi +-[}?"
        assert isinstance(app.screen, DashboardScreen), "no palette, help, history or token-count screen"
        assert (ctl.preset, ctl.next_backend(), app.theme, app.refresh_s) == (preset, backend, theme, refresh)
        assert ctl.run is None and not app.frozen and app.is_running and ctl.chat.mode == "chat"
        # the key bar lists what acts while typing, and no letter key
        bar = bar_text(app)
        for word in ("send", "leave", "^c stop", "clear", "cmds"):
            assert word in bar, bar
        assert "preset" not in bar and "theme" not in bar and "quit" not in bar
        # ctrl+p still opens the palette
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), 10, "the palette")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen), 10, "the palette to close")
        # esc leaves the prompt line: the letters act again
        prompt.focus()
        await pilot.pause(0.1)
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not prompt.has_focus and app.dashboard.has_class("-chat")
        assert "preset" in bar_text(app) and "mode" in bar_text(app)
        await pilot.press("p")
        assert ctl.preset != preset
        await pilot.press("m")
        assert ctl.chat.mode == "think"
        # a second esc: back to the run and event panels, where the chat keys rest
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not app.dashboard.has_class("-chat")
        assert app.dashboard.query_one("#p-log").display and not app.dashboard.query_one("#p-chat").display
        await pilot.press("m")
        assert ctl.chat.mode == "think", "m acts only with the transcript shown"
        assert "mode" not in bar_text(app) and "i chat" in bar_text(app)


@async_test
async def test_a_checkpoint_without_tokenizer_disables_the_prompt(tiny_model, history_path, tmp_path):
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("tokenizer.json"))
    assert not (model / "tokenizer.json").exists()
    app = make_app(model, history_path, gen=3)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert not app.controller.text.ok
        await pilot.press("i")
        await pilot.pause(0.2)
        prompt = app.dashboard.query_one(PromptInput)
        assert prompt.disabled and not prompt.has_focus
        assert "needs a tokenizer" in prompt.placeholder and "no tokenizer.json" in prompt.placeholder
        assert f"{model} has no tokenizer.json" in transcript(app).plain
        # the letter keys still act (nothing has the cursor), and r runs on token ids as before
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.finished, 60, "run")
        run = app.controller.run
        assert run.state == "done", run.error
        assert run.config.text is None and run.config.messages is None and run.output_text == ""


@async_test
async def test_the_demo_model_is_said_to_write_noise(tiny_model, history_path, tmp_path):
    # no model configured: the console makes (here: is handed) the demo model
    app = Ds4fConsole(settings=None, model=None, history=History(history_path), refresh_s=0.1,
                      demo_factory=lambda progress=None: tiny_model)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app.controller.model == str(tiny_model), 30,
                       "the demo model")
        await ready(pilot)
        assert app.controller.text.ok and app.controller.text.demo
        await pilot.press("i")
        await pilot.pause(0.1)
        assert "weights are random, so what it writes is noise" in transcript(app).plain
    app = make_app(tiny_model, history_path)   # the same checkpoint given as a model: synthetic, the same note
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("i")
        await pilot.pause(0.1)
        assert "weights are random, so what it writes is noise" in transcript(app).plain
    real = tmp_path / "real"                   # a checkpoint whose config.json does not say ds4f synth made it
    shutil.copytree(tiny_model, real)
    cfg = json.loads((real / "config.json").read_text())
    del cfg["ds4f_synthetic"]
    (real / "config.json").write_text(json.dumps(cfg))
    app = make_app(real, history_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await pilot.press("i")
        await pilot.pause(0.1)
        assert "noise" not in transcript(app).plain


@async_test
async def test_modes_commands_and_clearing(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=24)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        ctl = app.controller
        await pilot.press("i")
        # plain completion: the text is the prompt, no chat format, no history
        await type_line(pilot, "/text")
        await pilot.press("enter")
        assert ctl.chat.mode == "text" and "text ›" in str(app.dashboard.query_one("#prompt-mode").render())
        run = await send(pilot, "Once upon a time")
        assert run.config.text == "Once upon a time" and run.config.messages is None
        assert answers(app)[-1] == F.printable(run.output_text)
        assert ctl.chat.messages == []
        # thinking mode, with another seed: the reasoning is dimmed
        await type_line(pilot, "/think")
        await pilot.press("enter")
        await type_line(pilot, "/seed 7")
        await pilot.press("enter")
        run = await send(pilot, "Why?")
        assert run.config.thinking is True and run.config.sampling.seed == 7
        reply = parse_reply(run.output_text, True)
        reasoning, answer = reply.reasoning, reply.content
        entry = transcript(app).query(".answer").results(Static)
        text = list(entry)[-1].content
        assert text.plain == answers(app)[-1]
        dim = "".join(text.plain[s.start:s.end] for s in text.spans if "dim" in str(s.style))
        assert dim == F.printable(reasoning) and reasoning
        assert ctl.chat.messages[-1]["content"] == answer
        # an unknown command says what there is; the prompt line keeps it
        await type_line(pilot, "/frobnicate")
        await pilot.press("enter")
        assert "unknown command" in transcript(app).plain
        assert app.dashboard.query_one(PromptInput).value == "/frobnicate"
        app.dashboard.query_one(PromptInput).value = ""
        # ctrl+l clears the conversation (while typing), /reset too
        await pilot.press("ctrl+l")
        await pilot.pause(0.2)
        assert ctl.chat.messages == [] and answers(app) == []
        assert "conversation cleared" in transcript(app).plain
        # m cycles the mode once the cursor is out of the prompt line
        await pilot.press("escape")
        modes = []
        for _ in range(3):
            await pilot.press("m")
            modes.append(ctl.chat.mode)
        assert modes == ["text", "chat", "think"]


@pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")
@async_test
async def test_history_shows_text_runs_and_they_still_compare(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=12)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("i")
        simd = await send(pilot, "Hello")
        await type_line(pilot, "/reset")
        await pilot.press("enter")
        await pilot.press("escape")
        await pilot.press("k")        # scalar kernels for the next run
        await pilot.press("i")
        await pilot.pause(0.1)
        scalar = await send(pilot, "Hello")
        assert {simd.state, scalar.state} == {"done"}
        assert simd.config.messages == scalar.config.messages and scalar.config.backend == "scalar"
        await pilot.press("escape")
        # the history's detail: the prompt and the output of a text run
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen), 10, "the history")
        await pilot.pause(0.2)
        detail = " ".join(str(app.screen.query_one("#run-detail", Static).render()).split())
        temperature = generation_config(tiny_model).get("temperature", 1.0)
        assert f"text chat · T {temperature:g} · seed 0 · token limit · {len(scalar.prompt)} + 12 tokens" in detail
        output = " ".join(F.printable(scalar.output_text).split())
        assert "› Hello" in detail and f"‹ {output[:20]}" in detail
        await pilot.press("escape")
        # the SIMD/scalar comparison finds the pair and diffs their state dumps
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen), 10, "the diff screen")
        diff = app.screen
        assert {diff.a.run_id, diff.b.run_id} == {simd.id, scalar.id}
        verdict = diff.query_one("#verdict", Static)
        await wait_for(pilot, lambda: diff.diff is not None or "cannot compare" in str(verdict.render()), 60,
                       "the diff")
        assert diff.diff is not None, str(verdict.render())


@async_test
async def test_help_lists_the_chat_keys(tiny_model, history_path):
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        console = Console(width=200, record=True, file=open(os.devnull, "w"))
        for w in app.screen.query(Static):
            console.print(w.content)
        text = console.export_text()
        for b in CHAT_BINDINGS + PROMPT_BINDINGS + [b for b in DASHBOARD_BINDINGS if b.action == "chat"]:
            assert b.tooltip.split(" (")[0][:40] in text, b.key


# ------------------------------------------------------------------------------ without Textual
def test_every_chat_binding_has_a_handler():
    for b in CHAT_BINDINGS:
        assert hasattr(DashboardScreen, f"action_{b.action}"), b.key
        assert b.tooltip
    for b in PROMPT_BINDINGS:
        assert hasattr(PromptInput, f"action_{b.action}"), b.key
        assert b.tooltip
    dashboard_keys = {k for b in DASHBOARD_BINDINGS for k in b.key.split(",")}
    assert not dashboard_keys & {k for b in CHAT_BINDINGS for k in b.key.split(",")}, "no key is bound twice"


def test_the_console_docs_list_the_chat_keys():
    console = (Path(__file__).parents[2] / "docs" / "console.md").read_text()
    for key in ("`i`", "`m`", "`ctrl+l`", "`ctrl+c`", "`enter`", "`esc`", "/reset", "/think", "/text", "/seed"):
        assert key in console, key


def test_typed_keys():
    assert all(typed(k) for k in ("r", "p", "colon", "space", "plus", "question_mark", "left_square_bracket"))
    assert not any(typed(k) for k in ("ctrl+c", "ctrl+l", "escape", "enter", "f1", "shift+tab", "up"))


def test_chat_requests_and_turns():
    chat = Chat()
    assert chat.request("hi") == {"messages": ({"role": "user", "content": "hi"},), "thinking": False}
    chat.answered(chat.request("hi"), {"role": "assistant", "content": "hello", "tokens": [5, 6]})
    assert chat.messages == [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello", "tokens": [5, 6]}]
    chat.set_mode("think")
    req = chat.request("why?")
    assert req["thinking"] is True and len(req["messages"]) == 3
    chat.answered(req, {"role": "assistant", "content": "so", "reasoning": "because"})
    assert chat.messages[-1] == {"role": "assistant", "content": "so", "reasoning": "because"}
    assert len(chat.messages) == 4 and chat.messages[2] == {"role": "user", "content": "why?"}
    chat.set_mode("text")
    assert chat.request("Once") == {"text": "Once"}
    chat.answered({"text": "Once"}, None)
    assert len(chat.messages) == 4, "a completion leaves no turn"
    with pytest.raises(Ds4fError):
        chat.request("   ")
    chat.reset()
    assert chat.messages == []


def test_slash_commands():
    assert parse_command("hello") is None
    assert parse_command(" /reset ").name == "reset"
    assert parse_command("/seed 42").arg == "42"
    for bad in ("/seed", "/seed x", "/seed ²", "/seed -1", "/nope", "/chat now"):
        with pytest.raises(Ds4fError):
            parse_command(bad)


def test_printable_and_sampling_text():
    assert F.printable("a\tb\nc") == "a\tb\nc"
    assert F.printable("a\x05b\x7f") == "a\u2405b\u2421"
    assert F.sampling_text(None) == "greedy"
    assert F.sampling_text({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 3}) == "greedy"
    assert F.sampling_text({"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 3}) == \
        "T 0.7 · top-p 0.95 · top-k 40 · min-p 0.05 · seed 3"


TOOLS_FILE = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
DSML_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜tool_calls>')


def test_tools_system_prompt_and_results_in_the_chat(tmp_path):
    chat = Chat()
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS_FILE))
    assert chat.load_tools(str(tools)) == 1
    chat.set_system("Be a weather desk.")
    req = chat.request("Paris?")
    assert req["tools"][0]["name"] == "get_weather"
    assert req["messages"][0] == {"role": "system", "content": "Be a weather desk."}
    call = {"id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}}
    chat.answered(req, {"role": "assistant", "content": "", "tool_calls": [call]})
    assert chat.messages[0]["role"] == "user", "the system prompt is not history"
    assert chat.pending_calls() == ["c1"]
    sent = chat.result("sunny")
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert chat.pending_calls() == []
    with pytest.raises(Ds4fError, match="no tool call waits"):
        chat.result("again")
    for body, what in (("{not json", "malformed JSON"), ('[{"type": "function", "function": {"name": "a b"}}]',
                                                         "function name")):
        tools.write_text(body)
        with pytest.raises(Ds4fError, match=what) as e:
            chat.load_tools(str(tools))
        assert str(tools) in str(e.value)
    with pytest.raises(Ds4fError, match="no such file"):
        chat.load_tools(str(tmp_path / "absent.json"))
    assert chat.load_tools("") == 0 and chat.tools == ()
    assert parse_command("/tools x.json").arg == "x.json" and parse_command("/system").arg == ""
    with pytest.raises(Ds4fError):
        parse_command("/result")


def test_a_tool_call_shows_as_a_call_never_as_dsml():
    from ds4f.console.widgets.chat import answer_text

    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    shown = answer_text("Let me look." + DSML_CALL, thinking=False, tools=tools).plain
    assert shown == 'Let me look.\n→ get_weather {"city": "Paris"}' and "DSML" not in shown
    half = answer_text("Let me look." + DSML_CALL[:40], thinking=False, done=False, tools=tools).plain
    assert half == "Let me look." and "DSML" not in half          # a block being written waits
    think = answer_text("I should call it" + DSML_CALL, thinking=True, tools=tools).plain   # no </think> first
    assert think == 'I should call it\n→ get_weather {"city": "Paris"}'
    broken = answer_text("Let me look." + DSML_CALL[:40], thinking=False, tools=tools).plain
    assert broken == "Let me look." + DSML_CALL[:40], "a block that never closed is the answer's text"
    # a turn that offered no tools: what the model writes is its text, DSML included
    assert answer_text("Let me look." + DSML_CALL, thinking=False).plain == "Let me look." + DSML_CALL


TOOL_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"


async def submit(pilot, line: str) -> None:
    """The prompt line set to `line` and sent (a command's JSON is awkward to type key by key)."""
    prompt = pilot.app.dashboard.query_one(PromptInput)
    prompt.value = line
    await pilot.press("enter")
    await pilot.pause(0.1)


@async_test
async def test_the_operator_offers_tools_and_answers_a_call(history_path, tmp_path):
    """On the model trained to call tools: /system and /tools as the script's, the question, the
    call in the transcript as a call, /result as the tool, the model's answer to it."""
    script = json.loads((TOOL_MODEL / "script.json").read_text())
    case = next(c for c in script["cases"] if c["name"] == "weather_Paris")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": t} for t in script["tools"]]))
    app = make_app(TOOL_MODEL, history_path, gen=120)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("i")
        await pilot.pause(0.1)
        await submit(pilot, f"/system {script['system']}")
        await submit(pilot, f"/tools {tools}")
        assert "tools: get_weather, get_forecast" in transcript(app).plain
        before = app.controller.run
        await submit(pilot, case["messages"][0]["content"])
        await wait_for(pilot, lambda: app.controller.run is not before and app.controller.run.finished
                       and app._answer is None, 120, "the call")
        call = case["reply"]["tool_calls"][0]
        assert answers(app)[-1] == f"→ {call['name']} {json.dumps(call['arguments'])}"
        assert "DSML" not in transcript(app).plain
        first = app.controller.run
        await submit(pilot, f"/result {case['results'][0]}")
        await wait_for(pilot, lambda: app.controller.run is not first and app.controller.run.finished
                       and app._answer is None, 120, "the answer to the result")
        assert answers(app)[-1] == case["final"]["content"]
        msgs = app.controller.run.config.messages
        assert msgs[0] == {"role": "system", "content": script["system"]}
        assert msgs[-1]["role"] == "tool" and msgs[-1]["content"] == case["results"][0]
