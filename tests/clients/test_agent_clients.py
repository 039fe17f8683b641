"""Agent clients from PyPI, unchanged, through `ds4f serve` on the tool-calling fixture
(tests/fixtures/toolcall: a tiny DeepSeek-V4 trained on the conversations of its script.json).

Each client asks the script's question ("What is the weather in Paris?") with the script's system
prompt and tools, as the client itself writes the request; the model calls get_weather({"city":
"Paris"}); the client sends the scripted result back its own way (its tool runner, its agent loop,
or its message types), and the final answer is the script's, word for word. The tiny model answers
exactly only the prompts it was trained on, so each client is given the system prompt and the tool
schemas verbatim; a client that cannot send them verbatim, or has no tool loop the script fits, is
tested for what it can do (one round trip) and says so.

Optional: each client's tests skip unless its package is importable. `pip install -e '.[clients]'`
installs all of them but two that cannot share its environment: aider (`aider-chat` pins openai
2.x, which the OpenAI Agents SDK refuses) and instructor (it pins jiter<0.15, which pydantic-ai's
openai>=3.31 refuses); give them a venv of their own with ds4f and pytest. Then `pytest
tests/clients`. The `openai` and `anthropic` SDKs are in the `test` extra, so their tests run with
the rest of the suite.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# litellm fetches its model price list from the network at import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")     # mini-swe-agent: a model it has no price for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import Srv  # noqa: E402

from ds4f.server.app import Server, ServerOptions  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"
SCRIPT = json.loads((FIXTURE / "script.json").read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in SCRIPT["cases"]}
CASE = CASES["weather_Paris"]
SYSTEM = SCRIPT["system"]
QUESTION = CASE["messages"][0]["content"]
CALL = (CASE["reply"]["tool_calls"][0]["name"], CASE["reply"]["tool_calls"][0]["arguments"])  # get_weather, Paris
RESULT = CASE["results"][0]
FINAL = CASE["final"]["content"]
OPENAI_TOOLS = [{"type": "function", "function": t} for t in SCRIPT["tools"]]
ANTHROPIC_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                   for t in SCRIPT["tools"]]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
THINK = CASES["think_weather_Paris"]      # thinking mode: the reasoning must go back with the call


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    if not (FIXTURE / "model.safetensors").is_file():
        pytest.skip("tests/fixtures/toolcall/model.safetensors is not built (tools/make_tool_model.py)")
    root = tmp_path_factory.mktemp("clients")
    config = root / "ds4f.toml"
    config.write_text(f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[history]\npath = "{root / "h.sqlite3"}"\n'
                      f'\n[kv]\ndir = "{root / "kv"}"\n')
    # a deepseek name: the OpenAI Agents SDK sends reasoning back only to a model whose name holds it
    server = Srv(Server(ServerOptions(model=str(FIXTURE), config_path=str(config), host="127.0.0.1", port=0,
                                      access_log=False, default_max_tokens=96,
                                      served_model_names=("deepseek-v4-toolcall",))))
    yield server
    server.close()


@pytest.fixture()
def model(srv) -> str:
    return srv.service.model_id


class Tools:
    """The script's tools as plain functions: what each call asked, the scripted result."""

    def __init__(self):
        self.calls = []

    def __call__(self, name: str, args: dict) -> str:
        self.calls.append((name, args))
        return RESULT if (name, args) == CALL else json.dumps({"error": "not in the script"})


def _needs(module: str):
    return pytest.importorskip(module)


# -- openai: chat completions and the Responses API --------------------------------------------------
@STREAM
def test_openai_chat_completions(srv, model, stream):
    openai = _needs("openai")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def ask():
        if not stream:
            return client.chat.completions.create(model=model, messages=messages, tools=OPENAI_TOOLS).choices[0].message
        with client.chat.completions.stream(model=model, messages=messages, tools=OPENAI_TOOLS) as s:
            return s.get_final_completion().choices[0].message

    first = ask()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.tool_calls] == [CALL]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT}]
    final = ask()
    assert not final.tool_calls and final.content == FINAL


