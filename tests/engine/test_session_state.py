"""A session's state as a value: a session restored from a snapshot, forked from one, or loaded
from a file continues byte for byte as the session it was taken from (the same logits, routing and
hidden states at every later position), on every backend; a state of another model, checkpoint or
version, truncated or altered, is refused with a message naming the file and the problem.

The model is the transformers fixture with CSA (ratio 4) and HCA (ratio 16) layers and a sliding
window of 5: the snapshot positions are past the window and inside a compressor's group."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.synth import synth_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.session_state import load_state, save_state
from ds4f.errors import Ds4fError
from ds4f.native import kernels

PROMPT = (0, 17, 42, 99, 5, 7, 200, 11, 12, 13, 250, 3, 4, 77, 19, 23, 8, 31, 64, 2, 9, 101, 44)   # 23 tokens
AT = (7, 13, 22)          # snapshot positions: past the window (5), none a multiple of 4 or 16
GEN = 6
BACKENDS = kernels.available_backends()


def _engine(model, backend="scalar", context=None):
    preset = load_config(None).get_preset("laptop")
    if context is not None:
        from dataclasses import replace
        preset = replace(preset, context=context)
    return Engine(open_checkpoint(model), preset, 2, 2, backend)


def _close(engine):
    engine.close()
    engine.ckpt.close()


def _steps(session, tokens):
    """Each token's (logits, expert ids, hidden states), copied; the greedy continuation after."""
    out = []
    for t in tokens:
        r = session.step(t)
        out.append((r.logits.copy(), r.ids.copy(), r.hidden.copy()))
    return out


def _continue(session, n):
    """n greedy tokens from the session's last logits: [(token, logits, ids, hidden)]."""
    out, token = [], int(np.argmax(session.logits))
    for _ in range(n):
        r = session.step(token)
        out.append((token, r.logits.copy(), r.ids.copy(), r.hidden.copy()))
        token = r.next_token
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if isinstance(u, np.ndarray):
                assert u.dtype == v.dtype and np.array_equal(u.view(np.uint8), v.view(np.uint8))
            else:
                assert u == v


@pytest.mark.parametrize("backend", BACKENDS)
def test_restored_and_forked_sessions_continue_byte_for_byte(ratios_model, backend):
    engine = _engine(ratios_model, backend)
    try:
        ref = engine.new_session()
        whole = _steps(ref, PROMPT)
        tail = _continue(ref, GEN)
        for p in AT:
            s = engine.new_session()
            _steps(s, PROMPT[:p])
            state = s.snapshot()
            assert state.position == p and state.tokens == PROMPT[:p]
            kept = [a.copy() for a in (state.logits, *[layer.window for layer in state.layers])]
            # the session it came from goes on elsewhere; the state does not change with it
            _steps(s, (5, 5, 5))
            assert all(np.array_equal(a, b) for a, b in zip(kept, (state.logits, *[x.window for x in state.layers])))
            # back to the state in the same session, and in two forks: each continues as the original
            s.restore(state)
            one, two = engine.fork(state), engine.fork(state)
            for session in (s, one, two):
                assert_same(_steps(session, PROMPT[p:]), whole[p:])
                assert_same(_continue(session, GEN), tail)
    finally:
        _close(engine)


def test_two_forks_of_one_prefix_do_not_disturb_each_other(ratios_model):
    engine = _engine(ratios_model)
    try:
        base = engine.new_session()
        _steps(base, PROMPT[:13])
        state = base.snapshot()
        a, b = engine.fork(state), engine.fork(state)
        other = (3, 1, 4, 1, 5, 9, 2, 6)
        # interleaved: a on the prompt's rest, b on other tokens
        got_a, got_b = [], []
        for ta, tb in zip(PROMPT[13:], other):
            got_a += _steps(a, [ta])
            got_b += _steps(b, [tb])
        cold_a, cold_b = engine.new_session(), engine.new_session()
        _steps(cold_a, PROMPT[:13])
        _steps(cold_b, PROMPT[:13])
        assert_same(got_a, _steps(cold_a, PROMPT[13:13 + len(other)]))
        assert_same(got_b, _steps(cold_b, other))
    finally:
        _close(engine)


