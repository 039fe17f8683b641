"""ds4f diff on real dumps: a run that is a prefix of another, and states with NaN in them."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.diff import CLASS_EXIT_CODES, LOW_BIT_TOLERANCE, diff_states
from ds4f.runs.statedump import StateWriter, read_state


def _run(model, tmp_path, name, gen):
    run = start_run(RunConfig(model=str(model), gen=gen, prompt=(0, 17), backend="scalar", probe_floor=False,
                              dump_path=str(tmp_path / f"{name}.bin")))
    assert run.wait(120) and run.state == "done", run.error
    return run.dump_path


def _rewrite(src, dst, n=None, poison=None, nudge=None):
    """A copy of dump `src` with its first n records, hidden[poison] set to NaN if given, and the
    attention output at nudge = (token, layer, factor) scaled by factor."""
    s = read_state(src)
    recs = s.records[:n] if n is not None else s.records
    w = StateWriter(dst, s.header["geometry"], s.header["prompt"], len(recs))
    for i, r in enumerate(recs):
        hidden, attn = r["hidden"].copy(), r["attn"].copy()
        if poison is not None and i == poison[0]:
            hidden[poison[1], poison[2]] = np.nan
        if nudge is not None and i == nudge[0]:
            attn[nudge[1]] *= nudge[2]
        w.write(int(r["token"]), int(r["next"]), s.backends[i], r["ids"], r["weights"], hidden, attn)
    w.finish()
    return dst


def test_diff_names_the_token_and_layer_where_the_attention_first_diverges(tiny_model, tmp_path):
    base = _run(tiny_model, tmp_path, "base", 4)
    same = _rewrite(base, tmp_path / "same.bin")
    assert read_state(same).records["attn"].any()           # the runs record their attention outputs
    d = diff_states(base, same)          # the top logits are not copied: bytes differ, attention does not
    assert d.attention_token is None and d.attention_summary() is None
    for token, layer, factor in ((2, 1, 1.5), (1, 3, 1 + 10 * LOW_BIT_TOLERANCE)):
        moved = _rewrite(base, tmp_path / f"moved-{token}-{layer}.bin", nudge=(token, layer, factor))
        d = diff_states(base, moved)
        assert (d.attention_token, d.attention_layer) == (token, layer), d.to_dict()
        assert d.to_dict()["attention"] == f"attention first diverges at token {token}, layer {layer}"
    tiny = _rewrite(base, tmp_path / "tiny.bin", nudge=(2, 1, 1 + LOW_BIT_TOLERANCE / 10))   # within the tolerance
    assert diff_states(base, tiny).attention_token is None
    cli = subprocess.run([sys.executable, "-m", "ds4f.cli", "diff", str(base), str(moved)], capture_output=True,
                         text=True)
    assert "attention first diverges at token 1, layer 3" in cli.stdout, cli.stdout + cli.stderr


def test_a_shorter_run_with_the_same_prefix_is_not_a_routing_divergence(tiny_model, tmp_path):
    short, long = _run(tiny_model, tmp_path, "short", 3), _run(tiny_model, tmp_path, "long", 5)
    for a, b in ((short, long), (long, short)):
        d = diff_states(a, b)
        assert d.cls == "prefix", d.summary()
        assert d.summary().startswith("same prefix, lengths differ")
        assert "bit-identical" in d.summary(), d.summary()
        assert ("4 and 6 tokens" if a == short else "6 and 4 tokens") in d.summary(), d.summary()
    cli = subprocess.run([sys.executable, "-m", "ds4f.cli", "diff", str(short), str(long)], capture_output=True,
                         text=True)
    assert cli.returncode == CLASS_EXIT_CODES["prefix"], cli.stdout + cli.stderr
    assert cli.stdout.startswith("same prefix, lengths differ"), cli.stdout


def test_a_prefix_whose_states_drift_is_drift(tiny_model, tmp_path):
    long = _run(tiny_model, tmp_path, "long", 5)
    s = read_state(long)
    w = StateWriter(tmp_path / "moved.bin", s.header["geometry"], s.header["prompt"], 2)
    for i in range(2):
        r = s.records[i]
        w.write(int(r["token"]), int(r["next"]), s.backends[i], r["ids"], r["weights"], r["hidden"] * 1.5)
    w.finish()
    assert diff_states(long, tmp_path / "moved.bin").cls == "drift"


def test_a_state_with_nan_is_never_low_bit(tiny_model, tmp_path):
    base = _run(tiny_model, tmp_path, "base", 3)
    for where in ((0, 0, 0), (2, 3, 7)):   # the first or a later token and layer
        bad = _rewrite(base, tmp_path / f"nan{where[0]}.bin", poison=where)
        for a, b in ((base, bad), (bad, base)):
            d = diff_states(a, b)
            assert d.cls == "drift" and "non-finite" in d.summary(), d.summary()


def test_every_float_of_the_records_counts(tiny_model, tmp_path):
    """A NaN, or a difference beyond the tolerance, in the attention outputs, the expert weights or
    the top logits is never low-bit: the hidden states are not the only values a dump holds."""
    base = _run(tiny_model, tmp_path, "base", 3)
    s = read_state(base)
    data = base.read_bytes()
    start = len(data) - len(s.records) * s.records.dtype.itemsize

    def altered(name: str, field: str, value) -> str:
        out = bytearray(data)
        off = start + (len(s.records) - 1) * s.records.dtype.itemsize + s.records.dtype.fields[field][1]
        at = off + s.records.dtype.fields[field][0].itemsize - 4          # its last value
        old = float(np.frombuffer(bytes(out[at:at + 4]), np.float32)[0])
        out[at:at + 4] = np.array([value(old)], np.float32).tobytes()
        (tmp_path / name).write_bytes(bytes(out))
        return tmp_path / name

    for field in ("attn", "weights", "top_logits"):
        nan = diff_states(base, altered(f"nan-{field}.bin", field, lambda v: np.nan))
        assert nan.cls == "drift" and "non-finite" in nan.summary(), (field, nan.summary())
        far = diff_states(base, altered(f"far-{field}.bin", field, lambda v: v * 3 + 1))
        assert far.cls == "drift" and "differ by up to" in far.summary(), (field, far.summary())
        near = diff_states(base, altered(f"near-{field}.bin", field, lambda v: np.nextafter(np.float32(v), np.inf)))
        assert near.cls == "low-bit", (field, near.summary())
    # the last record's pick (no later token shows it): a divergence of the output, named
    out = bytearray(data)
    at = start + (len(s.records) - 1) * s.records.dtype.itemsize + s.records.dtype.fields["next"][1]
    out[at:at + 4] = np.array([int(s.records["next"][-1]) ^ 1], np.int32).tobytes()
    (tmp_path / "next.bin").write_bytes(bytes(out))
    picked = diff_states(base, tmp_path / "next.bin")
    assert picked.cls == "routing" and picked.token == len(s.records) and "picked after" in picked.summary()


def test_inputs_that_are_not_dumps_are_refused_from_their_first_bytes(tiny_model, tmp_path):
    """A device, a FIFO (no writer: an open would block), a large file of another kind, a dump
    with bytes added: refused from the header and the file's size, before the records are read
    (ds4f diff answers at once, its memory bounded)."""
    import os

    base = _run(tiny_model, tmp_path, "base", 2)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    junk = tmp_path / "junk.bin"
    with open(junk, "wb") as f:
        f.truncate(1 << 30)                     # 1 GiB, sparse: nothing of a dump
    padded = tmp_path / "padded.bin"
    padded.write_bytes(base.read_bytes() + b"\0" * 1000)
    for other, says in (("/dev/zero", "not a regular file"), (fifo, "not a regular file"), (junk, "bad magic"),
                        (padded, "truncated or padded")):
        cli = subprocess.run([sys.executable, "-m", "ds4f.cli", "diff", str(base), str(other)], capture_output=True,
                             text=True, timeout=60)
        assert cli.returncode == 2 and says in cli.stderr and str(other) in cli.stderr, (other, cli.stderr)
        assert "Traceback" not in cli.stderr
    # the peak memory of a fresh process (VmHWM: ru_maxrss would count the forking parent's)
    big = subprocess.run([sys.executable, "-c", "import sys\nfrom ds4f.runs.statedump import read_state\n"
                          "try:\n    read_state(sys.argv[1])\nexcept Exception as e:\n    print(e)\n"
                          "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))",
                          str(junk)], capture_output=True, text=True, timeout=60)
    said, peak_kib = big.stdout.splitlines()
    assert "bad magic" in said and int(peak_kib) < 400_000, big.stdout     # far below the file's 1 GiB
