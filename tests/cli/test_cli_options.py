"""The command line's options: each defined once (ds4f.cli.options), the same on every command."""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ds4f.cli
import ds4f.console.app
from ds4f.cli import COMMANDS

CLI = Path(ds4f.cli.__file__).parent
CONSOLE_APP = Path(ds4f.console.app.__file__)   # ds4f-console's own options


def _option_definitions() -> dict[str, list[str]]:
    """Every `--flag` string given to an add_argument call in ds4f/cli/ and the console's app, with where."""
    found: dict[str, list[str]] = {}
    for path in [*sorted(CLI.glob("*.py")), CONSOLE_APP]:
        tree = ast.parse(path.read_text(), str(path))
        named: dict[str, set[str]] = {}   # add_argument(*flags): the strings assigned to `flags`
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                named.setdefault(node.targets[0].id, set()).update(
                    c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags: set[str] = set()
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        flags.add(arg.value)
                    elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
                        flags |= named.get(arg.value.id, set())
                for flag in sorted(f for f in flags if f.startswith("-")):
                    found.setdefault(flag, []).append(f"{path.name}:{node.lineno}")
    return found


def test_no_option_is_defined_twice():
    found = _option_definitions()
    twice = {flag: where for flag, where in found.items() if len(where) > 1}
    assert not twice, f"options defined more than once (give them a builder in cli/options.py): {twice}"
    # the shared ones live in options.py (their builders)
    for flag in ("--config", "--preset", "--spec", "--threads", "--io-threads", "--backend", "--json", "--force",
                 "--parallel", "--seed", "--history", "--output", "--dump", "--kv-dir", "--prompt", "--repeat",
                 "--model", "--token-file", "--operator-token", "--max-tokens"):
        assert found[flag][0].startswith("options.py:"), (flag, found[flag])


def _parser(name: str) -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog=f"ds4f {name}")
    importlib.import_module(COMMANDS[name][0]).configure(name, parser)
    return parser


def _spec_commands() -> list[str]:
    return [name for name in COMMANDS if "--spec" in _parser(name)._option_string_actions]


def test_spec_takes_the_same_values_everywhere():
    names = _spec_commands()
    assert {"run", "generate", "chat", "serve", "plan"} <= set(names)
    helps = set()
    for name in names:
        action = _parser(name)._option_string_actions["--spec"]
        helps.add(action.help.split(";")[0])
        extra = ["-p", "x"] if name == "generate" else []
        for given, parsed in ((["--spec"], "auto"), (["--spec", "2"], "2"), (["--spec", "off"], "off"), ([], "off")):
            assert _parser(name).parse_args(extra + given).spec == parsed, (name, given)
    assert len(helps) == 1, helps    # one text, a command's own note after it


def _plan(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", "plan", "--geometry", "real", "--ram", "24GiB", *argv],
                          capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("given", [("--spec",), ("--spec", "auto"), ("--spec", "2")])
def test_plan_spec_on(given, tmp_path):
    out = _plan(*given, cwd=tmp_path)
    assert "MTP layer" in out.stdout and "speculative decoding" in out.stdout, out.stdout + out.stderr


def test_plan_spec_off_and_bad(tmp_path):
    for given in ((), ("--spec", "off"), ("--spec", "0")):
        out = _plan(*given, cwd=tmp_path)
        assert out.returncode in (0, 1) and "MTP layer" not in out.stdout, out.stdout + out.stderr
    bad = _plan("--spec", "many", cwd=tmp_path)
    assert bad.returncode == 2 and "'many'" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stdout == ""


def test_serve_takes_the_model_as_the_others_do():
    """MODEL or -m MODEL, the same builder; both at once must agree."""
    from ds4f.cli.options import model_arg

    for argv in (["ck"], ["-m", "ck"], ["--model", "ck"], ["ck", "-m", "ck"]):
        assert model_arg(_parser("serve").parse_args(argv)) == "ck", argv
    from ds4f.api import Ds4fError

    with pytest.raises(Ds4fError, match="give the model once"):
        model_arg(_parser("serve").parse_args(["a", "-m", "b"]))


def test_the_console_shares_the_commands_options():
    """ds4f-console's --config, MODEL/-m, --preset, --parallel by the same builders as ds4f's commands."""
    from ds4f.cli.console import build_parser

    console = build_parser()
    for flag, command in (("--config", "run"), ("--preset", "run"), ("--model", "run"), ("--parallel", "plan"),
                          ("--token-file", "serve")):
        ours, theirs = console._option_string_actions[flag], _parser(command)._option_string_actions[flag]
        assert (ours.metavar, ours.dest, ours.type) == (theirs.metavar, theirs.dest, theirs.type), flag
        assert ours.help.split("(")[0] == theirs.help.split("(")[0], flag
    args = console.parse_args(["ck", "--preset", "laptop"])
    assert (args.model, args.preset, args.parallel, args.attach, args.serve) == ("ck", "laptop", 1, None, None)


def test_history_config_before_and_after_the_action():
    for argv in (["--config", "x.toml", "list"], ["list", "--config", "x.toml"]):
        args = _parser("history").parse_args(argv)
        assert "x.toml" in (args.config, args.config_after), argv
