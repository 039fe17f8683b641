"""The prefix cache is exact under load: a server that serves varied conversations (several
clients at once, --parallel 4 and 1, speculation on and off, thinking on and off, with and without
tools, continued turns) answers a greedy request whose prefix it reuses exactly as a server without
the cache does, every time: the same generated ids and, where the run writes a state dump, the same
dump's sha256. States come from RAM, from the kv directory, and from that directory after a restart.

The model is the trained tool model (tests/fixtures/toolcall, its MTP layer lets speculation
engage). The servers run as `ds4f serve` does by default, the NVMe floor probe and the disk replay
after each run included. DS4F_PREFIX_STRESS=N multiplies the traffic and the repetitions (1 in
CI: every repetition can still fail)."""
from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest

from ds4f.engine.checkpoint.synth import MTP_SHARD
from ds4f.server.app import Server, ServerOptions
from server_helpers import Srv

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"
SCALE = max(1, int(os.environ.get("DS4F_PREFIX_STRESS", "1")))
CLIENTS = 4                       # concurrent clients of the varied traffic
TRAFFIC = 6 * SCALE               # varied requests per client and server
REPEATS = 4 * SCALE               # repetitions of each target after the traffic (more go during it)

pytestmark = pytest.mark.skipif(not (FIXTURE / MTP_SHARD).is_file(),
                                reason="tests/fixtures/toolcall has no trained MTP layer (tools/make_mtp_layer.py)")


def _script() -> dict:
    return json.loads((FIXTURE / "script.json").read_text(encoding="utf-8"))


SCRIPT = _script()
TOOLS = [{"type": "function", "function": t} for t in SCRIPT["tools"]]


def _case(name: str) -> dict:
    return next(c for c in SCRIPT["cases"] if c["name"] == name)


def _body(name: str, thinking: bool | None = None, tools: bool = True, max_tokens: int = 64) -> dict:
    case = _case(name)
    body = {"messages": [{"role": "system", "content": SCRIPT["system"]}] + case["messages"], "temperature": 0,
            "max_tokens": max_tokens, "thinking": case["thinking"] if thinking is None else thinking}
    if tools:
        body["tools"] = TOOLS
    return body


# The repeated requests: a tool call (thinking off) and its thinking-mode twin, whose prompts share
# all but their last token; every state either keeps at that prefix serves both.
TARGETS = {"call": _body("weather_Paris"), "think": _body("weather_Paris", thinking=True, max_tokens=48)}


@pytest.fixture()
def config(tmp_path) -> Path:
    """ds4f.toml as a default `ds4f serve` has it (the floor probe, and so each run's disk replay,
    on; kernel threads: all cores), with its own history and kv directory, and a compact state
    dump of each request (its sha256 says whether the hidden states were the same)."""
    path = tmp_path / "ds4f.toml"
    path.write_text(f'[engine]\nprobe_floor = true\n\n[history]\npath = "{tmp_path / "history.sqlite3"}"\n\n'
                    f'[kv]\ndir = "{tmp_path / "kv"}"\n\n[dump]\nserver = "compact"\n')
    return path


class _Server:
    def __init__(self, config: Path, **options) -> None:
        self.srv = Srv(Server(ServerOptions(model=str(FIXTURE), config_path=str(config), port=0, access_log=False,
                                            queue_size=32, **options)))

    def chat(self, body: dict) -> dict:
        """The completion, retried while the queue is full; with the run's generated ids and dump sha."""
        for _ in range(600):
            r = self.srv.request("POST", "/v1/chat/completions", body=body, timeout=300)
            if r.status != 429:
                break
            time.sleep(0.1)
        assert r.status == 200, r.body
        out = r.json()
        run = self.srv.get(f"/runs/{out['id'].split('-', 1)[1]}").json()
        assert run["state"] == "done", run
        out["_generated"] = run["report"]["generated"]
        out["_sha"] = run["state_sha256"]
        out["_spec"] = (run["report"]["summary"].get("spec") or {}).get("rounds", 0)
        return out

    def close(self) -> None:
        self.srv.close()


def _answer(out: dict) -> tuple:
    return tuple(out["_generated"]), out["_sha"]


def _same(got: dict, want: tuple, what: str) -> None:
    ids, sha = _answer(got)
    assert ids == want[0], f"{what}: generated {ids}, the server without the cache {want[0]}"
    if sha is not None and want[1] is not None:
        assert sha == want[1], f"{what}: state dump {sha[:12]}, the server without the cache {want[1][:12]}"


