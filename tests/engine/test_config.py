"""ds4f.toml's engine settings: lookup, merging over the built-ins, and errors that name the file and
the key (the front ends' sections and the whole file: tests/test_settings.py)."""
import pytest

from ds4f.engine.config import Budget, load_config, parse_budget
from ds4f.errors import Ds4fError


def test_builtin_presets(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ./ds4f.toml here, and the XDG config dir is empty
    cfg = load_config()
    assert cfg.source == "built-in ds4f.toml"
    assert {"laptop", "server"} <= set(cfg.presets)
    assert cfg.presets["server"].pinned_count(43) == 43
    assert 0 < cfg.presets["laptop"].pinned_count(43) < 43
    assert cfg.presets["laptop"].cache.resolve(1000) == 250


def test_user_file_merges_over_builtins(tmp_path):
    path = tmp_path / "ds4f.toml"
    path.write_text('[engine]\nio_threads = 8\n[presets.big]\npinned_layers = 10\ncache = "2 GiB"\n')
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.io_threads == 8 and cfg.kernel_threads == 0  # changed, and kept from the built-ins
    assert cfg.presets["big"].cache == Budget(nbytes=2 * 2**30)
    assert cfg.presets["big"].pinned_count(43) == 10
    assert "laptop" in cfg.presets


def test_current_directory_config_wins(monkeypatch, tmp_path):
    (tmp_path / "ds4f.toml").write_text('[engine]\npreset = "server"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config().preset == "server"


@pytest.mark.parametrize("text, words", [
    ("[engine]\nio_thread = 3\n", ["engine.io_thread", "unknown key"]),
    ("[engine]\nio_threads = 'many'\n", ["engine.io_threads", "expected int"]),
    ("[engine]\nbackend = 'sse9'\n", ["engine.backend", "sse9"]),
    ("[engine]\npreset = 'nope'\n", ["engine.preset", "nope"]),
    ("[presets.x]\ncache = 'lots'\n", ["presets.x.cache", "lots"]),
    ("[presets.x]\ncache = '140%'\n", ["presets.x.cache", "140%"]),
    ("[presets.x]\npinned_layers = 'half'\n", ["presets.x.pinned_layers", "half"]),
    ("[presets.x]\npolicy = 'random'\n", ["presets.x.policy", "random"]),
    ("[engine\n", ["not valid TOML"]),
])
def test_bad_config_names_file_and_key(tmp_path, text, words):
    path = tmp_path / "ds4f.toml"
    path.write_text(text)
    with pytest.raises(Ds4fError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    for w in words:
        assert w in message


def test_missing_explicit_config(tmp_path):
    with pytest.raises(Ds4fError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_budget_forms():
    assert parse_budget("25%", "k").resolve(400) == 100
    assert parse_budget("1.5 GiB", "k").resolve(2**40) == int(1.5 * 2**30)
    assert parse_budget("512MiB", "k").nbytes == 512 * 2**20
    assert parse_budget(0.5, "k").fraction == 0.5
    with pytest.raises(Ds4fError, match="k"):
        parse_budget("-3 GiB", "k")


@pytest.mark.parametrize("value, words", [
    ("'0.25'", ["no unit", "0.25 GiB"]),          # a bare number in a string is not 0 bytes
    ("1.5", ["fraction", "between 0 and 1"]),       # nor 1 byte
    ("nan", ["fraction"]),
    ("inf", ["fraction"]),
    ("0", ["positive"]),
    ("'0%'", ["more than 0%"]),
    ("'0 GiB'", ["no room"]),
    ("'99999999 TiB'", ["more than any machine", "1 EiB"]),
    ("18446744073709551615", ["more than any machine"]),
])
def test_cache_sizes_need_a_unit_and_a_sane_value(tmp_path, value, words):
    path = tmp_path / "ds4f.toml"
    path.write_text(f"[presets.x]\ncache = {value}\n")
    with pytest.raises(Ds4fError) as err:
        load_config(path)
    assert "presets.x.cache" in str(err.value) and str(path) in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.parametrize("text, key", [
    ("[engine]\nio_threads = 10000\n", "engine.io_threads"),
    ("[engine]\nkernel_threads = 10000\n", "engine.kernel_threads"),
    ("[presets.x]\nio_threads = 10000\n", "presets.x.io_threads"),
])
def test_thread_counts_are_bounded(tmp_path, text, key):
    path = tmp_path / "ds4f.toml"
    path.write_text(text)
    with pytest.raises(Ds4fError, match=key.replace(".", r"\.")):
        load_config(path)


def test_a_config_that_is_not_utf8_is_a_clear_error(tmp_path):
    path = tmp_path / "ds4f.toml"
    path.write_bytes(b"[engine]\npreset = '\xff\xfe'\n")
    with pytest.raises(Ds4fError, match="not UTF-8"):
        load_config(path)


def test_a_budget_is_capped_at_its_whole():
    b = parse_budget("1 TiB", "k")
    assert b.exceeds(2**30) and b.resolve(2**30) == 2**30
    assert not parse_budget("25%", "k").exceeds(2**30)