def test_a_state_taken_after_prefill_chunks_continues_as_a_cold_prefill(ratios_model):
    engine = _engine(ratios_model)
    try:
        cold = engine.new_session(prefill_chunk=8)
        cold.prefill(list(PROMPT[:8]))
        cold.prefill(list(PROMPT[8:16]))
        want = cold.prefill(list(PROMPT[16:])).logits.copy()
        warm = engine.new_session(prefill_chunk=8)
        warm.prefill(list(PROMPT[:8]))
        warm.prefill(list(PROMPT[8:11]))      # position 11: inside a group of 4 and of 16
        fork = engine.fork(warm.snapshot(), prefill_chunk=8)
        fork.prefill(list(PROMPT[11:16]))
        got = fork.prefill(list(PROMPT[16:])).logits
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        assert_same(_continue(fork, GEN), _continue(cold, GEN))
    finally:
        _close(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saved_state_loads_and_continues_byte_for_byte(ratios_model, tmp_path, backend):
    engine = _engine(ratios_model, backend)
    try:
        ref = engine.new_session()
        whole = _steps(ref, PROMPT)
        s = engine.new_session()
        _steps(s, PROMPT[:13])
        path = save_state(s.snapshot(), tmp_path / "s.kv")
        assert not list(tmp_path.glob("*.partial"))
        loaded = load_state(path, engine.geometry.to_config(), engine.fingerprint)
        assert loaded.tokens == PROMPT[:13] and loaded.nbytes == s.snapshot().nbytes
        assert_same(_steps(engine.fork(loaded), PROMPT[13:]), whole[13:])
    finally:
        _close(engine)
    # another engine on the same checkpoint (a restart) takes it too
    again = _engine(ratios_model, backend)
    try:
        assert_same(_steps(again.fork(load_state(path, again.geometry.to_config(), again.fingerprint)), PROMPT[13:]),
              whole[13:])
    finally:
        _close(again)


def test_bad_state_files_are_refused_with_the_file_and_the_problem(ratios_model, tmp_path):
    engine = _engine(ratios_model)
    try:
        s = engine.new_session()
        _steps(s, PROMPT[:9])
        good = save_state(s.snapshot(), tmp_path / "good.kv")
        data = good.read_bytes()
        g, fp = engine.geometry.to_config(), engine.fingerprint
        cases = {
            "truncated.kv": (data[:len(data) // 2], "truncated or damaged"),
            "flipped.kv": (data[:200] + bytes([data[200] ^ 1]) + data[201:], "truncated or damaged"),
            "tail.kv": (data[:-1] + bytes([data[-1] ^ 0x80]), "truncated or damaged"),
            "other.kv": (b"not a session state at all, just bytes", "not a ds4f session state"),
            "empty.kv": (b"", "not a ds4f session state"),
            "version.kv": (data[:8] + (99).to_bytes(4, "little") + data[12:], "version 99"),
        }
        for name, (content, problem) in cases.items():
            (tmp_path / name).write_bytes(content)
            with pytest.raises(Ds4fError, match=problem) as e:
                load_state(tmp_path / name, g, fp)
            assert str(tmp_path / name) in str(e.value) and e.value.path == str(tmp_path / name)
        with pytest.raises(Ds4fError, match="cannot read"):
            load_state(tmp_path / "missing.kv", g, fp)
        with pytest.raises(Ds4fError, match="another model geometry"):
            load_state(good, {**g, "vocab_size": g["vocab_size"] + 1}, fp)
        with pytest.raises(Ds4fError, match="another checkpoint"):
            load_state(good, g, "0" * 64)
    finally:
        _close(engine)


def test_a_state_of_another_checkpoint_or_past_the_context_is_refused(ratios_model, tmp_path):
    root = tmp_path / "seeds"
    one = synth_checkpoint(root / "one", "tiny", seed=0)
    two = synth_checkpoint(root / "two", "tiny", seed=1)    # the same geometry, other weights
    a, b = _engine(one), _engine(two)
    try:
        assert a.geometry == b.geometry and a.fingerprint != b.fingerprint
        s = a.new_session()
        _steps(s, (0, 5, 9))
        state = s.snapshot()
        with pytest.raises(Ds4fError, match="another checkpoint"):
            b.fork(state)
        target = b.new_session()
        _steps(target, (0, 1))
        with pytest.raises(Ds4fError, match="another checkpoint"):
            target.restore(state)
        assert target.position == 2 and target.tokens == [0, 1]     # left as it was
        path = save_state(state, tmp_path / "a.kv")
        with pytest.raises(Ds4fError, match="another checkpoint"):
            load_state(path, b.geometry.to_config(), b.fingerprint)
        # a copy of the checkpoint's directory is the same checkpoint
        copy = shutil.copytree(one, root / "copy")
        c = _engine(copy)
        try:
            assert c.fingerprint == a.fingerprint
            assert_same(_steps(c.fork(state), (7, 7)), _steps(a.fork(state), (7, 7)))
        finally:
            _close(c)
    finally:
        _close(a)
        _close(b)
    # another geometry, and a session whose context is shorter than the state's position
    r = _engine(ratios_model)
    short = _engine(ratios_model, context=8)
    try:
        with pytest.raises(Ds4fError, match="another model geometry"):
            r.fork(state)
        s = r.new_session()
        _steps(s, PROMPT[:13])
        with pytest.raises(Ds4fError, match="past the context of 8"):
            short.fork(s.snapshot())
    finally:
        _close(r)
        _close(short)
