"""ds4f.toml whole: the engine's settings (ds4f.engine.config) and the front ends': [console]
(theme, refresh period), [history] (the run history's file), [server], [dump] (the state dump
each kind of run writes), [runs] (the runs directory's budget).

load_settings reads the file once (engine.config.read_config: the lookup, the merge over the
built-in ds4f.toml, the path checks) and returns both; a section nobody reads is refused, and
every problem names the file and the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ds4f.engine.config import DEFAULT_PARALLEL, MAX_PARALLEL, Config, config_from, parse_budget, read_config
from ds4f.errors import Ds4fError
from ds4f.paths import user_data_dir

# The front ends' sections: each key and the types its value may have.
SECTIONS = {
    "console": {"theme": str, "refresh_s": (int, float)},
    "history": {"path": str},
    "server": {"parallel": int, "served_model_name": (str, list), "operator_token": str, "operator_remote": bool},
    "dump": {"runs": str, "text": str, "server": str, "full_limit": (str, int)},
    "runs": {"budget": (str, int)},
}
PATH_KEYS = (("history", "path"),)   # checked at load: no NUL byte, not too long

DUMP_MODES = ("full", "compact", "off")     # a run's state dump: every float, digests and sketches, none
DUMP_KINDS = ("runs", "text", "server")    # [dump]'s keys: who starts the run
MIN_RUNS_BUDGET = 10**6    # [runs] budget: less holds no run's report


@dataclass(frozen=True)
class ConsoleSettings:
    """[console]: the theme (the console remembers the last one chosen) and the refresh period."""
    theme: str
    refresh_s: float


@dataclass(frozen=True)
class ServerSettings:
    """[server]: what `ds4f serve` goes by when its options do not say."""
    parallel: int                        # sequences stepped together; 0: as many as the memory plan fits
    served_model_names: tuple[str, ...]  # the names it answers to (served_model_name)
    operator_token: str                  # the operator endpoints' token ("": a random one)
    operator_remote: bool                # the operator endpoints answer beyond loopback


@dataclass(frozen=True)
class DumpSettings:
    """[dump]: the state dump each kind of run writes, and the largest full dump a run may write."""
    runs: str                            # ds4f run, the console's runs (short measured experiments)
    text: str                            # ds4f generate and chat, the console's chat
    server: str                          # each request ds4f serve answers
    full_limit: int                      # bytes; a full dump past it is refused before its run starts

    def mode(self, kind: str) -> str:
        return getattr(self, kind)


@dataclass(frozen=True)
class Settings:
    """The config in force: the engine's settings and the front ends'."""
    source: str                          # the file the user's values came from ("built-in ds4f.toml" if none)
    engine: Config                       # [model], [engine], [presets], [kv]
    console: ConsoleSettings
    history_path: str                    # [history] path, resolved, never empty
    server: ServerSettings
    dump: DumpSettings
    runs_budget: int                     # [runs] budget: bytes of the runs directory and the history together


def load_settings(explicit: str | os.PathLike | None = None, *, check_dirs: bool = True) -> Settings:
    """Read the config in force (explicit, ./ds4f.toml, the user's, the built-in one); raise
    Ds4fError naming file and key. check_dirs: as engine.config.config_from."""
    file = read_config(explicit, SECTIONS, PATH_KEYS)
    engine = config_from(file, check_dirs=check_dirs)
    raw, source = file.values, file.source
    return Settings(source=source, engine=engine, console=_console(raw["console"], source),
                    history_path=os.path.expanduser(raw["history"]["path"] or str(user_data_dir() / "history.sqlite3")),
                    server=_server(raw["server"], source), dump=_dump(raw["dump"], source),
                    runs_budget=_runs_budget(raw["runs"], source))


def _console(con: dict, source: str) -> ConsoleSettings:
    if not 0.05 <= float(con["refresh_s"]) <= 60:  # (also false for NaN)
        raise Ds4fError(f"{source}: console.refresh_s: must be between 0.05 and 60 seconds, got {con['refresh_s']}")
    return ConsoleSettings(theme=con["theme"], refresh_s=float(con["refresh_s"]))


def _server(server: dict, source: str) -> ServerSettings:
    parallel = server["parallel"]
    if not 0 <= parallel <= MAX_PARALLEL:
        raise Ds4fError(f"{source}: server.parallel: must be between 0 (as many as the memory plan fits, at most"
                        f" {DEFAULT_PARALLEL}) and {MAX_PARALLEL} sequences, got {parallel}")
    names = server.get("served_model_name", [])
    names = [names] if isinstance(names, str) else names
    if not all(isinstance(n, str) and n and not any(c.isspace() for c in n) for n in names) \
            or len(set(names)) != len(names):
        raise Ds4fError(f"{source}: server.served_model_name: a name, or a list of names (each without spaces,"
                        f" none twice), got {server['served_model_name']!r}")
    return ServerSettings(parallel=parallel, served_model_names=tuple(names),
                          operator_token=server.get("operator_token", ""),
                          operator_remote=server.get("operator_remote", False))


def _runs_budget(runs: dict, source: str) -> int:
    size = parse_budget(runs["budget"], f"{source}: runs.budget")
    if size.nbytes is None:
        raise Ds4fError(f"{source}: runs.budget: a size like '20 GB', not a fraction, got {runs['budget']!r}")
    if size.nbytes < MIN_RUNS_BUDGET:
        raise Ds4fError(f"{source}: runs.budget: at least 1 MB (a run's report alone takes tens of KB), got"
                        f" {runs['budget']!r}")
    return size.nbytes


def _dump(dump: dict, source: str) -> DumpSettings:
    for kind in DUMP_KINDS:
        if dump[kind] not in DUMP_MODES:
            raise Ds4fError(f"{source}: dump.{kind}: {' | '.join(DUMP_MODES)}, got {dump[kind]!r}")
    limit = parse_budget(dump["full_limit"], f"{source}: dump.full_limit")
    if limit.nbytes is None:
        raise Ds4fError(f"{source}: dump.full_limit: a size like '2 GB', not a fraction, got {dump['full_limit']!r}")
    return DumpSettings(**{k: dump[k] for k in DUMP_KINDS}, full_limit=limit.nbytes)