@STREAM
def test_openai_responses(srv, model, stream):
    openai = _needs("openai")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    tools = [{"type": "function", **t} for t in SCRIPT["tools"]]
    items = [{"role": "user", "content": QUESTION}]

    def ask():
        kw = dict(model=model, instructions=SYSTEM, input=items, tools=tools, store=False)
        if not stream:
            return client.responses.create(**kw)
        with client.responses.stream(**kw) as s:
            return s.get_final_response()

    first = ask()
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [CALL]
    items += [o.model_dump(exclude_none=True) for o in first.output] + \
        [{"type": "function_call_output", "call_id": calls[0].call_id, "output": RESULT}]
    final = ask()
    assert final.output_text == FINAL and not [o for o in final.output if o.type == "function_call"]


# -- anthropic: messages.create, the stream, the beta tool runner ----------------------------------------
def _anthropic(srv):
    anthropic = _needs("anthropic")
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)


@STREAM
def test_anthropic_messages(srv, model, stream):
    client = _anthropic(srv)
    tools, messages = Tools(), [{"role": "user", "content": QUESTION}]
    for _ in range(4):
        kw = dict(model=model, max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages)
        if stream:
            with client.messages.stream(**kw) as s:
                reply = s.get_final_message()
        else:
            reply = client.messages.create(**kw)
        if reply.stop_reason != "tool_use":
            break
        messages += [{"role": "assistant", "content": reply.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": tools(b.name, b.input)}
                                                  for b in reply.content if b.type == "tool_use"]}]
    assert tools.calls == [CALL]
    assert reply.stop_reason == "end_turn" and [b.text for b in reply.content if b.type == "text"] == [FINAL]


def _beta_tools(tools: Tools):
    from anthropic import beta_tool

    def get_weather(city: str) -> str:
        return tools("get_weather", {"city": city})

    def get_forecast(city: str, days: int) -> str:
        return tools("get_forecast", {"city": city, "days": days})

    fns = {"get_weather": get_weather, "get_forecast": get_forecast}
    return [beta_tool(fns[t["name"]], name=t["name"], description=t["description"], input_schema=t["parameters"])
            for t in SCRIPT["tools"]]


def _run_tool_runner(srv, model, stream, **kw):
    client = _anthropic(srv)
    if not hasattr(client.beta.messages, "tool_runner"):
        pytest.skip("this anthropic SDK has no beta tool runner")
    tools = Tools()
    runner = client.beta.messages.tool_runner(model=model, max_tokens=200, system=SYSTEM, tools=_beta_tools(tools),
                                              messages=[{"role": "user", "content": QUESTION}], stream=stream, **kw)
    replies = [r.get_final_message() if stream else r for r in runner]
    return tools, replies


@STREAM
def test_anthropic_tool_runner(srv, model, stream):
    """The runner sending the whole conversation each turn (`thread=False`)."""
    import inspect

    client = _anthropic(srv)
    if "thread" not in inspect.signature(client.beta.messages.tool_runner).parameters:
        tools, replies = _run_tool_runner(srv, model, stream)      # an SDK before message threads: always whole
    else:
        tools, replies = _run_tool_runner(srv, model, stream, thread=False)
    assert tools.calls == [CALL]
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert [b.text for b in replies[-1].content if b.type == "text"] == [FINAL]


def test_anthropic_tool_runner_threaded(srv, model):
    tools, replies = _run_tool_runner(srv, model, False)
    assert tools.calls == [CALL] and [b.text for b in replies[-1].content if b.type == "text"] == [FINAL]


# -- litellm: the openai and anthropic providers ---------------------------------------------------------
@STREAM
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm(srv, model, provider, stream):
    litellm = _needs("litellm")
    litellm.telemetry = False
    if provider == "openai":
        kw = dict(model=f"openai/{model}", api_base=f"{srv.url}/v1")
    else:   # litellm's default max_tokens for a model it does not know is 128000: past what ds4f takes
        kw = dict(model=f"anthropic/{model}", api_base=srv.url, max_tokens=200)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def ask():
        r = litellm.completion(messages=messages, tools=OPENAI_TOOLS, api_key="none", stream=stream, **kw)
        if stream:
            r = litellm.stream_chunk_builder(list(r), messages=messages)
        return r.choices[0].message

    first = ask()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.tool_calls] == [CALL]
    messages += [first.model_dump(), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT}]
    final = ask()
    assert not final.tool_calls and final.content == FINAL


