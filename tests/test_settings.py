"""ds4f.settings: the whole ds4f.toml read once, the engine's settings and the front ends' ([console],
[history], [server], [dump], [runs]) from the same file, a section nobody reads refused, and every
bad value named by file and key. The engine's own load (ds4f.engine.config.load_config) passes
over the front ends' sections."""
from __future__ import annotations

import os
from importlib import resources

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ds4f.engine.config import load_config
from ds4f.errors import Ds4fError
from ds4f.settings import load_settings


def test_the_built_in_settings_are_the_shipped_files(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)     # no ./ds4f.toml here, and the session's XDG config dir is empty
    shipped = tomllib.loads(resources.files("ds4f").joinpath("ds4f.toml").read_text())
    s = load_settings()
    assert s.source == s.engine.source == "built-in ds4f.toml"
    assert (s.console.theme, s.console.refresh_s) == (shipped["console"]["theme"], shipped["console"]["refresh_s"])
    assert s.history_path == os.path.join(os.environ["XDG_DATA_HOME"], "ds4f", "history.sqlite3")
    assert s.server.parallel == shipped["server"]["parallel"] == 0
    assert (s.server.served_model_names, s.server.operator_token, s.server.operator_remote) == ((), "", False)
    assert (s.dump.runs, s.dump.text, s.dump.server) == tuple(shipped["dump"][k] for k in ("runs", "text", "server"))
    assert s.dump.mode("text") == shipped["dump"]["text"]
    assert shipped["dump"]["full_limit"] == "2 GB" and s.dump.full_limit == 2 * 10**9
    assert shipped["runs"]["budget"] == "20 GB" and s.runs_budget == 20 * 10**9
    assert s.engine.preset == shipped["engine"]["preset"] and set(s.engine.presets) == set(shipped["presets"])


def test_one_file_gives_the_engine_and_the_front_ends(tmp_path):
    path = tmp_path / "ds4f.toml"
    history = tmp_path / "runs.sqlite3"
    path.write_text(f'[engine]\nio_threads = 8\n[console]\nrefresh_s = 2.5\ntheme = "ds4f-light"\n'
                    f'[history]\npath = "{history}"\n'
                    f'[server]\nparallel = 3\nserved_model_name = "deepseek-v4-flash"\noperator_remote = true\n'
                    f'[dump]\ntext = "off"\nfull_limit = "1 GiB"\n[runs]\nbudget = "5 MB"\n')
    s = load_settings(path)
    assert s.source == s.engine.source == str(path)
    assert s.engine.io_threads == 8 and s.engine.kernel_threads == 0       # changed, and kept from the built-ins
    assert (s.console.theme, s.console.refresh_s) == ("ds4f-light", 2.5)
    assert s.history_path == str(history)
    assert (s.server.parallel, s.server.served_model_names, s.server.operator_remote) == (3, ("deepseek-v4-flash",), True)
    assert (s.dump.runs, s.dump.text, s.dump.full_limit) == ("full", "off", 2**30)
    assert s.runs_budget == 5 * 10**6
    path.write_text('[server]\nserved_model_name = ["deepseek-v4-flash", "deepseek-chat"]\n')
    assert load_settings(path).server.served_model_names == ("deepseek-v4-flash", "deepseek-chat")


@pytest.mark.parametrize("text, words", [
    ("[engin]\n", ["[engin]", "unknown section", "engine", "console", "runs", "presets"]),
    ("[console]\nrefresh = 2\n", ["console.refresh", "unknown key", "refresh_s"]),
    ("[console]\nrefresh_s = 0\n", ["console.refresh_s", "between 0.05 and 60"]),
    ("[console]\nrefresh_s = nan\n", ["console.refresh_s"]),
    ("[console]\ntheme = 3\n", ["console.theme", "expected str"]),
    ('[history]\npath = "a\\u0000b"\n', ["history.path", "NUL"]),
    ("[server]\nparallel = 65\n", ["server.parallel", "between 0"]),
    ('[server]\nserved_model_name = ["a b"]\n', ["server.served_model_name", "without spaces"]),
    ('[server]\nserved_model_name = ["x", "x"]\n', ["server.served_model_name", "none twice"]),
    ('[server]\noperator_remote = "yes"\n', ["server.operator_remote", "expected bool"]),
    ('[dump]\nruns = "half"\n', ["dump.runs", "full | compact | off"]),
    ('[runs]\nbudget = "10%"\n', ["runs.budget", "not a fraction"]),
    ("[engine]\nio_threads = 10000\n", ["engine.io_threads"]),      # the engine's own checks, through the same load
])
def test_a_bad_setting_names_the_file_and_the_key(tmp_path, text, words):
    path = tmp_path / "ds4f.toml"
    path.write_text(text)
    with pytest.raises(Ds4fError) as err:
        load_settings(path)
    message = str(err.value)
    assert str(path) in message, message
    for w in words:
        assert w in message, message


def test_the_engine_alone_passes_over_the_front_ends_sections(tmp_path):
    """load_config reads [engine] from a file whose [console] and [dump] are bad and which has a
    section nobody reads: those are the whole file's reader's to refuse (load_settings)."""
    path = tmp_path / "ds4f.toml"
    path.write_text('[engine]\nio_threads = 8\n[console]\nrefresh_s = 0\n[dump]\nruns = "half"\n')
    assert load_config(path).io_threads == 8
    with pytest.raises(Ds4fError, match=r"console\.refresh_s"):
        load_settings(path)
    path.write_text("[engine]\nio_threads = 8\n[engin]\nio_threads = 3\n")
    assert load_config(path).io_threads == 8
    with pytest.raises(Ds4fError, match=r"unknown section \[engin\]"):
        load_settings(path)

