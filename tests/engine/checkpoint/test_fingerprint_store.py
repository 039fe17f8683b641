"""The fingerprint store (fingerprints.json in the user cache directory) and the disk floor store
(floor.json) are written whole through a `.partial` their writer locks: a writer killed mid-write
leaves one, and the next write removes it (never a live writer's, nor a `.partial` of another
file)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from ds4f.engine.checkpoint.fingerprint import KEPT_BYTES, checkpoint_fingerprint


def _checkpoint(root):
    """A directory with one file large enough that its sum is kept in the store (sparse: quick)."""
    root.mkdir(parents=True)
    with open(root / "model.safetensors", "wb") as f:
        f.truncate(KEPT_BYTES + 1)
    return root


def _stalled_writer(code: str, env=None) -> subprocess.Popen:
    """A real process running `code` whose fsync (the last step before the rename) waits: its
    .partial is written and locked, the store not yet replaced."""
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, time
        def stall(fd):
            print("writing", flush=True)
            time.sleep(600)
        os.fsync = stall
        """) + textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    assert writer.stdout.readline().strip() == "writing"
    return writer


def test_a_killed_writers_partial_is_removed_at_the_next_write(tmp_path):
    store = tmp_path / "cache" / "fingerprints.json"
    writer = _stalled_writer(f"""
        from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
        checkpoint_fingerprint({str(_checkpoint(tmp_path / "one"))!r}, store={str(store)!r})
        """)
    try:
        (partial,) = store.parent.glob("fingerprints.json.*.partial")
        lines = []
        checkpoint_fingerprint(_checkpoint(tmp_path / "two"), log=lines.append, store=store)
        assert partial.exists()                           # a live writer's: left
        assert not any("unfinished" in line for line in lines), lines
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(60)
    assert partial.exists()                               # nothing removes it until the next write
    old = store.parent / "fingerprints.json.1.2.partial"  # an older writer's, killed long ago
    old.write_text('{"half": ')
    other = store.parent / "floor.json.3.4.partial"       # not the store's: left to its own writer
    other.write_text("{}")
    lines = []
    checkpoint_fingerprint(_checkpoint(tmp_path / "three"), log=lines.append, store=store)
    assert not partial.exists() and not old.exists() and other.exists()
    assert any(f"fingerprint store: {store.parent}: 2 unfinished files" in line for line in lines), lines
    kept = json.loads(store.read_text())
    assert {str((tmp_path / n / "model.safetensors").resolve()) for n in ("two", "three")} <= set(kept)


def test_a_killed_floor_writers_partial_is_removed_at_the_next_measurement(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    code = f"""
        from ds4f.engine.checkpoint import open_checkpoint
        from ds4f.engine.runtime.disk_floor import refresh_floor
        with open_checkpoint({str(tiny_model)!r}) as ck:
            refresh_floor(ck, 2, 0.2)
        """
    writer = _stalled_writer(code, env)
    try:
        (partial,) = (cache / "ds4f").glob("floor.json.*.partial")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(60)
    assert partial.exists() and not (cache / "ds4f" / "floor.json").exists()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (cache / "ds4f").iterdir()) == ["floor.json"]
    assert len(json.loads((cache / "ds4f" / "floor.json").read_text())) == 1
