"""The `slow` marker (tests/conftest.py's SPEED table): which tests `pytest -m "not slow"` leaves
out, decided by the longest prefix of a test's id, and a table naming a file tests/ lacks refused."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPEED, missing_paths, speed_of, wholly_slow

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("rel_id, speed", [
    ("server/test_server.py::test_chat", "slow"),               # under a slow directory
    ("server/test_keepalive.py::test_x", "fast"),               # a fast module in it
    ("cli/test_cli.py", "slow"),
    ("clients/test_agent_clients.py::test_x", "slow"),          # "cli/" is not a prefix of it
    ("engine/runtime/test_reader.py::test_x", "fast"),          # nothing says so: fast
    ("native/test_multitoken_kernels.py::test_mxfp4_matmul[130-4096-avx2]", "slow"),
    ("native/test_multitoken_kernels.py::test_mxfp4_matmul[301-512-avx2]", "fast"),
    ("native/test_kernels.py::test_experts_forward_real_shape[scalar]", "slow"),
])
def test_the_longest_prefix_decides(rel_id, speed):
    assert speed_of(rel_id) == speed


def test_the_table_names_what_tests_holds_and_a_gone_file_is_named(tmp_path):
    assert missing_paths(TESTS) == []
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "test_kept.py").write_text("")
    table = {"server/": "slow", "server/test_kept.py::test_a": "fast", "server/test_renamed.py": "fast"}
    assert missing_paths(tmp_path, table) == ["server/test_renamed.py"]


def test_the_marker_reaches_the_collected_tests():
    # a real collection (strict markers on): the big shapes marked, the small ones left in the loop
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                          "-p", "no:cacheprovider", str(TESTS / "native" / "test_multitoken_kernels.py")],
                         capture_output=True, text=True, cwd=TESTS.parent, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = [line for line in out.stdout.splitlines() if "::" in line]
    assert kept and not any("130-4096" in line or "real_shape" in line for line in kept), kept
    assert any("301-512" in line for line in kept)
    assert "deselected" in out.stdout
    assert set(SPEED.values()) == {"slow", "fast"}


@pytest.mark.parametrize("rel, whole", [
    ("cli/", True), ("cli/test_cli.py", True),
    ("server/", False),                                          # it holds fast modules
    ("server/test_server.py", True), ("server/test_keepalive.py", False),
    ("native/test_multitoken_kernels.py", False),                # only some of its tests are slow
    ("engine/runtime/", False),
])
def test_only_what_is_wholly_slow_is_left_uncollected(rel, whole):
    assert wholly_slow(rel) is whole


def test_skipping_wholly_slow_modules_selects_the_same_tests():
    # `-m "(not slow)"` is the same selection over a full collection (every module imported)
    def collect(expr):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", expr,
                              "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=TESTS.parent, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if "::" in line]

    loop, full = collect("not slow"), collect("(not slow)")
    assert loop and loop == full
    assert not any(speed_of(line.split("/", 1)[1]) == "slow" for line in loop)