def test_litellm_thinking_sends_the_reasoning_back(srv, model):
    litellm = _needs("litellm")
    kw = dict(model=f"openai/{model}", api_base=f"{srv.url}/v1", api_key="none", tools=OPENAI_TOOLS,
              reasoning_effort="high")
    messages = [{"role": "system", "content": SYSTEM}] + THINK["messages"]
    first = litellm.completion(messages=messages, **kw).choices[0].message
    assert first.reasoning_content == THINK["reply"]["reasoning"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.tool_calls] == [CALL]
    messages += [first.model_dump(), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT}]
    final = litellm.completion(messages=messages, **kw).choices[0].message
    assert (final.reasoning_content, final.content) == (THINK["final"]["reasoning"], FINAL)


# -- LangChain ------------------------------------------------------------------------------------------
def _langchain_loop(llm, stream):
    """The script's loop through a LangChain chat model: (the calls the tools got, the final message)."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    def ask(messages):
        if not stream:
            return llm.invoke(messages)
        out = None
        for chunk in llm.stream(messages):
            out = chunk if out is None else out + chunk
        return out

    tools, messages = Tools(), [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    first = ask(messages)
    messages += [first] + [ToolMessage(tools(c["name"], c["args"]), tool_call_id=c["id"]) for c in first.tool_calls]
    final = ask(messages)
    return tools.calls, final


@STREAM
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_langchain_openai(srv, model, api, stream):
    lc = _needs("langchain_openai")
    llm = lc.ChatOpenAI(model=model, base_url=f"{srv.url}/v1", api_key="none", max_retries=0,
                        use_responses_api=api == "responses")
    calls, final = _langchain_loop(llm.bind_tools(OPENAI_TOOLS), stream)
    assert calls == [CALL]
    assert not final.tool_calls and final.text == FINAL


@STREAM
def test_langchain_anthropic(srv, model, stream):
    lc = _needs("langchain_anthropic")
    llm = lc.ChatAnthropic(model=model, base_url=srv.url, api_key="none", max_retries=0)
    calls, final = _langchain_loop(llm.bind_tools(ANTHROPIC_TOOLS), stream)
    assert calls == [CALL]
    assert not final.tool_calls and final.text == FINAL


# -- the OpenAI Agents SDK -----------------------------------------------------------------------------
@STREAM
@pytest.mark.parametrize("api", ["chat", "responses", "chat-thinking"])
def test_openai_agents(srv, model, api, stream):
    agents = _needs("agents")
    import openai
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)
    tools = Tools()

    def tool(t):
        async def invoke(ctx, args: str) -> str:
            return tools(t["name"], json.loads(args))
        return agents.FunctionTool(name=t["name"], description=t["description"], params_json_schema=t["parameters"],
                                   on_invoke_tool=invoke, strict_json_schema=False)   # the schema as written

    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    thinking = api.endswith("thinking")     # reasoning_effort; the reasoning goes back as reasoning_content
    case = THINK if thinking else CASE
    settings = agents.ModelSettings(reasoning=Reasoning(effort="high")) if thinking else agents.ModelSettings()
    agent = agents.Agent(name="weather", instructions=SYSTEM, tools=[tool(t) for t in SCRIPT["tools"]],
                         model=cls(model=model, openai_client=client), model_settings=settings)
    question = case["messages"][0]["content"]

    async def run():
        if not stream:
            return await agents.Runner.run(agent, question)
        result = agents.Runner.run_streamed(agent, question)
        async for _ in result.stream_events():
            pass
        return result

    assert asyncio.run(run()).final_output == FINAL
    assert tools.calls == [CALL]


# -- pydantic-ai ---------------------------------------------------------------------------------------
@STREAM
@pytest.mark.parametrize("api", ["chat", "responses", "anthropic", "chat-thinking"])
def test_pydantic_ai(srv, model, api, stream):
    pai = _needs("pydantic_ai")
    tools = Tools()

    def tool(t):
        def call(**args):
            return tools(t["name"], args)
        made = pai.Tool.from_schema(call, name=t["name"], description=t["description"], json_schema=t["parameters"])
        # strict unset, pydantic-ai makes an OpenAI tool whose schema allows it strict (additionalProperties:
        # false added): a prompt the tiny model never saw
        made.strict = False
        return made

    if api == "anthropic":
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider
        llm = AnthropicModel(model, provider=AnthropicProvider(base_url=srv.url, api_key="none"))
    else:
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider
        cls = OpenAIResponsesModel if api == "responses" else OpenAIChatModel
        llm = cls(model, provider=OpenAIProvider(base_url=f"{srv.url}/v1", api_key="none"))
    thinking = api.endswith("thinking")     # reasoning_effort; the reasoning goes back as reasoning_content
    question = (THINK if thinking else CASE)["messages"][0]["content"]
    agent = pai.Agent(llm, system_prompt=SYSTEM, tools=[tool(t) for t in SCRIPT["tools"]],
                      model_settings={"openai_reasoning_effort": "high"} if thinking else None)

    async def run_stream():
        async with agent.run_stream(question) as result:
            return await result.get_output()

    output = asyncio.run(run_stream()) if stream else agent.run_sync(question).output
    assert output == FINAL and tools.calls == [CALL]


# -- instructor (its tool mode: the answer is the call's arguments) ---------------------------------------
def test_instructor_tools_mode(srv, model):
    """instructor's TOOLS mode forces a call of the response model's function (tool_choice naming it).
    The schema is the script's, verbatim: instructor writes a pydantic model's schema with `title`s,
    a prompt the tiny model never saw (its ANTHROPIC_TOOLS mode sends the whole model schema, titles
    included, so it is not tested here)."""
    instructor = _needs("instructor")
    import openai
    from pydantic import BaseModel, Field

    params = SCRIPT["tools"][0]["parameters"]

    class get_weather(BaseModel):  # noqa: N801 (the function's name is the class's)
        """Current weather in a city"""
        city: str = Field(description="City name")

        @classmethod
        def model_json_schema(cls, *args, **kw):
            return {"title": "get_weather", "description": "Current weather in a city", **json.loads(json.dumps(params))}

    client = instructor.from_openai(openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    got = client.chat.completions.create(model=model, response_model=get_weather, max_retries=0,
                                         messages=[{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": QUESTION}])
    assert ("get_weather", got.model_dump()) == CALL


# -- llm (Simon Willison's): its chain runs the tools ------------------------------------------------------
@STREAM
@pytest.mark.parametrize("api", ["Chat", "Responses"])
def test_llm(srv, model, api, stream, tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    llm = _needs("llm")
    from llm.default_plugins import openai_models

    tools = Tools()

    def impl(name):
        return lambda **args: tools(name, args)

    cls = getattr(openai_models, api)
    chat = cls("ds4f", model_name=model, api_base=f"{srv.url}/v1", key="none", supports_tools=True, can_stream=True)
    chain = chat.chain(QUESTION, system=SYSTEM, stream=stream,
                       tools=[llm.Tool(name=t["name"], description=t["description"], input_schema=t["parameters"],
                                       implementation=impl(t["name"])) for t in SCRIPT["tools"]])
    assert chain.text() == FINAL and tools.calls == [CALL]


# -- smolagents: one round trip -------------------------------------------------------------------------
@pytest.mark.parametrize("cls_name", ["OpenAIModel", "LiteLLMModel"])
def test_smolagents_tool_call(srv, model, cls_name):
    """smolagents' model call with the tools returns the scripted call. Its agents cannot run the
    script's loop: they send their own system prompt, add a final_answer tool, force a call every
    turn (tool_choice required) and send a result back as a user message ("Observation: ...")."""
    smolagents = _needs("smolagents")
    from smolagents.models import ChatMessage, MessageRole

    class GetWeather(smolagents.Tool):
        name, description, output_type = "get_weather", "Current weather in a city", "string"
        inputs = {"city": {"type": "string", "description": "City name"}}

        def forward(self, city):
            return RESULT

    class GetForecast(smolagents.Tool):
        # smolagents wants a description of every input: this one's schema is not the script's
        name, description, output_type = "get_forecast", "Weather forecast for the next days", "string"
        inputs = {"city": {"type": "string", "description": "City"}, "days": {"type": "integer", "description": "Days"}}

        def forward(self, city, days):
            return "{}"

    if cls_name == "OpenAIModel":
        llm = smolagents.OpenAIModel(model_id=model, api_base=f"{srv.url}/v1", api_key="none")
    else:
        llm = smolagents.LiteLLMModel(model_id=f"openai/{model}", api_base=f"{srv.url}/v1", api_key="none")
    out = llm.generate([ChatMessage(role=MessageRole.SYSTEM, content=[{"type": "text", "text": SYSTEM}]),
                        ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": QUESTION}])],
                       tools_to_call_from=[GetWeather(), GetForecast()])
    assert [(c.function.name, json.loads(c.function.arguments) if isinstance(c.function.arguments, str)
             else c.function.arguments) for c in out.tool_calls] == [CALL]


# -- mini-swe-agent: one round trip ---------------------------------------------------------------------
def test_mini_swe_agent_round_trip(srv, model):
    """mini-swe-agent's model offers its one tool, bash, and takes only bash calls: the tiny model,
    never taught bash, can only answer the script's greeting, which mini-swe-agent refuses as a
    format error (no tool call) after keeping the answer; the answer is the script's."""
    _needs("minisweagent")
    from minisweagent.exceptions import FormatError
    from minisweagent.models.litellm_model import LitellmModel

    hello = CASES["hello"]
    llm = LitellmModel(model_name=f"openai/{model}", model_kwargs={"api_base": f"{srv.url}/v1", "api_key": "none"},
                       cost_tracking="ignore_errors")
    with pytest.raises(FormatError) as caught:
        llm.query([{"role": "system", "content": SYSTEM}] + hello["messages"])
    response = caught.value.messages[0]["extra"]["response"]
    assert response["choices"][0]["message"]["content"] == hello["reply"]["content"]


