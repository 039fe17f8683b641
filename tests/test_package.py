"""The package installs as one import package with the compiled kernels inside."""
import importlib
import subprocess
import sys


def test_subpackages_import():
    for name in ("ds4f.engine", "ds4f.console", "ds4f.themes", "ds4f.native", "ds4f.cli", "ds4f.server"):
        assert importlib.import_module(name).__name__ == name


def test_compiled_kernels_present():
    from ds4f.native import _kernels

    assert _kernels.lib.ds4f_backend_supported(0) == 1


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("bench-kernels", "synth", "convert", "verify", "run", "diff"):
        assert cmd in out.stdout


def test_every_command_has_working_help():
    from ds4f.cli import COMMANDS

    for name in COMMANDS:
        out = subprocess.run([sys.executable, "-m", "ds4f.cli", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, (name, out.stderr)
        assert f"ds4f {name}" in out.stdout and "Traceback" not in out.stderr


def test_bench_console_has_working_help():
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "console", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "console" in out.stdout and "Traceback" not in out.stderr


def test_run_defaults_to_the_api_token_count():
    import argparse

    from ds4f.api import DEFAULT_GEN
    from ds4f.cli import runs

    parser = argparse.ArgumentParser()
    runs.configure("run", parser)
    assert parser.parse_args(["MODEL"]).gen is None    # left to the run API: DEFAULT_GEN
    assert f"(default {DEFAULT_GEN})" in " ".join(parser.format_help().split())


def test_short_options_are_llama_cpps():
    import argparse

    from ds4f.cli import bench, runs

    parser = argparse.ArgumentParser()
    runs.configure("run", parser)
    a = parser.parse_args(["-m", "M", "-n", "3", "-t", "2", "-p", "0,5"])
    assert (a.model_option, a.gen, a.threads, a.prompt) == ("M", 3, 2, "0,5")
    parser = argparse.ArgumentParser()
    bench.configure("bench", parser)
    b = parser.parse_args(["engine", "-m", "M", "-n", "4", "-o", "csv"])
    assert (b.model_option, b.gen, b.output) == ("M", 4, "csv")


def test_version_and_output_options_in_help():
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "--help"], capture_output=True, text=True)
    assert "--version" in out.stdout
    for cmd in (["bench", "engine"], ["bench-kernels"], ["replay"], ["history", "list"]):
        out = subprocess.run([sys.executable, "-m", "ds4f.cli", *cmd, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "-o {text,md,csv,json}" in out.stdout, (cmd, out.stdout)
