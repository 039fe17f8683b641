"""engine/demo.py: the console's out-of-the-box model, made once in the cache directory."""
import pytest

from ds4f.engine.checkpoint import demo
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.errors import Ds4fError


def test_made_once_then_reused(tmp_path):
    seen = []
    path = demo.ensure_demo_model(lambda d, t, label: seen.append((d, t, label)), root=tmp_path, geometry="tiny")
    assert path == tmp_path / demo.DEMO_DIRNAME
    assert demo.is_complete(path, "tiny")
    ck = open_checkpoint(path)  # the engine accepts it as a ds4f-layout checkpoint
    assert ck.geometry.n_layers == 4
    ck.close()
    assert not list(path.glob("*.safetensors")), "official shards are removed after conversion"
    assert not [p for p in tmp_path.iterdir() if ".build-" in p.name], "no build directory left behind"
    fracs = [d / t for d, t, _ in seen]
    assert fracs == sorted(fracs) and fracs[-1] == 1.0
    assert any("synthesising" in label for *_, label in seen) and any("converting" in label for *_, label in seen)

    mtime = (path / demo.MARKER).stat().st_mtime_ns
    calls = []
    again = demo.ensure_demo_model(lambda *a: calls.append(a), root=tmp_path, geometry="tiny")
    assert again == path and (path / demo.MARKER).stat().st_mtime_ns == mtime
    assert calls == [], "a reused demo model reports no work"


def test_crash_leaves_no_model_that_looks_whole(tmp_path, monkeypatch):
    import ds4f.engine.checkpoint.convert as convert

    def boom(*args, **kwargs):
        raise Ds4fError("disk full (simulated)")

    monkeypatch.setattr(convert, "convert_checkpoint", boom)
    with pytest.raises(Ds4fError, match="simulated"):
        demo.ensure_demo_model(root=tmp_path, geometry="tiny")
    assert not (tmp_path / demo.DEMO_DIRNAME).exists()
    assert not [p for p in tmp_path.iterdir() if ".build-" in p.name]


def test_incomplete_or_old_demo_is_rebuilt(tmp_path):
    out = tmp_path / demo.DEMO_DIRNAME
    out.mkdir()
    (out / "trunk.bin").write_bytes(b"half")  # looks like a model, but has no marker
    assert not demo.is_complete(out, "tiny")
    path = demo.ensure_demo_model(root=tmp_path, geometry="tiny")
    assert demo.is_complete(path, "tiny") and (path / "trunk.bin").stat().st_size > 4
