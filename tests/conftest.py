"""Shared test fixtures.

Every test session gets its own XDG directories, so runs, history and the demo model
never touch the user's real data, cache or config.
"""
import os
import tempfile

_XDG_ROOT = tempfile.mkdtemp(prefix="ds4f-test-xdg-")
for _var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
    os.environ[_var] = os.path.join(_XDG_ROOT, _var.lower())

import pytest


@pytest.fixture(scope="session")
def tiny_official(tmp_path_factory):
    """A tiny synthetic checkpoint in the official format (safetensors shards), made once."""
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny") / "official", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_official, tmp_path_factory):
    """The same tiny checkpoint converted to the ds4f layout, made once."""
    from ds4f.engine.checkpoint.convert import convert_checkpoint

    return convert_checkpoint(tiny_official, tmp_path_factory.mktemp("tiny-ds4f") / "ds4f")


@pytest.fixture(scope="session")
def tiny_moe_only(tmp_path_factory):
    """The tiny geometry without attention (the MoE half only), converted to the ds4f layout: what
    the float64 MoE reference (engine/model/reference.py) computes token by token."""
    from ds4f.engine.checkpoint.convert import convert_checkpoint
    from ds4f.engine.checkpoint.synth import synth_checkpoint
    from ds4f.engine.model.geometry import GEOMETRIES

    root = tmp_path_factory.mktemp("tiny-moe")
    official = synth_checkpoint(root / "official", GEOMETRIES["tiny"].replace(attention=None), seed=0)
    return convert_checkpoint(official, root / "ds4f")


@pytest.fixture(scope="session")
def ratios_model(tmp_path_factory):
    """The transformers fixture with CSA and HCA layers at small ratios (tests/fixtures/whole/ratios,
    its expected outputs left out), converted to the ds4f layout, made once. Tests that change a
    checkpoint copy it first."""
    import shutil
    from pathlib import Path

    from ds4f.engine.checkpoint.convert import convert_checkpoint

    whole = Path(__file__).resolve().parent / "fixtures" / "whole"
    src = tmp_path_factory.mktemp("ratios") / "official"
    shutil.copytree(whole / "ratios", src, ignore=shutil.ignore_patterns("expected.npz"))
    return convert_checkpoint(src, src.parent / "ds4f", progress=False)


@pytest.fixture(scope="session")
def release():
    """The release's chat encoder (tests/reference/deepseek_v4_encoding.py, from the vLLM 0.20.0 wheel,
    unchanged): encode_messages and parse_message_from_completion_text, the chat format's reference."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("regex")
    path = Path(__file__).resolve().parent / "reference" / "deepseek_v4_encoding.py"
    spec = importlib.util.spec_from_file_location("deepseek_v4_encoding", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
