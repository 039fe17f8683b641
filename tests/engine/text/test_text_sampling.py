"""Sampling against an independent float64 numpy sampler written here from the documented order.

The reference works on masks over the unsorted vocabulary rather than on a sorted prefix: ranks
come from np.lexsort (probability descending, index ascending), each filter is a boolean mask,
and the inverse CDF walks the kept tokens by rank.
"""
import math

import numpy as np
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.text import Sampler, SamplingParams


def reference_sample(logits32, temperature, top_k, top_p, min_p, u):
    x = logits32.astype(np.float64)
    if temperature == 0 or top_k == 1:
        return int(np.flatnonzero(x == x.max())[0])
    z = x / temperature
    e = np.exp(z - np.max(z))
    p = e / np.sum(e)
    n = len(p)
    by_rank = np.lexsort((np.arange(n), -p))       # last key primary: p descending, then index
    rank = np.empty(n, dtype=np.int64)
    rank[by_rank] = np.arange(n)
    keep = np.ones(n, dtype=bool)
    if top_k > 0:
        keep &= rank < top_k
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q = q / q.sum()
        walk = by_rank[keep[by_rank]]
        cum = np.cumsum(q[walk])
        # keep a token if the mass ranked strictly before it has not yet reached top_p
        cut = np.zeros(n, dtype=bool)
        before = np.concatenate([[0.0], cum[:-1]])
        cut[walk] = before < top_p
        keep &= cut
    walk = by_rank[keep[by_rank]]
    r = p[walk] / p[walk].sum()
    cum = np.cumsum(r)
    above = np.flatnonzero(cum > u)
    return int(walk[above[0]] if len(above) else walk[-1])


def reference_run(logits_list, params):
    rng = np.random.Generator(np.random.PCG64(params["seed"]))
    out = []
    for lg in logits_list:
        greedy = params["temperature"] == 0 or params["top_k"] == 1
        u = None if greedy else rng.random()
        out.append(reference_sample(lg, params["temperature"], params["top_k"], params["top_p"], params["min_p"], u))
    return out


def _logits(n_tokens=40, vocab=512, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(vocab) * scale).astype(np.float32) for _ in range(n_tokens)]


SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0),
    dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, seed=1),
    dict(temperature=1.3, top_k=40, top_p=1.0, min_p=0.0, seed=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, seed=3),
    dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02, seed=4),
    dict(temperature=2.5, top_k=100, top_p=0.5, min_p=0.1, seed=2 ** 40 + 7),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_matches_the_reference(settings):
    logits = _logits(seed=settings["seed"] % 1000)
    sampler = Sampler(SamplingParams(**settings))
    got = [sampler.sample(lg) for lg in logits]
    assert got == reference_run(logits, settings)
    assert sampler.draws == len(logits)


def test_reference_inverse_cdf_by_hand():
    # three tokens with p = (0.5, 0.3, 0.2) after softmax: u picks by cumulative 0.5, 0.8, 1.0
    lg = np.log(np.array([0.3, 0.5, 0.2])).astype(np.float32)
    assert [reference_sample(lg, 1.0, 0, 1.0, 0.0, u) for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)] == \
        [1, 1, 0, 0, 2, 2]
    assert reference_sample(lg, 1.0, 0, 0.5, 0.0, 0.9) == 1     # top_p 0.5: token 1 alone reaches it
    assert reference_sample(lg, 1.0, 0, 0.6, 0.0, 0.9) == 0     # 0.6: tokens 1 and 0
    assert reference_sample(lg, 1.0, 0, 1.0, 0.5, 0.99) == 0    # min_p 0.5: p >= 0.25 keeps 1 and 0
    assert reference_sample(lg, 1.0, 2, 1.0, 0.0, 0.99) == 0    # top_k 2


def test_greedy_forms_agree():
    logits = _logits(n_tokens=30)
    argmax = [int(np.argmax(lg)) for lg in logits]
    for p in (SamplingParams(temperature=0.0, seed=9), SamplingParams(temperature=1.0, top_k=1, seed=9),
              SamplingParams(temperature=0.5, top_p=1e-9, seed=9)):
        s = Sampler(p)
        assert [s.sample(lg) for lg in logits] == argmax
    s = Sampler(SamplingParams(temperature=0))
    assert s.sample(np.array([1.0, 3.0, 3.0, 2.0], np.float32)) == 1 and s.draws == 0   # ties: lowest index
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy and not SamplingParams().greedy


def test_seeds():
    logits = _logits(n_tokens=200, vocab=64, scale=0.5)   # flat distributions: many outcomes per draw
    a = [Sampler(SamplingParams(seed=5)).sample(lg) for lg in logits]     # a fresh sampler per token
    s1, s2 = Sampler(SamplingParams(seed=5)), Sampler(SamplingParams(seed=5))
    run1 = [s1.sample(lg) for lg in logits]
    assert run1 == [s2.sample(lg) for lg in logits]
    assert a[0] == run1[0]
    s3 = Sampler(SamplingParams(seed=6))
    run3 = [s3.sample(lg) for lg in logits]
    assert sum(x != y for x, y in zip(run1, run3)) > 100
    assert s1.state()["draws"] == 200 and s1.state() != s3.state()


def test_min_p_and_top_k_restrict():
    lg = np.array([5.0, 4.9, 1.0, 0.0, -3.0], np.float32)
    s = Sampler(SamplingParams(min_p=0.5, seed=0))     # p >= half the top's: tokens 0 and 1 only
    got = {s.sample(lg) for _ in range(300)}
    assert got == {0, 1}
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    assert {s.sample(lg) for _ in range(300)} == {0, 1, 2}
    s = Sampler(SamplingParams(temperature=50.0, seed=0))   # nearly flat: everything shows up
    assert {s.sample(lg) for _ in range(300)} == {0, 1, 2, 3, 4}
    masked = np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32)
    s = Sampler(SamplingParams(seed=0))
    assert {s.sample(masked) for _ in range(100)} == {1, 3}


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(seed=-1), "seed"), (dict(seed=1.0), "seed"),
])
def test_validation(kw, param):
    with pytest.raises(Ds4fError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and e.value.kind == "invalid"


def test_dict_round_trip_and_bad_logits():
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3)
    assert p.to_dict() == {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 3}
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(Ds4fError) as e:
        SamplingParams.from_dict({"temp": 1.0})
    assert e.value.param == "temp"
    for bad in (np.array([np.nan, 1.0], np.float32), np.array([-np.inf, -np.inf], np.float32),
                np.zeros((2, 2), np.float32)):
        with pytest.raises(Ds4fError):
            Sampler(SamplingParams()).sample(bad)
