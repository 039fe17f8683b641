"""`ds4f bench chat` on the tiny checkpoint: its records' structure and the facts they must hold
(no figure of speed is asserted): later turns reuse the conversation, recompute reuses nothing,
a restart reuses from disk, and every reused turn writes the recomputed turn's state dump."""
from ds4f.bench.chat import MODES, bench_chat


def test_bench_chat_records_each_turn_with_and_without_reuse_and_a_restart(tiny_model):
    records = bench_chat(tiny_model, turns=2, gen=4)
    assert [(r["turn"], r["mode"]) for r in records] == [(1, "reuse"), (1, "recompute"), (2, "recompute"),
                                                        (2, "reuse"), (2, "restart")]
    assert {r["mode"] for r in records} == set(MODES)
    by = {(r["turn"], r["mode"]): r for r in records}
    assert by[1, "reuse"]["reused"] == 0
    assert all(r["reused"] == 0 for r in records if r["mode"] == "recompute")
    # turn two computes only what it adds: all that turn one fed (its prompt, its answer as its ids,
    # not the last pick) comes from the prefix cache
    assert by[2, "reuse"]["reused"] == by[1, "reuse"]["prompt_tokens"] + 4 - 1
    # the last turn again on a new engine: from the states on disk, as much as on the warm engine (a
    # request puts its end state on disk, the one the next turn continues)
    assert by[2, "restart"]["reused"] == by[2, "reuse"]["reused"] > 0
    for r in records:
        assert r["reused"] + r["computed"] == r["prompt_tokens"] and r["gb_read"] >= 0 and r["seconds"] > 0
        assert r["sha256"] == by[r["turn"], "recompute"]["sha256"]
        assert r["output"] == by[r["turn"], "recompute"]["output"]
    assert by[2, "reuse"]["cache_start"] == "warm" and by[2, "restart"]["cache_start"] == "cold"