def _traffic(server: _Server, seed: int, targets: dict, seen: list, errors: list) -> None:
    """One client's varied conversations (a case, thinking toggled now and then, tools or not,
    a continued turn), with a target request now and then."""
    rng = random.Random(seed)
    try:
        for _ in range(TRAFFIC):
            case = rng.choice(SCRIPT["cases"])
            body = _body(case["name"], thinking=case["thinking"] if rng.random() < 0.7 else not case["thinking"],
                         tools=rng.random() < 0.75, max_tokens=rng.choice([6, 24, 48]))
            out = server.chat(body)
            seen.append(out["_spec"])
            if rng.random() < 0.4:             # the conversation goes on: its answer and a tool result
                message = out["choices"][0]["message"]
                body["messages"].append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")
                                         and v is not None})
                if message.get("tool_calls"):
                    body["messages"] += [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'}
                                         for c in message["tool_calls"]]
                else:
                    body["messages"].append({"role": "user", "content": "And tomorrow?"})
                seen.append(server.chat(body)["_spec"])
            if rng.random() < 0.3:
                name = rng.choice(sorted(targets))
                _same(server.chat(TARGETS[name]), targets[name], f"{name} during the traffic")
    except BaseException as exc:   # noqa: BLE001 (reported by the test's thread)
        errors.append(exc)


def _serve_and_repeat(server: _Server, targets: dict, seed: int) -> list[int]:
    """Varied traffic from CLIENTS clients, then REPEATS of each target; the spec rounds of the runs."""
    seen: list[int] = []
    errors: list = []
    clients = [threading.Thread(target=_traffic, args=(server, seed * 100 + i, targets, seen, errors))
               for i in range(CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(600)
    if errors:
        raise errors[0]
    for i in range(REPEATS):
        for name in sorted(targets):
            got = server.chat(TARGETS[name])
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (name, got["usage"])
            _same(got, targets[name], f"{name} repeat {i}")
    return seen


def test_a_reused_prefix_answers_as_the_server_without_the_cache(config):
    cold = _Server(config, parallel=1, reuse_prefix=False)
    try:
        targets = {name: _answer(cold.chat(body)) for name, body in TARGETS.items()}
    finally:
        cold.close()
    assert len(targets["call"][0]) > 8 and targets["call"] != targets["think"]
    assert all(sha for _, sha in targets.values()), "the runs wrote no state dump to compare"

    # several sequences stepping together (speculation steps plainly there), states in RAM and on disk
    batched = _Server(config, parallel=4, spec="auto")
    try:
        _serve_and_repeat(batched, targets, seed=1)
    finally:
        batched.close()

    # a restart on the same directory: the first reuse reads a state from disk; one sequence at a
    # time, speculating (the trained MTP layer's drafts are kept, so rounds run)
    alone = _Server(config, parallel=1, spec="auto")
    try:
        for name in sorted(targets):
            first = alone.chat(TARGETS[name])
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, first["usage"]
            _same(first, targets[name], f"{name} after the restart")
        rounds = _serve_and_repeat(alone, targets, seed=2)
        assert sum(rounds) > 0, "speculation never engaged"
    finally:
        alone.close()


def test_a_tool_turn_continues_the_state_of_the_answer_that_called(tmp_path):
    """An agent's tool turn (the assistant's tool call sent back as the client got it, then the
    tool's result) starts from the state the calling answer kept: all of that request and its
    answer but the last pick, also when the server restarted in between (the state from disk)."""
    import openai

    config = tmp_path / "ds4f.toml"
    config.write_text(f'[engine]\nprobe_floor = false\nkernel_threads = 1\n[history]\npath = "{tmp_path / "h.db"}"\n')
    tools = [{"type": "function", "function": t} for t in SCRIPT["tools"]]
    case = _case("weather_Paris")
    for restart in (False, True):
        kv = tmp_path / f"kv-{restart}"

        def serve():
            srv = Server(ServerOptions(model=str(FIXTURE), config_path=str(config), port=0, access_log=False,
                                       kv_dir=str(kv), parallel=1))
            srv.start()
            return srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)

        srv, client = serve()
        try:
            model = client.models.list().data[0].id
            messages = [{"role": "system", "content": SCRIPT["system"]}, *case["messages"]]
            first = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=64,
                                                   temperature=0)
            call = first.choices[0].message
            assert call.tool_calls, "the trained model calls the tool"
            if restart:
                srv.stop()
                srv, client = serve()
            messages += [call.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": case["results"][0]}]
            second = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=64,
                                                    temperature=0)
        finally:
            srv.stop()
        held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
        assert second.usage.prompt_tokens_details.cached_tokens == held, (restart, second.usage, held)
        assert second.choices[0].message.content == case["final"]["content"]
