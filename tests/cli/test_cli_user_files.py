"""Files the user names to the CLI (--config, a trace, --token-file, the history of a config) and
the paths a config names: a FIFO (which would block), a device (which never ends), a directory, a
file past its bound, TOML nested past the parser, a path with a NUL byte: each a one-line error
naming the file or the key, from a real process given a deadline, never a hang or a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def ds4f(*args, cwd=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_refused(out, *words):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    for w in words:
        assert str(w) in line, (w, line)


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "named.fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("key,section", [("dir", "kv"), ("path", "history"), ("path", "model")])
def test_a_nul_byte_in_a_config_path_is_named_by_its_key(tiny_model, tmp_path, key, section):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[{section}]\n{key} = "{tmp_path}/a\\u0000b"\n[engine]\nprobe_floor = false\n')
    assert_refused(ds4f("run", tiny_model, "-n", "1", "--config", cfg), cfg, f"{section}.{key}", "NUL byte")


def test_a_config_path_longer_than_the_system_takes(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[kv]\ndir = "{tmp_path}/{"k" * 300}"\n')
    assert_refused(ds4f("run", tiny_model, "-n", "1", "--config", cfg), "kv.dir", "longer than the system takes")


def test_a_config_that_is_not_a_regular_file_or_too_large(tiny_model, tmp_path, fifo):
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    for target, why in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (folder, "a directory")):
        assert_refused(ds4f("run", tiny_model, "-n", "1", "--config", target), "config file", target, why)
    big = tmp_path / "big.toml"
    big.write_text("[engine]\nprobe_floor = false\n" + "#" * (1 << 20) + "\n")
    assert_refused(ds4f("run", tiny_model, "-n", "1", "--config", big), big, "larger than 1 MiB")
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert_refused(ds4f("run", tiny_model, "-n", "1", "--config", deep), deep, "nested too deeply")


def test_a_fifo_named_ds4f_toml_in_the_working_directory_is_refused_not_skipped(tiny_model, tmp_path):
    os.mkfifo(tmp_path / "ds4f.toml")
    assert_refused(ds4f("plan", cwd=tmp_path), "ds4f.toml", "a FIFO")


def test_a_trace_that_is_a_fifo_or_a_device(tmp_path, fifo):
    for target, why in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        assert_refused(ds4f("replay", target), "trace", target, why)
        assert_refused(ds4f("trace", "export", target, tmp_path / "t.npz"), "trace", target, why)
    npz = tmp_path / "t.npz"
    os.mkfifo(npz)
    assert_refused(ds4f("replay", npz), npz, "a FIFO")


def test_a_token_file_that_is_a_fifo_or_a_device(tiny_model, fifo):
    for target, why in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        assert_refused(ds4f("serve", "-m", tiny_model, "--port", "0", "--token-file", target), "--token-file", target, why)


def test_the_console_reads_token_files_the_same_way(fifo):
    from ds4f.console.app import read_token
    from ds4f.errors import Ds4fError

    for target, why in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        with pytest.raises(Ds4fError, match=why):
            read_token(str(target))


def test_a_history_that_is_a_fifo_or_a_device(tmp_path, fifo):
    for target, why in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        cfg = tmp_path / "ds4f.toml"
        cfg.write_text(f'[history]\npath = "{target}"\n')
        assert_refused(ds4f("history", "--config", cfg, "list"), target, why, "not a run history")


def test_a_kv_dir_that_is_a_file_is_refused_naming_the_key_and_the_file(tiny_model, tmp_path, fifo):
    """[kv] dir (or --kv-dir) naming a regular file, a FIFO, or a path under a regular file: the
    command stops before any run, naming the key and the file in the way (the prefix cache would
    otherwise keep nothing on disk without a word)."""
    taken = tmp_path / "notes.txt"
    taken.write_text("a file where the prefix cache's directory should be\n")
    for where, says in ((taken, f"{taken} is a regular file, not a directory"),
                        (taken / "kv", f"{taken} is a regular file, so {taken / 'kv'} cannot be a directory"),
                        (fifo, f"{fifo} is a FIFO, not a directory")):
        cfg = tmp_path / "ds4f.toml"
        cfg.write_text(f'[engine]\nprobe_floor = false\n[kv]\ndir = "{where}"\n')
        for command in (("run", tiny_model, "-n", "1"), ("generate", tiny_model, "-p", "hi", "-n", "1")):
            assert_refused(ds4f(*command, "--config", cfg), cfg, "kv.dir", says)
    plain = tmp_path / "plain.toml"
    plain.write_text('[engine]\nprobe_floor = false\n')
    assert_refused(ds4f("generate", tiny_model, "-p", "hi", "-n", "1", "--config", plain, "--kv-dir", taken),
            "--kv-dir", f"{taken} is a regular file, not a directory")
    assert_refused(ds4f("serve", "-m", tiny_model, "--port", "0", "--config", plain, "--kv-dir", taken / "kv"),
            "--kv-dir", f"{taken} is a regular file, so {taken / 'kv'} cannot be a directory")
    # no directory kept on disk (kv.budget = 0), or --no-kv: nothing to refuse
    cfg.write_text(f'[engine]\nprobe_floor = false\n[kv]\ndir = "{taken}"\nbudget = 0\n')
    assert ds4f("generate", tiny_model, "-p", "hi", "-n", "1", "--config", cfg).returncode == 0
    out = ds4f("generate", tiny_model, "-p", "hi", "-n", "1", "--config", plain, "--kv-dir", taken, "--no-kv")
    assert out.returncode == 0, out.stderr
    assert taken.read_text().startswith("a file where")           # never written into or replaced
