"""`ds4f serve --parallel N`: several OpenAI clients streaming at once, their sequences decoded
together in one forward pass per step; each gets the answer (and the run its state dump) it
gets alone. /metrics and /status say what the batch holds; --parallel beyond the memory plan,
0 or negative is refused with the figure."""
from __future__ import annotations

import threading

import pytest

from ds4f.api import Ds4fError
from ds4f.server.app import Server, ServerOptions

from server_helpers import start, serve_config  # noqa: F401  (fixtures)

PROMPTS = ["Hello there, how are you?", "Name three colours.", "What is two plus two?", "Tell me a story."]


def _stream(client, prompt: str, out: dict, key, **kw) -> None:
    text, ids = [], set()
    for chunk in client.chat.completions.create(model="ds4f", messages=[{"role": "user", "content": prompt}],
                                                stream=True, **kw):
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    out[key] = ("".join(text), ids.pop())


def test_four_streaming_clients_get_their_own_answers_decoded_together(start):
    srv = start(parallel=4, reuse_prefix=False, dump="compact")
    client = srv.openai()
    kw = [dict(max_tokens=10, temperature=0), dict(max_tokens=7, temperature=0),
          dict(max_tokens=12, temperature=0.8, seed=5), dict(max_tokens=4, temperature=0)]
    alone: dict = {}
    for i, (p, k) in enumerate(zip(PROMPTS, kw)):
        _stream(client, p, alone, i, **k)
        srv.wait_idle()
    together: dict = {}
    threads = [threading.Thread(target=_stream, args=(client, p, together, i), kwargs=k)
               for i, (p, k) in enumerate(zip(PROMPTS, kw))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(together) == [0, 1, 2, 3]
    srv.wait_idle()
    for i in range(4):
        assert together[i][0] == alone[i][0], i
        a = srv.get(f"/runs/{alone[i][1].split('-', 1)[1]}").json()
        b = srv.get(f"/runs/{together[i][1].split('-', 1)[1]}").json()
        assert a["state_sha256"] and b["state_sha256"] == a["state_sha256"], i
    batch = srv.get("/status").json()["batch"]
    assert batch["parallel"] == 4 and batch["shared_steps"] > 0, batch
    metrics = srv.get("/metrics").body.decode()
    assert "ds4f_batch_parallel 4.0" in metrics
    assert 'ds4f_batch_capped{reason="none"}' in metrics or 'ds4f_batch_capped{reason="union_cost"} 1.0' in metrics
    shared = [line for line in metrics.splitlines() if line.startswith("ds4f_batch_shared_steps_total")]
    assert shared and float(shared[0].split()[-1]) > 0, shared


def test_a_second_client_streams_while_the_first_does(start):
    """The second client's tokens arrive while the first is still streaming: it joined the
    steps, it did not wait in line for the first to end."""
    srv = start(parallel=2, reuse_prefix=False)
    client = srv.openai()
    seen: list = []
    lock = threading.Lock()

    def stream(i, n):
        for chunk in client.chat.completions.create(model="ds4f", messages=[{"role": "user", "content": PROMPTS[i]}],
                                                    stream=True, max_tokens=n, temperature=0):
            if chunk.choices and chunk.choices[0].delta.content:
                with lock:
                    seen.append(i)

    first = threading.Thread(target=stream, args=(0, 60))
    first.start()
    while True:                        # the first is streaming
        with lock:
            if seen:
                break
        assert first.is_alive(), "the first client ended before streaming"
    second = threading.Thread(target=stream, args=(1, 3))
    second.start()
    second.join(60)
    first.join(120)
    assert 1 in seen
    last_second = max(i for i, who in enumerate(seen) if who == 1)
    assert 0 in seen[last_second:], "the second client's answer came only after the first had ended"


@pytest.mark.parametrize("parallel, says", [(0, "between 1 and"), (-2, "between 1 and"), (65, "between 1 and")])
def test_parallel_out_of_range_is_refused(tiny_model, serve_config, parallel, says):
    with pytest.raises(Ds4fError, match=says):
        ServerOptions(model=str(tiny_model), config_path=str(serve_config), parallel=parallel).check()


def test_parallel_beyond_the_memory_plan_is_refused_with_the_figure(tiny_model, tmp_path, monkeypatch):
    """A preset whose context makes each sequence's KV cache large (about 130 MiB on the tiny
    model), on a machine of 6 GiB: 64 of them do not fit, a few do, and auto picks what fits."""
    import types

    from ds4f.server import service

    monkeypatch.setattr(service.psutil, "virtual_memory", lambda: types.SimpleNamespace(total=6 << 30))
    config = tmp_path / "ds4f.toml"
    config.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\npreset = "big"\n\n'
                      f'[history]\npath = "{tmp_path / "h.sqlite3"}"\n\n[kv]\nenabled = false\n\n'
                      '[presets.big]\npinned_layers = "all"\ncache = "25%"\ncontext = 1048576\nprefill_chunk = 16\n')
    with pytest.raises(Ds4fError, match=r"--parallel 64: 64 sequences plan .* at most (\d+) fit") as err:
        Server(ServerOptions(model=str(tiny_model), config_path=str(config), port=0, parallel=64))
    assert err.value.param == "parallel"
    most = int(err.value.message.rsplit("at most ", 1)[1].split()[0])
    assert 4 <= most < 64
    fits = Server(ServerOptions(model=str(tiny_model), config_path=str(config), port=0, parallel=most))
    assert fits.service.parallel == most
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nparallel = -1\n')
    with pytest.raises(Ds4fError, match="server.parallel: must be between 0"):
        Server(ServerOptions(model=str(tiny_model), config_path=str(bad), port=0))


def test_a_client_that_disconnects_leaves_and_the_others_are_unharmed(start):
    srv = start(parallel=2, reuse_prefix=False)
    client = srv.openai()
    alone: dict = {}
    _stream(client, PROMPTS[1], alone, 0, max_tokens=40, temperature=0)
    srv.wait_idle()
    gone = client.chat.completions.create(model="ds4f", messages=[{"role": "user", "content": PROMPTS[0]}],
                                          stream=True, max_tokens=4000, temperature=0)
    first = next(iter(gone))
    together: dict = {}
    other = threading.Thread(target=_stream, args=(client, PROMPTS[1], together, 0),
                             kwargs=dict(max_tokens=40, temperature=0))
    other.start()
    for _i, _chunk in zip(range(3), gone):
        pass
    gone.close()                                   # the client goes away mid-stream
    other.join(120)
    assert together[0][0] == alone[0][0]
    srv.wait_idle()
    left = srv.get(f"/runs/{first.id.split('-', 1)[1]}").json()
    assert left["state"] == "cancelled" and left["tokens_done"] < 4000, left
