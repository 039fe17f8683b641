"""Compact state dumps: a size to keep for every token, the same answers from `ds4f diff`.

A compact record holds per layer a digest of the exact state and a sketch of it (runs.statedump);
these tests check that two runs' compact dumps are classed as their full dumps are (identical,
low-bit, routing, drift, prefix, non-finite), that a full record gives exactly the compact record a
compact run writes, and that the record fits 4 KB on the real model's geometry.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ds4f.engine.model.geometry import get_geometry
from ds4f.native import kernels
from ds4f.runs.config import RunConfig
from ds4f.runs.diff import CLASS_EXIT_CODES, LOW_BIT_TOLERANCE, diff_states
from ds4f.runs.run import start_run
from ds4f.runs.statedump import StateWriter, compact_records, read_state, record_nbytes, sketch


def _run(model, tmp_path, name, gen=4, dump="full", backend="scalar", prompt=(0, 17)):
    run = start_run(RunConfig(model=str(model), gen=gen, prompt=prompt, backend=backend, probe_floor=False,
                              dump=dump, dump_path=str(tmp_path / f"{name}.bin")))
    assert run.wait(120) and run.state == "done", run.error
    return run.dump_path


def _copy(src, dst, mode, hidden=None, attn=None, ids=None, n=None):
    """A copy of full dump `src` written as a `mode` dump, each record's hidden / attn / ids passed
    through the given function of (token index, array) first."""
    s = read_state(src)
    recs = s.records[:n] if n is not None else s.records
    w = StateWriter(dst, s.header["geometry"], s.header["prompt"], len(recs), mode=mode)
    for i, r in enumerate(recs):
        h, a, e = r["hidden"].copy(), r["attn"].copy(), r["ids"].copy()
        h = hidden(i, h) if hidden else h
        a = attn(i, a) if attn else a
        e = ids(i, e) if ids else e
        w.write(int(r["token"]), int(r["next"]), s.backends[i], e, r["weights"], h, a)
    w.finish()
    return dst


def test_the_compact_record_is_under_4_kb_on_the_real_model():
    g = get_geometry("flash").to_config()
    assert record_nbytes(g, "compact") <= 4096, record_nbytes(g, "compact")
    assert record_nbytes(g, "full") > 800 * record_nbytes(g, "compact")
    assert record_nbytes(g, "off") == 0


def test_a_compact_run_writes_what_its_full_dump_gives(tiny_model, tmp_path):
    full = _run(tiny_model, tmp_path, "full", dump="full")
    compact = _run(tiny_model, tmp_path, "compact", dump="compact")
    sf, sc = read_state(full), read_state(compact)
    assert (sf.mode, sc.mode) == ("full", "compact")
    assert sc.records.dtype.itemsize == record_nbytes(sf.header["geometry"], "compact")
    assert compact_records(sf.records, sf.header["geometry"]).tobytes() == sc.records.tobytes()
    d = diff_states(full, compact)
    assert d.cls == "identical" and d.modes == ("full", "compact"), d.summary()
    assert "a full and a compact dump" in d.summary()
    again = _run(tiny_model, tmp_path, "again", dump="compact")
    assert read_state(again).sha256 == sc.sha256           # the determinism invariant holds for compact dumps
    cli = subprocess.run([sys.executable, "-m", "ds4f.cli", "diff", str(full), str(compact)], capture_output=True,
                         text=True)
    assert cli.returncode == CLASS_EXIT_CODES["identical"], cli.stdout + cli.stderr


def test_the_sketch_is_a_float64_measure_of_the_state():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    sk = sketch(x, 4)
    x64 = x.astype(np.float64)
    assert np.allclose(sk[:, 0], np.abs(x64).max(axis=1), rtol=1e-7)
    assert np.allclose(sk[:, 1], np.sqrt((x64 ** 2).mean(axis=1)), rtol=1e-6)
    # the directions are +-1/sqrt(width): a value on one has the state's rms as its scale
    assert (np.abs(sk[:, 2:]) < 6 * sk[:, 1:2]).all()
    moved = x.copy()
    moved[1, 7] = np.nan
    assert not np.isfinite(sketch(moved, 4)[1]).any() and np.isfinite(sketch(moved, 4)[[0, 2]]).all()


CASES = {   # name: (what the copy changes, the class both kinds of dump must give)
    "same": ({}, "identical"),
    "hidden x1.5": ({"hidden": lambda i, h: h * 1.5 if i == 2 else h}, "drift"),
    "hidden +1ulp": ({"hidden": lambda i, h: np.nextafter(h, np.inf) if i == 1 else h}, "low-bit"),
    "hidden x(1+10 tol)": ({"hidden": lambda i, h: h * (1 + 10 * LOW_BIT_TOLERANCE) if i == 3 else h}, "drift"),
    "hidden x(1+tol/10)": ({"hidden": lambda i, h: h * (1 + LOW_BIT_TOLERANCE / 10) if i == 3 else h}, "low-bit"),
    "one layer noise": ({"hidden": lambda i, h: _noise(h, 1, 1e-3) if i == 2 else h}, "drift"),
    "one layer lane noise": ({"hidden": lambda i, h: _noise(h, 2, 1e-7) if i == 2 else h}, "low-bit"),
    "NaN": ({"hidden": lambda i, h: _poison(h) if i == 3 else h}, "drift"),
    "experts": ({"ids": lambda i, e: _swap_expert(e) if i == 2 else e}, "routing"),
    "attention x1.5": ({"attn": lambda i, a: a * 1.5 if i == 1 else a}, "drift"),
}


def _noise(h, layer, rel):
    h = h.copy()
    rng = np.random.default_rng(layer)
    h[layer] += (rng.standard_normal(h.shape[1]) * rel * np.abs(h[layer]).max()).astype(np.float32)
    return h


def _poison(h):
    h = h.copy()
    h[1, 3] = np.nan
    return h


def _swap_expert(e):
    e = e.copy()
    e[1, 0] = next(x for x in range(64) if x not in e[1])
    return e


@pytest.mark.parametrize("case", CASES)
def test_compact_dumps_are_classed_as_full_ones(tiny_model, tmp_path, case):
    change, expected = CASES[case]
    run = _run(tiny_model, tmp_path, "run", gen=4)
    base = _copy(run, tmp_path / "base.bin", "full")        # copies of the run's records, both kinds (the
    base_compact = _copy(run, tmp_path / "base-compact.bin", "compact")   # top logits are not copied)
    full = _copy(run, tmp_path / "full.bin", "full", **change)
    compact = _copy(run, tmp_path / "compact.bin", "compact", **change)
    classes = {pair: diff_states(*files) for pair, files in {
        "full/full": (base, full), "compact/compact": (base_compact, compact), "full/compact": (base, compact),
        "compact/full": (base_compact, full)}.items()}
    assert {pair: d.cls for pair, d in classes.items()} == dict.fromkeys(classes, expected), \
        {pair: d.summary() for pair, d in classes.items()}
    if expected == "routing":
        assert {(d.token, d.layer) for d in classes.values()} == {(2, 1)}
    if case == "attention x1.5":
        assert {(d.attention_token, d.attention_layer) for d in classes.values()} == {(1, 0)}
    if expected in ("low-bit", "drift") and case != "same":
        compact_pair = classes["compact/compact"]
        assert compact_pair.state_token is not None and "the exact states first differ" in compact_pair.summary()


def test_a_shorter_compact_run_is_a_prefix_of_a_longer_one(tiny_model, tmp_path):
    short = _run(tiny_model, tmp_path, "short", gen=3, dump="compact")
    long = _run(tiny_model, tmp_path, "long", gen=5, dump="compact")
    d = diff_states(short, long)
    assert d.cls == "prefix" and "bit-identical" in d.summary(), d.summary()


@pytest.mark.skipif(not any(b in kernels.available_backends() for b in ("avx2", "avx512")),
                    reason="no SIMD backend on this machine")
def test_scalar_against_simd_is_low_bit_in_both_kinds(tiny_model, tmp_path):
    simd = "avx512" if "avx512" in kernels.available_backends() else "avx2"
    pairs = {}
    for mode in ("full", "compact"):
        a = _run(tiny_model, tmp_path, f"scalar-{mode}", gen=5, dump=mode, backend="scalar")
        b = _run(tiny_model, tmp_path, f"simd-{mode}", gen=5, dump=mode, backend=simd)
        pairs[mode] = diff_states(a, b)
    assert pairs["full"].cls == pairs["compact"].cls, {m: d.summary() for m, d in pairs.items()}
    assert pairs["compact"].cls in ("low-bit", "identical")
