"""A wheel ships what the editable install runs: the wheel is built from this tree, installed
without -e into a fresh virtual environment, and there every module of the source tree imports
from the installed copy, the package data is present, and both entry points run.

The fresh environment has no packages of its own besides ds4f: it reaches this environment's
dependencies through a .pth line (no download), which adds their folder to sys.path without
running the editable install's finder, so nothing of ds4f can come from the source tree.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]          # the repository root is the ds4f package
NOT_INSTALLED = {"tests", "tools", "build", "dist"}


def source_modules() -> list[str]:
    """Every module of the package in the source tree, as an import name."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        parts = Path(folder).relative_to(ROOT).parts
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")) and not d.endswith(".egg-info")
                         and not (not parts and d in NOT_INSTALLED))
        for name in sorted(files):
            if not name.endswith(".py") or (not parts and name == "setup.py"):
                continue
            stem = name[:-3]
            found.append(".".join(("ds4f", *parts) + (() if stem == "__init__" else (stem,))))
    return found


def _run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the source tree (an in-tree build would leave build/ here,
    whose stale files a later wheel could pick up)."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "_kernels.c", "snapshot_report.html"))
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", out])
    wheels = list(out.glob("ds4f-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "ds4f_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel])
    return venv


def test_the_wheel_holds_every_module_and_no_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in source_modules():
        rel = module.split(".")[1:]
        path = "/".join(["ds4f", *rel]) + ".py"
        package = "/".join(["ds4f", *rel, "__init__.py"])
        assert path in names or package in names, f"{module} is missing from {wheel.name}"
    assert not any(n.startswith("ds4f/tests/") or n == "ds4f/setup.py" for n in names)
    assert any(n.startswith("ds4f/native/_kernels") for n in names), "the compiled kernels are missing"
    for data in ("ds4f/ds4f.toml", "ds4f/themes/console.tcss", "ds4f/engine/text/corpus.txt",
                 "ds4f/native/include/ds4f_kernels.h", "ds4f/native/scalar/matvec.c"):
        assert data in names, f"{data} is missing from {wheel.name}"


def test_every_module_imports_from_the_installed_wheel(fresh_venv):
    modules = [m for m in source_modules() if not m.endswith("__main__")]
    script = textwrap.dedent("""
        import importlib, json, sys
        failed, outside = {}, []
        for name in sys.argv[1:]:
            try:
                mod = importlib.import_module(name)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            if not mod.__file__.startswith(sys.prefix):
                outside.append(f"{name}: {mod.__file__}")
        print(json.dumps({"failed": failed, "outside": outside}))
    """)
    out = _run([fresh_venv / "bin" / "python", "-c", script, *modules], cwd=fresh_venv)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, result["failed"]
    assert result["outside"] == [], f"modules imported from outside the fresh environment: {result['outside']}"
    assert len(modules) > 100


def test_both_entry_points_run_from_the_installed_wheel(fresh_venv, tmp_path):
    """ds4f makes a tiny checkpoint and runs it (the compiled kernels, the built-in ds4f.toml);
    the console opens its dashboard on it (the stylesheets and themes) and quits."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    bin_ = fresh_venv / "bin"
    assert "ds4f" in _run([bin_ / "ds4f", "--version"], cwd=tmp_path, env=env).stdout
    model = tmp_path / "tiny"
    _run([bin_ / "ds4f", "synth", model, "--geometry", "tiny", "--seed", "0"], cwd=tmp_path, env=env)
    run = _run([bin_ / "ds4f", "run", model, "-n", "2", "--no-probe", "--json", "-"], cwd=tmp_path, env=env)
    report = json.loads(run.stdout)
    assert report["state"] == "done" and len(report["generated"]) == 2 and report["state_sha256"]
    assert "ds4f-console" in _run([bin_ / "ds4f-console", "--help"], cwd=tmp_path, env=env).stdout
    script = textwrap.dedent("""
        import asyncio, sys
        from ds4f.console.app import Ds4fConsole

        async def drive():
            app = Ds4fConsole(model=sys.argv[1])
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause(0.5)
                print(type(app.screen).__name__, app.theme)
                await pilot.press("q")

        asyncio.run(drive())
    """)
    shown = _run([bin_ / "python", "-c", script, model], cwd=tmp_path, env=env).stdout.split()
    assert shown[0] == "DashboardScreen" and shown[1].startswith("ds4f-"), shown