# -- aider: one headless round trip ----------------------------------------------------------------------
def test_aider_message(srv, model, tmp_path):
    """aider --message: its own prompts (edit formats, no tools), streamed chat completions. aider does
    not ask /v1/models for the context: it takes litellm's table (--model-metadata-file for a model
    litellm does not know)."""
    if importlib.util.find_spec("aider") is None:
        pytest.skip("aider-chat is not installed (it needs a venv of its own: it pins openai 2.x)")
    before = srv.service.runs_started
    metadata = tmp_path / "meta.json"
    metadata.write_text(json.dumps({f"openai/{model}": {"max_input_tokens": 32768, "max_output_tokens": 8192,
                                                        "litellm_provider": "openai", "mode": "chat",
                                                        "input_cost_per_token": 0, "output_cost_per_token": 0}}))
    env = {**os.environ, "HOME": str(tmp_path), "OPENAI_API_BASE": f"{srv.url}/v1", "OPENAI_API_KEY": "none"}
    out = subprocess.run([sys.executable, "-m", "aider", "--model", f"openai/{model}", "--message", QUESTION,
                          "--model-metadata-file", str(metadata), "--yes-always", "--no-git", "--no-check-update",
                          "--no-show-model-warnings", "--analytics-disable", "--no-pretty", "--no-fancy-input"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Tokens:" in out.stdout and srv.service.runs_started > before


# -- Claude Code, through claude-agent-sdk's bundled CLI: one turn ------------------------------------------
def test_claude_agent_sdk_turn(srv, model, tmp_path):
    """A turn of Claude Code (the CLI claude-agent-sdk bundles) on the Messages API, its system prompt
    replaced and its built-in tools off: its default prompt (24k tokens) is past the fixture's use, and
    a tool of its own is `mcp__server__name`, not the script's. The request is Claude Code's: cache
    marks, metadata, context_management, output_config, max_tokens 32000."""
    sdk = _needs("claude_agent_sdk")
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "none",
           "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "MAX_THINKING_TOKENS": "0"}
    options = sdk.ClaudeAgentOptions(system_prompt=SYSTEM, tools=[], max_turns=1, env=env, cwd=str(tmp_path),
                                     model=model)
    before = srv.service.runs_started

    async def run():
        return [m async for m in sdk.query(prompt=CASES["hello"]["messages"][0]["content"], options=options)]

    messages = asyncio.run(run())
    result = [m for m in messages if isinstance(m, sdk.ResultMessage)]
    assert len(result) == 1 and result[0].subtype == "success" and not result[0].is_error, messages
    assert [m for m in messages if isinstance(m, sdk.AssistantMessage)]
    assert srv.service.runs_started > before
