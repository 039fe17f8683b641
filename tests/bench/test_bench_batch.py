"""`ds4f bench batch`: its records, and the exactness it rests on: the batched runs' state dumps
are the turns' (each sequence the same whichever way it ran)."""
from __future__ import annotations

from ds4f.bench.batch import bench_batch
from ds4f.bench.engine import bench_scratch_dir


def test_bench_batch_measures_batched_against_turns_with_the_same_dumps(tiny_model):
    result = bench_batch(tiny_model, gen=4, counts=(1, 2))
    records = result["records"]
    assert [(r["cache"], r["sequences"]) for r in records] == [("warm", 1), ("warm", 2), ("cold", 1), ("cold", 2)]
    for r in records:
        for mode in ("turns", "batched"):
            m = r[mode]
            assert m["tokens"] == r["sequences"] * 4
            assert m["tokens_per_s"] > 0 and m["e2e_tokens_per_s"] > 0 and m["ttft_s"] > 0
        assert r["speedup"] == r["batched"]["tokens_per_s"] / r["turns"]["tokens_per_s"]
    two = records[1]
    assert two["batched"]["union_experts_per_layer"] >= 6       # at least one sequence's top-k
    for cache in ("warm", "cold"):
        for i in range(2):
            turns = (bench_scratch_dir() / f"batch-{cache}2turns-{i}.bin").read_bytes()
            batched = (bench_scratch_dir() / f"batch-{cache}2batched-{i}.bin").read_bytes()
            assert turns == batched, (cache, i)
    join = result["join"]
    assert join["ttft_s"] > 0 and join["bound_s"] == join["alone_ttft_s"] + join["step_s"]
