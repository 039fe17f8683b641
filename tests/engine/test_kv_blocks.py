"""Kept states in blocks (engine.kv_blocks): split and joined back bit for bit, keyed by the token
prefix, shared between states of one conversation, and checked whole from their files. The model
is the transformers fixture with CSA (ratio 4) and HCA (ratio 16) layers."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.kv_blocks import block_tokens, chain_keys, join, load_block, save_block, split
from ds4f.engine.session_state import _arrays, with_attached
from ds4f.errors import Ds4fError

TOKENS = [(7 * i + 3) % 250 + 2 for i in range(77)]


def _arrays_of(state):
    return {name: a for name, a in _arrays(state)}


@pytest.fixture(scope="module")
def states(ratios_model):
    """Snapshots of one session at 16, 40 and 77 positions (one record-like attachment each)."""
    engine = Engine(open_checkpoint(ratios_model), load_config(None).get_preset("laptop"), 2, 1, "scalar")
    try:
        session = engine.new_session(0)
        out = {}
        for i, t in enumerate(TOKENS):
            session.eval(t)
            if i + 1 in (16, 40, 77):
                s = session.snapshot()
                records = np.arange(s.position * 12, dtype=np.uint8).reshape(s.position, 12)
                out[s.position] = with_attached(s, records=records, note=np.ones(3, np.float32))
        return out
    finally:
        engine.close()
        engine.ckpt.close()


def test_the_block_span_is_a_multiple_of_every_ratio():
    assert block_tokens([0, 4, 16, 4, 0]) == 256
    assert block_tokens([0, 4, 128], target=256) == 256
    assert block_tokens([0, 4, 16], target=20) == 32
    assert block_tokens([0, 0]) == 256


@pytest.mark.parametrize("position", [16, 40, 77])
@pytest.mark.parametrize("span", [16, 32])
def test_a_state_split_and_joined_is_the_same_bit_for_bit(states, position, span):
    state = states[position]
    head, blocks = split(state, span)
    assert len(blocks) == position // span and list(head.keys) == [b.key for b in blocks]
    assert head.per_token == ("records",)              # the record-like attachment, not the other
    assert len(head.state.attached["records"]) == position - len(blocks) * span
    whole = join(head, blocks)
    a, b = _arrays_of(state), _arrays_of(whole)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name
    assert whole.tokens == state.tokens and whole.backend == state.backend
    # the head holds less than the state when there are blocks
    if blocks:
        assert head.nbytes + sum(blk.nbytes for blk in blocks) == state.nbytes
        assert head.nbytes < state.nbytes


def test_states_of_one_conversation_share_their_blocks(states):
    h40, b40 = split(states[40], 16)
    h77, b77 = split(states[77], 16)
    assert h77.keys[:2] == h40.keys
    for x, y in zip(b40, b77):
        for name in x.arrays:
            assert x.arrays[name].tobytes() == y.arrays[name].tobytes(), name
    # another token anywhere in the span: another key from there on
    other = list(states[77].tokens)
    other[20] += 1
    keys = chain_keys(states[77].checkpoint, states[77].backend, other, 16, 4)
    assert keys[0] == h77.keys[0] and all(k != h for k, h in zip(keys[1:], h77.keys[1:]))
    fp = states[77].checkpoint
    assert chain_keys(fp, "avx2", states[77].tokens, 16, 1) != chain_keys(fp, "scalar", states[77].tokens, 16, 1)
    assert chain_keys("another", "scalar", states[77].tokens, 16, 1) != chain_keys(fp, "scalar", states[77].tokens, 16, 1)


def test_a_block_file_is_checked_whole(states, tmp_path):
    _, blocks = split(states[77], 16)
    block = blocks[2]
    path = tmp_path / "b.kvb"
    size = save_block(block, path, "fp", "scalar")
    assert size == path.stat().st_size
    back = load_block(path, block.key, "fp")
    assert back.start == 32 and back.span == 16
    assert {k: v.tobytes() for k, v in back.arrays.items()} == {k: v.tobytes() for k, v in block.arrays.items()}
    with pytest.raises(Ds4fError, match="another key"):
        load_block(path, blocks[1].key, "fp")
    with pytest.raises(Ds4fError, match="another checkpoint"):
        load_block(path, block.key, "other")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(Ds4fError, match="damaged"):
        load_block(path, block.key, "fp")
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(Ds4fError, match="damaged|not a ds4f"):
        load_block(path, block.key, "fp")
