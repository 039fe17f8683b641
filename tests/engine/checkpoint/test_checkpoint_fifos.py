"""A checkpoint whose JSON file or shard is a FIFO (or a device) under its name: opening it is
refused at once naming the file, in a thread that must finish (a plain open would wait for a
writer forever); its fingerprint skips what is not a regular file."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
from ds4f.engine.checkpoint.safetensors_index import read_shard_header
from ds4f.errors import Ds4fError


def _finishes(fn):
    got = []

    def call():
        try:
            got.append(fn())
        except Exception as exc:   # the test asserts which
            got.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "blocked"
    return got[0]


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "shard"])
def test_a_fifo_in_an_official_checkpoint_is_refused_at_once(tiny_official, tmp_path, name):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_official, ck)
    victim = next(ck.glob("*.safetensors")) if name == "shard" else ck / name
    victim.unlink()
    os.mkfifo(victim)
    got = _finishes(lambda: open_checkpoint(ck))
    assert isinstance(got, Ds4fError) and str(victim) in str(got) and "a FIFO" in str(got), got
    fp = _finishes(lambda: checkpoint_fingerprint(ck))
    assert isinstance(fp, str) and len(fp) == 64


@pytest.mark.parametrize("name", ["pool-mxfp4.json", "trunk.json", "trunk.offsets"])
def test_a_fifo_in_a_ds4f_layout_is_refused_at_once(tiny_model, tmp_path, name):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_model, ck)
    (ck / name).unlink()
    os.mkfifo(ck / name)
    got = _finishes(lambda: open_checkpoint(ck))
    assert isinstance(got, Ds4fError) and str(ck / name) in str(got) and "a FIFO" in str(got), got


def test_a_device_as_a_shard_is_refused():
    got = _finishes(lambda: read_shard_header("/dev/zero"))
    assert isinstance(got, Ds4fError) and "a character device" in str(got)
