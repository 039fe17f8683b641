"""Shared test fixtures.

Every test session gets its own XDG directories, so runs, history and the demo model
never touch the user's real data, cache or config.
"""
import atexit
import os
import shutil
import tempfile

_XDG_ROOT = tempfile.mkdtemp(prefix="ds4f-test-xdg-")
# The session's data, cache and config go with it (the demo model alone is ~10 MB a session).
atexit.register(shutil.rmtree, _XDG_ROOT, ignore_errors=True)
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


# ---- the `slow` marker -------------------------------------------------------------------------
# `pytest -m "not slow"` is the one-minute loop; CI runs everything. A test is slow when the
# longest prefix of its node id (relative to tests/) in this table says so: a directory, a module,
# or a test (with the start of its parameters). A new module under a slow directory is slow until
# it is listed as fast here. A prefix whose file is gone stops the run (a rename would otherwise
# move tests in or out of the loop unseen).
SPEED = {
    # CLI subprocesses, a wheel build, every command's --help, the benchmarks, the agent clients
    "bench/": "slow", "cachelab/": "slow", "cli/": "slow", "clients/": "slow",
    # bench llama: reading llama-bench's JSON, the ratios, a stand-in llama-bench's round in the loop
    "bench/test_bench_llama.py": "fast", "bench/test_bench_llama.py::test_the_cli_names": "slow",
    "bench/test_bench_llama.py::test_bench_llama_end_to_end": "slow",
    "test_package.py": "slow", "test_wheel.py": "slow", "test_marker_text.py": "slow",
    # Textual apps, pseudo-terminals and real servers; the console's units and its client are fast
    "console/": "slow",
    "console/test_console_units.py": "fast", "console/test_console_data.py": "fast",
    "console/test_console_remote.py": "fast",
    # `ds4f serve` on loopback: every API's tests are slow; a few small ones stay in the loop
    "server/": "slow",
    "server/test_keepalive.py": "fast",
    "server/test_slow_bodies.py": "fast", "server/test_forced_choice.py": "fast",
    # runs: real runs with dumps, figures and histories
    "runs/": "slow",
    "runs/test_state_hash.py": "fast", "runs/test_statedump_bounds.py": "fast",
    # the engine's whole-model, speculative and long-prompt runs; checkpoints made per test
    "engine/test_engine.py": "slow", "engine/test_kept_states_hostile.py": "slow",
    "engine/test_mtp_trained.py": "slow", "engine/test_prefill.py": "slow",
    "engine/test_session_state.py": "slow", "engine/test_speculative.py": "slow",
    "engine/test_whole_engine.py": "slow",
    "engine/checkpoint/test_checkpoints.py": "slow", "engine/checkpoint/test_verify.py": "slow",
    "engine/model/test_attention_model.py::test_decode_matches_transformers[long": "slow",
    # kernels: NEON under qemu, the real DeepSeek-V4-Flash shapes, the benchmark's CLI
    "native/test_neon.py": "slow",
    "native/test_kernels.py::test_ds4f_kernels_env_selects_initial_backend": "slow",
    "native/test_kernels.py::test_experts_forward_real_shape": "slow",
    "native/test_kernels.py::test_bench_kernels_cli_writes_json": "slow",
    "native/test_multitoken_kernels.py::test_experts_forward_tokens_real_shape": "slow",
    "native/test_multitoken_kernels.py::test_mxfp4_matmul[130-4096": "slow",
    "native/test_multitoken_kernels.py::test_bf16_matmul[uint16-130-4096": "slow",
    "native/test_multitoken_kernels.py::test_bf16_matmul[bfloat16-130-4096": "slow",
    # pytest in a subprocess: two whole collections of the suite, one module's
    "test_slow_marker.py::test_skipping_wholly_slow_modules_selects_the_same_tests": "slow",
    "test_slow_marker.py::test_the_marker_reaches_the_collected_tests": "slow",
}


def speed_of(rel_id: str, table: dict = SPEED) -> str:
    """"slow" or "fast": what the longest prefix of rel_id (a node id relative to tests/) in the
    table says; "fast" when none is there."""
    best = max((p for p in table if rel_id.startswith(p)), key=len, default=None)
    return table[best] if best else "fast"


def missing_paths(root, table: dict = SPEED) -> list[str]:
    """The table's prefixes whose file or directory is not under root."""
    return sorted(p for p in table if not (root / p.split("::")[0]).exists())


def wholly_slow(rel: str, table: dict = SPEED) -> bool:
    """True if every test under rel (a module or directory relative to tests/) is slow."""
    return speed_of(rel, table) == "slow" and not any(
        p.startswith(rel) and v == "fast" for p, v in table.items())


def pytest_ignore_collect(collection_path, config):
    """Under exactly `-m "not slow"`, a module or directory wholly slow is not even imported (the
    loop's collection: about 4 s rather than 10)."""
    from pathlib import Path

    if (config.getoption("markexpr", "") or "").strip() != "not slow":
        return None
    here = Path(__file__).resolve().parent
    try:
        rel = Path(collection_path).resolve().relative_to(here).as_posix()
    except ValueError:
        return None
    if Path(collection_path).is_dir():
        rel += "/"
    elif not rel.endswith(".py"):
        return None
    return True if wholly_slow(rel) else None


def pytest_collection_modifyitems(config, items):
    from pathlib import Path

    here = Path(__file__).resolve().parent
    gone = missing_paths(here)
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: SPEED names what tests/ no longer holds: {', '.join(gone)}")
    for item in items:
        try:
            rel = Path(item.path).resolve().relative_to(here).as_posix()
        except ValueError:
            continue
        name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
        if speed_of(f"{rel}::{name}" if name else rel) == "slow":
            item.add_marker(pytest.mark.slow)
