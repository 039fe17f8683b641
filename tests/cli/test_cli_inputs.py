"""No output of a command replaces what the command reads, even with --force: the files of the
checkpoint it runs (and any path inside its directory), a symlink or hard link to one of them, the
config file in use, the run history and SQLite's files beside it, the prefix cache's directory,
ds4f's own caches, the command's other output. Each case is a real command on a real copy of the
tiny checkpoint; after the refusal every input is byte for byte what it was."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds4f.cli import main
from ds4f.paths import user_cache_dir
from ds4f.runs.history import History


def ds4f(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _digests(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.fixture
def setup(tiny_model, tmp_path):
    """A copy of the tiny checkpoint, a config naming it with its own history and kv dir, and
    the history database made."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "state.kv").write_bytes(b"a kept state")
    history = tmp_path / "hist.db"
    History(history)
    (tmp_path / "hist.db-wal").write_bytes(b"")
    config = tmp_path / "ds4f.toml"
    config.write_text(f'[model]\npath = "{model}"\n[engine]\nprobe_floor = false\n'
                      f'[history]\npath = "{history}"\n[kv]\ndir = "{kv}"\n')
    user_cache_dir().mkdir(parents=True, exist_ok=True)
    floor = user_cache_dir() / "floor.json"
    if not floor.exists():
        floor.write_text("{}\n")
    (tmp_path / "link.json").symlink_to(model / "config.json")
    os.link(model / "pool-mxfp4.json", tmp_path / "hard.json")
    roots = (model, kv, history, tmp_path / "hist.db-wal", config, floor)
    return {"model": model, "kv": kv, "history": history, "config": config, "floor": floor, "tmp": tmp_path,
            "before": _digests(*roots), "roots": roots}


def assert_refused(capsys, argv, *words) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "internal error" not in err, err
    assert "never replaced" in err and "even with --force" in err, err
    for w in words:
        assert str(w) in err, (w, err)
    return err


def assert_unchanged(setup) -> None:
    assert _digests(*setup["roots"]) == setup["before"]
    assert not [p for p in setup["model"].iterdir() if p.name.endswith((".partial", ".report.json"))]


@pytest.mark.parametrize("option", ["--dump-state", "--json"])
def test_run_never_replaces_what_it_reads(setup, capsys, option):
    m, cfg = setup["model"], setup["config"]
    run = ["run", m, "-n", "1", "--config", cfg, "--force", "--history"]
    targets = [m / name for name in ("pool-mxfp4.bin", "pool-mxfp4.json", "config.json", "trunk.json",
                                     "trunk.bin", "tokenizer.json")]
    targets += [m / "new.bin",                       # a new file inside the checkpoint directory
                setup["tmp"] / "link.json",          # a symlink to its config.json
                setup["tmp"] / "hard.json",          # a hard link to its pool-mxfp4.json
                cfg, setup["history"], setup["tmp"] / "hist.db-wal", setup["kv"] / "state.kv",
                setup["kv"] / "new.json", setup["floor"]]
    for target in targets:
        assert_refused(capsys, [*run, option, target], option, target)
    assert_unchanged(setup)


def test_the_report_next_to_a_dump_is_held_to_the_same_rule(setup, capsys):
    m = setup["model"]
    (setup["tmp"] / "config.report.json").symlink_to(m / "config.json")
    assert_refused(capsys, ["run", m, "-n", "1", "--config", setup["config"], "--force",
                      "--dump-state", setup["tmp"] / "config.bin"], "the report", "config.report.json")
    assert_unchanged(setup)


def test_generate_and_bench_json_never_replace_what_they_read(setup, capsys):
    m, cfg = setup["model"], setup["config"]
    elsewhere = setup["tmp"] / "elsewhere-kv"
    elsewhere.mkdir()
    (elsewhere / "x.kv").write_bytes(b"kept")
    assert_refused(capsys, ["generate", m, "-p", "hi", "--config", cfg, "--json", m / "tokenizer.json", "--force"],
             "tokenizer.json")
    assert_refused(capsys, ["generate", m, "-p", "hi", "--config", cfg, "--kv-dir", elsewhere, "--json",
                      elsewhere / "x.kv", "--force"], "x.kv")
    assert_refused(capsys, ["bench", "engine", m, "--config", cfg, "--json", m / "config.json", "--force"], "config.json")
    assert_refused(capsys, ["bench", "cache", "--config", cfg, "--json", setup["history"], "--force"], "the run history")
    assert (elsewhere / "x.kv").read_bytes() == b"kept"
    assert_unchanged(setup)


def test_bench_kernels_never_replaces_the_config_it_finds(setup):
    """The config in the working directory is the one in use: a real process there."""
    cwd = setup["tmp"]
    out = ds4f("bench-kernels", "--json", "ds4f.toml", "--force", cwd=cwd)
    assert out.returncode == 2 and "the config file in use" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert_unchanged(setup)


def test_replay_plot_and_trace_export_never_replace_what_they_read(setup, capsys, monkeypatch):
    tmp = setup["tmp"]
    monkeypatch.chdir(tmp)                           # ./ds4f.toml: the config in use
    dump = tmp / "out" / "a.bin"
    dump.parent.mkdir()
    assert main(["run", str(setup["model"]), "-n", "2", "--config", str(setup["config"]),
                 "--dump-state", str(dump)]) == 0
    capsys.readouterr()
    (tmp / "plot.png").symlink_to(setup["config"])
    assert_refused(capsys, ["replay", dump, "--sweep", "--plot", tmp / "plot.png", "--force"], "the config file in use")
    os.link(setup["history"], tmp / "hist.npz")
    assert_refused(capsys, ["trace", "export", dump, tmp / "hist.npz", "--force"], "the run history")
    assert_refused(capsys, ["trace", "export", dump, setup["model"] / "t.npz"], "the checkpoint directory")
    assert_unchanged(setup)


def test_convert_and_synth_never_replace_a_directory_holding_an_input(setup, capsys, tiny_official, tmp_path,
                                                                     monkeypatch):
    src = tmp_path / "official"
    shutil.copytree(tiny_official, src)
    before = _digests(src)
    assert_refused(capsys, ["convert", src, src / "inside"], "the source checkpoint")
    layout = tmp_path / "layout"
    shutil.copytree(setup["model"], layout)         # a ds4f layout, which --force would replace...
    History(layout / "hist.db")                      # ...holding the run history of the config in use
    cfg = tmp_path / "cwd" / "ds4f.toml"
    cfg.parent.mkdir()
    cfg.write_text(f'[history]\npath = "{layout / "hist.db"}"\n')
    monkeypatch.chdir(cfg.parent)                    # ./ds4f.toml: the config in use
    assert_refused(capsys, ["convert", src, layout, "--force"], "holding the run history")
    assert_refused(capsys, ["synth", layout, "--force"], "holding the run history")
    assert (layout / "hist.db").is_file() and (layout / "pool-mxfp4.json").is_file()
    assert _digests(src) == before
    assert_unchanged(setup)


def test_a_real_run_refuses_the_history_it_records_to(setup):
    """The report's --json aimed at the history database the run records to, in a real process."""
    out = ds4f("run", setup["model"], "-n", "1", "--config", setup["config"], "--history", "--json",
               setup["history"], "--force")
    assert out.returncode == 2 and "the run history" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert_unchanged(setup)
