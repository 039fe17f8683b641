"""`ds4f bench agent` on the tiny checkpoint, against a real server on loopback: the session's shape
and the facts its records must hold (no figure of speed is asserted): each thread's later requests
reuse all its previous request and answer held, across the restart too; a request writes one head
and the blocks of its new rows; the no-kv server gives the same answers."""
from __future__ import annotations

from ds4f.bench.agent import bench_agent, schedule


def _serve(model, tmp_path):
    """ds4f serve on loopback with one kernel thread, no NVMe probe, a history of its own."""
    from ds4f.server.app import Server, ServerOptions

    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[engine]\nprobe_floor = false\nkernel_threads = 1\n[history]\npath = "{tmp_path / "h.sqlite3"}"\n')

    def serve(kv_dir, reuse):
        server = Server(ServerOptions(model=str(model), config_path=str(cfg), host="127.0.0.1", port=0,
                                      access_log=False, kv_dir=str(kv_dir), reuse_prefix=reuse, parallel=1))
        server.start(timeout=60)
        return server

    return serve


def test_the_schedule_interleaves_the_subagents_and_restarts_half_way():
    order = schedule(5, 2)
    assert order.count("main") == 5 and order.count("sub1") == 2 and order.count("sub2") == 2
    assert order[:2] == ["main", "main"] and order.count("restart") == 1
    assert 3 <= order.index("restart") <= 7
    assert "restart" not in (order[0], order[-1])


def test_an_agent_session_reuses_each_threads_past_and_writes_its_new_rows_once(tiny_model, tmp_path):
    r = bench_agent(tiny_model, _serve(tiny_model, tmp_path), prefix_tokens=150, result_tokens=(20, 40), main_turns=4,
                    sub_turns=1, gen=4, compare=2)
    reqs = r["requests"]
    assert [q["thread"] for q in reqs] == [s for s in schedule(4, 1) if s != "restart"]
    assert any(q["after_restart"] for q in reqs) and not reqs[0]["after_restart"]
    for q in reqs:
        assert q["reused"] + q["computed"] == q["prompt_tokens"] and q["generated"] >= 1
        assert q["total_s"] >= q["ttft_s"] > 0 and q["tokens_s"] > 0 and q["dump_bytes"] == 0    # [dump] server: off
        if q["turn"] == 0:
            assert q["reusable"] == 0
            continue
        # all the thread's previous request fed and its answer's text (spelled as the ids kept), but the
        # answer's last token, which the previous run picked and never fed
        assert q["reused"] == q["reusable"] - 1, q
        assert q["heads"] == 1, q            # one head a request on disk (the end state), never the rows before
    first = reqs[0]
    assert first["heads"] == 2               # and a first request's system-prompt mark, shared by later ones
    assert [c["turn"] for c in r["no_kv"]] == [1, 2]
    for c in r["no_kv"]:
        # the no-kv server tokenizes the earlier answers' text; the kv server spells them as the ids the
        # kept states hold (what they were generated as): the same text, a few ids apart at most
        kv = next(q for q in reqs if q["thread"] == "main" and q["turn"] == c["turn"])
        assert abs(c["prompt_tokens"] - kv["prompt_tokens"]) <= 8 and c["total_s"] > 0
    t = r["totals"]
    assert t["reuse_of_reusable"] >= 0.99
    assert t["written_over_full"] < 0.10       # against full records of the computed tokens
    assert t["flash_written_bytes"] > 0 and t["flash_full_records_bytes"] > t["flash_written_bytes"]
