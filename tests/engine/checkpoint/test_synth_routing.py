"""A synthetic checkpoint routes like a real model: skewed expert use, locality an LRU cache can use.

The routing is measured the way the engine will produce it: a numpy reimplementation of
the MoE trunk (no attention, as in the first engine) runs the checkpoint's sample prompts,
each followed by greedy continuation, reading every tensor through open_checkpoint.
"""
from collections import OrderedDict

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.formats import dequantize_mxfp4
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.model.reference import decode_fp8
from ds4f.engine.checkpoint.synth import synth_checkpoint


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


class NumpyMoE:
    """DeepSeek-V4 MoE trunk in float32/64 numpy: the reference routing rule."""

    def __init__(self, ck):
        self.g = g = ck.geometry
        self.layers, self.raw = [], []
        for L in range(g.n_layers):
            t = ck.layer_tensors(L)
            self.raw.append(t)
            self.layers.append({k: (v.astype(np.float32) if v.dtype.kind == "V" or str(v.dtype) == "bfloat16" else v)
                                for k, v in t.items()})
        self.embed = ck.global_tensor("embed.weight").astype(np.float32)
        self.head = ck.global_tensor("head.weight").astype(np.float32)
        self.norm = ck.global_tensor("norm.weight").astype(np.float32)
        buf = np.zeros(ck.slot_nbytes, np.uint8)
        self.experts = {}
        for L in range(g.n_layers):
            for e in range(g.n_experts):
                ck.read_expert(L, e, buf)
                w = {}
                for name in ("w1", "w3", "w2"):
                    wo, ws = ck.expert_layout[name + ".weight"]
                    so, ss = ck.expert_layout[name + ".scale"]
                    codes = buf[wo:wo + int(np.prod(ws))].reshape(ws)
                    scales = buf[so:so + int(np.prod(ss))].reshape(ss)
                    w[name] = dequantize_mxfp4(codes, scales)
                self.experts[L, e] = w

    def route(self, L, x, tok):
        lt, g = self.layers[L], self.g
        scores = np.sqrt(np.logaddexp(0.0, lt["gate.weight"] @ x))
        if "gate.tid2eid" in lt:
            sel = lt["gate.tid2eid"][tok]
        else:
            sel = np.argsort(-(scores + lt["gate.bias"]), kind="stable")[: g.top_k]
        w = scores[sel] / scores[sel].sum() * g.routed_scaling_factor
        return sel, w

    def step(self, tok):
        g = self.g
        h = self.embed[tok].copy()
        chosen = []
        for L, lt in enumerate(self.layers):
            x = rmsnorm(h, lt["ffn_norm.weight"], g.rms_norm_eps)
            sel, w = self.route(L, x, tok)
            chosen.append(sel)
            y = np.zeros_like(h)
            for e, we in zip(sel, w):
                E = self.experts[L, int(e)]
                gate = np.minimum(E["w1"] @ x, g.swiglu_limit)
                up = np.clip(E["w3"] @ x, -g.swiglu_limit, g.swiglu_limit)
                y += E["w2"] @ (we * silu(gate) * up)
            s1, s3, s2 = (decode_fp8(self.raw[L][f"shared_experts.{n}.weight"], self.raw[L][f"shared_experts.{n}.scale"])
                          for n in ("w1", "w3", "w2"))
            y += s2 @ (silu(s1 @ x) * (s3 @ x))
            h = h + y
        nxt = int(np.argmax(self.head @ rmsnorm(h, self.norm, g.rms_norm_eps)))
        return nxt, chosen


def run_stream(model, prompts, gen):
    toks, chosen = [], []
    for p in prompts:
        for t in p:
            nxt, c = model.step(t)
            toks.append(t)
            chosen.append(c)
        t = nxt
        for _ in range(gen):
            nxt, c = model.step(t)
            toks.append(t)
            chosen.append(c)
            t = nxt
    return toks, chosen


def lru_hit_rate(seq, capacity):
    cache, hits, n = OrderedDict(), 0, 0
    for sel in seq:
        for e in map(int, sel):
            n += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / n


def top_quarter_share(seq, n_experts):
    counts = np.bincount(np.concatenate(seq), minlength=n_experts)
    return np.sort(counts)[::-1][: n_experts // 4].sum() / counts.sum()


# The demo/bench routing shape (32 experts, top-6) at tiny hidden sizes, with a vocabulary
# large enough for many topics.
ROUTING_GEOMETRY = GEOMETRIES["tiny"].replace(n_experts=32, top_k=6, vocab=2048, n_hash_layers=1)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    path = synth_checkpoint(tmp_path_factory.mktemp("routing") / "ck", ROUTING_GEOMETRY, seed=0)
    with open_checkpoint(path) as ck:
        model = NumpyMoE(ck)
        prompts = ck.prompts
    toks, chosen = run_stream(model, prompts, gen=24)
    return model, prompts, toks, chosen


def test_prompts_are_token_ids(routed):
    model, prompts, _, _ = routed
    assert len(prompts) >= 4
    for p in prompts:
        assert 8 <= len(p) <= 32
        assert all(0 <= t < model.g.vocab for t in p)


def test_router_layers_are_skewed_and_cacheable(routed):
    model, _, _, chosen = routed
    g = model.g
    shares, hit_q, hit_h = [], [], []
    for L in range(g.n_hash_layers, g.n_layers):
        seq = [c[L] for c in chosen]
        shares.append(top_quarter_share(seq, g.n_experts))
        hit_q.append(lru_hit_rate(seq, g.n_experts // 4))
        hit_h.append(lru_hit_rate(seq, g.n_experts // 2))
        used = np.unique(np.concatenate(seq)).size
        assert used >= g.n_experts * 3 // 4, f"layer {L}: only {used} experts ever used (no long tail)"
    print(f"top-quarter share {np.round(shares, 3)}, LRU hit @1/4 {np.round(hit_q, 3)}, @1/2 {np.round(hit_h, 3)}")
    # uniform routing would give a top-quarter share of ~0.25 and hit rates ~0.25 / ~0.5
    assert 0.40 <= np.mean(shares) <= 0.75
    assert 0.40 <= np.mean(hit_q) <= 0.75
    assert 0.65 <= np.mean(hit_h) <= 0.90
    assert np.mean(hit_h) > np.mean(hit_q)


def test_hash_layers_spread_over_all_experts(routed):
    model, _, _, chosen = routed
    g = model.g
    for L in range(g.n_hash_layers):
        table = model.layers[L]["gate.tid2eid"]
        assert table.shape == (g.vocab, g.top_k) and table.dtype == np.int64
        counts = np.bincount(table.ravel(), minlength=g.n_experts)
        assert counts.min() > 0 and counts.max() <= 3 * counts.mean()
        assert all(len(set(row)) == g.top_k for row in table.tolist())  # distinct per token
        seq = [c[L] for c in chosen]
        assert lru_hit_rate(seq, g.n_experts // 2) > 0.5


def test_greedy_continuation_does_not_fall_into_short_cycles(routed):
    model, prompts, toks, _ = routed
    pos = 0
    for p in prompts:  # each prompt is followed by 24 greedy tokens
        pos += len(p)
        gen = toks[pos:pos + 24]
        pos += 24
        assert len(set(gen)) >= 20, gen
