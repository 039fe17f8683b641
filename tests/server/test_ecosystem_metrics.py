"""What the ecosystem's monitors read, against a real `ds4f serve` on the tiny model: vLLM's metric
names (their types, labels and buckets, and counts that add up to the requests made), llama-server's
GET /slots, the Grafana dashboard's queries, and the real tools from PyPI where they are installed
(the `monitors` extra: vllmstat, vllmpytop, vllm-top, vllm-mon, llamastat) and promtool (Debian's
`prometheus` package). A test whose tool is not installed skips."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ds4f.server.app import Server, ServerOptions

from server_helpers import Srv

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ds4f.json"
NAME = "deepseek-v4-flash"          # the served model name: vllm:*'s model_name label
PARALLEL = 2
SYSTEM = [{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "Hello there, how are you?"}]

# vLLM 0.20's PrometheusStatLogger: the buckets of its histograms of seconds
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
           1920.0, 7680.0]
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:request_success", "vllm:num_preemptions", "vllm:prompt_tokens_cached",
            "vllm:prompt_tokens_by_source")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
HISTOGRAMS = {"vllm:time_to_first_token_seconds": TTFT, "vllm:inter_token_latency_seconds": ITL,
              "vllm:request_time_per_output_token_seconds": ITL, "vllm:e2e_request_latency_seconds": REQUEST,
              "vllm:request_queue_time_seconds": REQUEST, "vllm:request_inference_time_seconds": REQUEST,
              "vllm:request_prefill_time_seconds": REQUEST, "vllm:request_decode_time_seconds": REQUEST,
              "vllm:request_prompt_tokens": None, "vllm:request_generation_tokens": None}
PER_REQUEST = [h for h in HISTOGRAMS if h not in ("vllm:time_to_first_token_seconds",
                                                  "vllm:inter_token_latency_seconds")]


# -- the server and what it was asked --------------------------------------------------------------
def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, sample: str | None = None, **labels) -> float:
    fam = fams[name]
    want = sample or (name + "_total" if fam.type == "counter" else name)
    found = [s.value for s in fam.samples if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, want, labels)
    return found[0]


def scrape(srv: Srv) -> str:
    r = srv.get("/metrics")
    assert r.status == 200
    return r.body.decode()


@contextlib.contextmanager
def long_run(srv: Srv, gen: int = 2000):
    """An operator's run on token ids (it does not stop at the end-of-sentence token), running
    while the block runs, then cancelled: a request that ends `abort`."""
    r = srv.post_run(gen=gen, prompt=[0, 5, 9])
    assert r.status == 202, r.body
    run_id = r.json()["id"]
    srv.wait_tokens(run_id, 4)        # its prompt read and its first tokens generated
    try:
        yield run_id
    finally:
        srv.request("DELETE", f"/runs/{run_id}")
        srv.wait_state(run_id)
        deadline = time.monotonic() + 30
        while any(t.run_id == run_id for t in srv.service.queue.holders):    # its watcher hands the slot on
            assert time.monotonic() < deadline, "the cancelled run kept its slot"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ecosystem")
    config = root / "ds4f.toml"
    config.write_text(f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[history]\npath = "{root / "h.sqlite3"}"\n'
                      f'\n[kv]\ndir = "{root / "kv"}"\n')
    srv = Srv(Server(ServerOptions(model=str(tiny_model), config_path=str(config), port=0, access_log=False,
                                   parallel=PARALLEL, served_model_names=(NAME,))))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def workload(server):
    """The requests made once: chats (the second continues from the first's prefix), a streamed chat,
    a text completion, and two operator runs seen while running (both slots taken), then cancelled.
    Returns what each reported, and /metrics and /slots as they were during and after."""
    srv = server
    answers = [srv.chat(messages=SYSTEM, max_tokens=6, temperature=0).json(),
               srv.chat(messages=SYSTEM, max_tokens=3, temperature=0).json()]
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0     # the prefix cache gave some
    chunks = list(srv.openai().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Count to three."}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    streamed = {"usage": chunks[-1].usage.model_dump(), "choices": [
        {"finish_reason": next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)}]}
    completion = srv.request("POST", "/v1/completions", body={"prompt": "Once upon a time", "max_tokens": 4,
                                                              "temperature": 0}).json()
    answers += [streamed, completion]
    srv.wait_idle()
    idle_slots = srv.get("/slots").json()
    out = {"answers": answers, "idle_slots": idle_slots}
    with long_run(srv) as first:
        before = srv.get(f"/runs/{first}").json()["live"]["tokens_done"]
        out["live"] = {"run": first, "metrics": scrape(srv), "slots": srv.get("/slots").json(),
                       "slots_free": srv.get("/slots?fail_on_no_slot=1").status}
        out["live"]["tokens_done"] = (before, srv.get(f"/runs/{first}").json()["live"]["tokens_done"])
        with long_run(srv) as second:
            out["both"] = {"metrics": scrape(srv), "slots_free": srv.get("/slots?fail_on_no_slot=1")}
            out["runs"] = [first, second]
    out["operator"] = [srv.get(f"/runs/{r}").json() for r in out["runs"]]
    out["metrics"] = scrape(srv)
    out["slots"] = srv.get("/slots").json()
    out["context"] = srv.get("/status").json()["limits"]["context"]
    return out


# -- vLLM's series --------------------------------------------------------------------------------
def test_vllm_series_have_vllms_types_labels_and_buckets(workload):
    fams = families(workload["metrics"])
    for name in COUNTERS:
        assert fams[name].type == "counter", name
    for name in GAUGES:
        assert fams[name].type == "gauge", name
    for name, buckets in HISTOGRAMS.items():
        assert fams[name].type == "histogram", name
        les = [float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"]
        assert les[-1] == math.inf, name
        if buckets is None:       # token counts: 1, 2, 5, 10, ... up to the context (vLLM's build_1_2_5_buckets)
            buckets = [m * 10 ** e for e in range(9) for m in (1, 2, 5) if m * 10 ** e <= workload["context"]]
        assert les[:-1] == buckets, name
    for fam in fams.values():
        if fam.name.startswith("vllm:"):
            for s in fam.samples:
                assert s.labels["model_name"] == NAME and s.labels["engine"] == "0", s
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}       # vLLM's FinishReason
    assert "deepseek-v4-flash" in fams["vllm:kv_cache_usage_perc"].samples[0].labels.values()
    assert "positions" in fams["vllm:kv_cache_usage_perc"].documentation       # says what it measures here


def test_vllm_counters_add_up_to_the_requests_made(workload):
    fams = families(workload["metrics"])
    answers, operator = workload["answers"], workload["operator"]
    usage = [a["usage"] for a in answers]
    assert all(op["state"] == "cancelled" and op["generated_tokens"] > 0 for op in operator)
    prompt = sum(u["prompt_tokens"] for u in usage) + sum(len(op["config"]["prompt"]) for op in operator)
    generated = sum(u["completion_tokens"] for u in usage) + sum(op["generated_tokens"] for op in operator)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert value(fams, "vllm:prompt_tokens") == prompt
    assert value(fams, "vllm:generation_tokens") == generated
    assert value(fams, "vllm:prompt_tokens_cached") == cached
    assert value(fams, "vllm:prompt_tokens_by_source", source="local_cache_hit") == cached
    assert value(fams, "vllm:prompt_tokens_by_source", source="local_compute") == prompt - cached
    assert value(fams, "vllm:prompt_tokens_by_source", source="external_kv_transfer") == 0
    # the prefix cache, in tokens as vLLM counts them: the text requests' prompts looked up, the
    # tokens found (operator runs start cold: no lookup)
    assert value(fams, "vllm:prefix_cache_queries") == sum(u["prompt_tokens"] for u in usage)
    assert value(fams, "vllm:prefix_cache_hits") == cached
    assert value(fams, "vllm:num_preemptions") == 0
    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    for reason in ("stop", "length"):
        assert value(fams, "vllm:request_success", finished_reason=reason) == reasons.count(reason), reason
    assert value(fams, "vllm:request_success", finished_reason="abort") == 2
    assert value(fams, "vllm:request_success", finished_reason="error") == 0
    requests = len(answers) + len(operator)
    for name in PER_REQUEST:
        assert value(fams, name, name + "_count") == requests, name
    counts = [u["completion_tokens"] for u in usage] + [op["generated_tokens"] for op in operator]
    assert value(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == requests
    assert value(fams, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == sum(
        n - 1 for n in counts)
    assert value(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt
    assert value(fams, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == generated
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(fams, name) == 0, name           # nothing runs now


def test_vllm_latencies_add_up_as_vllm_defines_them(workload):
    fams = families(workload["metrics"])

    def total(name):
        return value(fams, name, name + "_sum")
    # every request got a first token: time to first token = queue + prefill; decode = the gaps
    # between its tokens; inference = prefill + decode; end to end at least queue + inference
    ttft, queue = total("vllm:time_to_first_token_seconds"), total("vllm:request_queue_time_seconds")
    prefill, decode = total("vllm:request_prefill_time_seconds"), total("vllm:request_decode_time_seconds")
    assert ttft == pytest.approx(queue + prefill, abs=1e-6)
    assert decode == pytest.approx(total("vllm:inter_token_latency_seconds"), abs=1e-6)
    assert total("vllm:request_inference_time_seconds") == pytest.approx(prefill + decode, abs=1e-6)
    assert total("vllm:e2e_request_latency_seconds") >= queue + prefill + decode - 1e-6
    assert decode > 0 and ttft > 0
    for name in HISTOGRAMS:                      # a histogram's +Inf bucket holds all its observations
        assert value(fams, name, name + "_bucket", le="+Inf") == value(fams, name, name + "_count"), name


def test_gauges_follow_the_live_sequences(workload):
    live = families(workload["live"]["metrics"])
    assert value(live, "vllm:num_requests_running") == 1
    assert value(live, "vllm:num_requests_waiting") == 0
    lo, hi = workload["live"]["tokens_done"]
    held = PARALLEL * workload["context"]
    # its positions over both slots' (a record or two may be logged and not yet handed to the loop)
    assert (lo - 4) / held <= value(live, "vllm:kv_cache_usage_perc") <= hi / held
    both = families(workload["both"]["metrics"])
    assert value(both, "vllm:num_requests_running") == 2
    assert value(both, "vllm:kv_cache_usage_perc") > value(live, "vllm:kv_cache_usage_perc")


# -- GET /slots ----------------------------------------------------------------------------------
def test_slots_answer_llama_servers_shape(server, workload):
    context = workload["context"]
    idle = workload["idle_slots"]
    assert [s["id"] for s in idle] == list(range(PARALLEL))
    assert not any(s["is_processing"] for s in idle)
    assert idle[0]["id_task"] >= 0 and idle[0]["next_token"][0]["has_next_token"] is False   # its last task
    slots = workload["live"]["slots"]
    busy = [s for s in slots if s["is_processing"]]
    assert len(busy) == 1 and len(slots) == PARALLEL
    s = busy[0]
    assert s["run_id"] == workload["live"]["run"] and s["n_ctx"] == context and s["speculative"] is False
    assert isinstance(s["id_task"], int) and s["n_prompt_tokens"] == 3 and s["n_prompt_tokens_cache"] == 0
    assert s["n_prompt_tokens_processed"] == 3          # the whole prompt read: it generates
    (nt,) = s["next_token"]
    assert nt["has_next_token"] is True and nt["n_decoded"] > 0 and nt["n_remain"] == 2000 - nt["n_decoded"]
    assert s["params"]["n_predict"] == 2000 and s["params"]["max_tokens"] == 2000
    assert {"temperature", "top_k", "top_p", "min_p", "seed", "stop"} <= set(s["params"])
    assert isinstance(s["prompt"], str) and isinstance(s["generated"], str)
    assert workload["live"]["slots_free"] == 200
    full = workload["both"]["slots_free"]               # llama-server's ?fail_on_no_slot: 503 when none is free
    assert full.status == 503 and full.error()["code"] == "unavailable_error"
    after = workload["slots"]
    assert not any(s["is_processing"] for s in after)
    assert {s["run_id"] for s in after} == set(workload["runs"])    # each slot shows the last task it held
    assert all(s["next_token"][0]["has_next_token"] is False for s in after)
    assert server.get("/slots?id=1").status == 400
    listed = {(e["method"], e["path"]) for e in server.get("/").json()["endpoints"]}
    assert ("GET", "/slots") in listed


# -- the Grafana dashboard ------------------------------------------------------------------------
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "group", "inf", "nan"}


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression (or a Grafana label_values() query) reads."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                  # strings
    e = re.sub(r"\{[^}]*\}", "", e)                                # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                               # ranges
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", "", e)     # numbers
    e = re.sub(r",\s*[A-Za-z_]\w*\s*\)", ")", e) if e.startswith("label_values") else e   # its label argument
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", e):
        if re.match(r"\s*\(", e[m.end():]) or m.group().lower() in PROMQL_WORDS:
            continue                                               # a function, an aggregation, a keyword
        names.add(m.group())
    return names


def test_metric_names_are_read_out_of_promql():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
                        '{model_name="$m", instance=~"$i"}[$__rate_interval])))') == {
        "vllm:time_to_first_token_seconds_bucket"}
    assert metric_names("rate(a_total[5m]) / (rate(b_total[5m]) + rate(c_total[5m])) * 1e9") == {
        "a_total", "b_total", "c_total"}
    assert metric_names("label_values(vllm:num_requests_running{x=\"y\"}, instance)") == {"vllm:num_requests_running"}


def test_the_dashboard_reads_only_series_a_server_serves(workload):
    served = {s.name for f in families(workload["metrics"]).values() for s in f.samples}
    dash = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "model_name", "instance"}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    read = set().union(*(metric_names(e) for e in dashboard_queries()))
    assert any(n.startswith("vllm:") for n in read) and any(n.startswith("ds4f_") for n in read)
    assert {"process_resident_memory_bytes", "ds4f_read_bytes_total", "ds4f_prefix_cache_ram_bytes",
            "vllm:kv_cache_usage_perc"} <= read
    assert read <= served, sorted(read - served)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_reads_the_dashboards_queries_as_promql(tmp_path):
    exe = promtool()
    rules = [{"record": f"ds4f:dashboard_query_{i}",
              "expr": e.replace("$__rate_interval", "5m").replace("$model_name", "m").replace("$instance", "i")}
             for i, e in enumerate(dashboard_queries()) if not e.startswith("label_values")]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))   # JSON is YAML
    done = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_checks_the_exposition(workload):
    exe = promtool()
    done = subprocess.run([exe, "check", "metrics"], input=workload["metrics"], capture_output=True, text=True,
                          timeout=60)
    # 3: lint problems only (1 would be a text that does not parse). Prometheus' lint keeps colons for
    # recording rules, and vLLM's names have them: every problem is that one, on a vllm: name
    assert done.returncode in (0, 3), done.stdout + done.stderr
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert problems and all(p.startswith("vllm:") and p.endswith("metric names should not contain ':'")
                            for p in problems), problems


# -- the monitors from PyPI ------------------------------------------------------------------------
def tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed (pip install 'ds4f[monitors]')")
    return path


def run_tool(*argv: str, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_vllmstat_reads_the_figures(server, workload):
    exe = tool("vllmstat")
    with long_run(server):
        snap = json.loads(run_tool(exe, "-u", server.url, "--once", "--json", "--no-gpu", "-i", "0.5"))
        fams = families(scrape(server))
    assert snap["connected"] and snap["model_names"] == [NAME] and snap["max_model_len"] == workload["context"]
    assert snap["running"] == 1 and snap["waiting"] == 0 and 0 < snap["kv_usage"] < 1
    hits, queries = value(fams, "vllm:prefix_cache_hits"), value(fams, "vllm:prefix_cache_queries")
    assert snap["prefix_hit_lifetime"] == pytest.approx(hits / queries)
    assert snap["cached_tokens_total"] == value(fams, "vllm:prompt_tokens_cached")
    done = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples
            if s.name == "vllm:request_success_total"}
    assert snap["finish_reasons"] == pytest.approx({k: v / sum(done.values()) for k, v in done.items()})
    assert snap["ttft"]["p50"] is not None and snap["e2e"]["p90"] is not None
    assert snap["prompt_len"]["mean"] == pytest.approx(
        value(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum")
        / value(fams, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count"))


def test_vllmpytop_reads_the_figures(server, workload):
    exe = tool("vllmpytop")
    server.wait_idle()
    snap = json.loads(run_tool(exe, "--url", server.url, "--no-gpu", "--dump-json", "--interval", "0.5"))
    fams = families(scrape(server))
    raw = snap["raw_vllm"]
    assert snap["reachable"] and snap["model_name"] == NAME
    assert raw["prompt_tokens_total"] == value(fams, "vllm:prompt_tokens")
    assert raw["generation_tokens_total"] == value(fams, "vllm:generation_tokens")
    assert raw["prefix_cache_hit_rate"] == pytest.approx(
        value(fams, "vllm:prefix_cache_hits") / value(fams, "vllm:prefix_cache_queries"))
    assert snap["vllm_info"]["request_success_total"] == sum(
        s.value for s in fams["vllm:request_success"].samples if s.name == "vllm:request_success_total")
    assert raw["num_requests_running"] == 0 and raw["kv_cache_usage_perc"] == 0


def test_vllm_top_reads_the_figures(server, workload):
    exe = tool("vllm-top")
    server.wait_idle()
    out = run_tool(exe, "--host", "127.0.0.1", "--port", str(server.port), "--snapshot")
    fams = families(scrape(server))
    assert f"Model: {NAME}" in out
    assert re.search(rf"Total Prompt Tokens:\s+{int(value(fams, 'vllm:prompt_tokens'))}\b", out), out
    assert re.search(rf"Total Generation Tokens:\s+{int(value(fams, 'vllm:generation_tokens'))}\b", out), out
    e2e = value(fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
    assert re.search(rf"Total Requests:\s+{int(e2e)}\b", out), out


def test_vllm_mon_reads_the_figures(server, workload):
    collector = pytest.importorskip("vllm_dash.collector", reason="vllm-mon is not installed")
    server.wait_idle()

    async def collect():
        c = collector.MetricsCollector(server.url)
        try:
            return await c.collect()
        finally:
            await c.close()
    computed, records = asyncio.run(collect())
    fams = families(scrape(server))
    assert computed.connected and records
    assert computed.prompt_tokens == value(fams, "vllm:prompt_tokens")
    assert computed.success_abort == value(fams, "vllm:request_success", finished_reason="abort")
    assert computed.total_requests == sum(value(fams, "vllm:request_success", finished_reason=r)
                                          for r in ("stop", "length", "abort"))
    assert computed.prefix_cache_hit_rate == pytest.approx(
        100 * value(fams, "vllm:prefix_cache_hits") / value(fams, "vllm:prefix_cache_queries"))


def test_llamastat_reads_the_slots(server, workload):
    exe = tool("llamastat")
    with long_run(server) as run_id:
        snap = json.loads(run_tool(exe, "-u", server.url, "--once", "--json", "--no-host", "-i", "0.5"))
    assert snap["ok"] and snap["health"] == "ok" and snap["model_alias"] == NAME
    assert snap["slots_endpoint"] and len(snap["slots"]) == PARALLEL and snap["metrics_available"]
    assert snap["running"] == 1 and snap["ctx_total"] == PARALLEL * workload["context"]
    (busy,) = [s for s in snap["slots"] if s["is_processing"]]
    assert busy["phase"] == "gen" and busy["n_decoded"] > 0 and busy["n_remain"] == 2000 - busy["n_decoded"]
    assert busy["n_ctx"] == workload["context"] and busy["ctx_used"] == 3 + busy["n_decoded"]
    assert snap["gen_tokens_session"] > 0          # tokens decoded between its two polls
    assert run_id
