"""Where a command's output goes, and its tables as text, Markdown, CSV or JSON.

Two options, shared by the commands that have tables or a JSON result:

- `-o/--output text|md|csv|json`: the format of the command's tables. `text` is the command's
  usual output. With md, csv or json, stdout holds the tables and nothing else (the other
  lines go to stderr), so it can be piped or redirected as it is.
- `--json PATH`: the full result as JSON in PATH; `--json -` writes it to stdout, and the
  human-readable lines then go to stderr, so stdout is valid JSON.

Only one of them may have stdout: `--json -` with `-o md|csv|json` is refused.
Tables keep raw values: CSV and JSON carry the numbers as measured (fractions, seconds,
bytes), Markdown and text format them (percentages, fixed decimals).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

from ds4f.api import Ds4fError

FORMATS = ("text", "md", "csv", "json")
DASH = "—"


def disk_size(n: float) -> str:
    """Bytes of files on disk in decimal units (kB, MB, GB), the units of the progress bars;
    memory (RSS, caches, the expert pool) is given in MiB and GiB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def check_streams(args, inputs: "Inputs | None" = None) -> None:
    """Refuse two things on stdout at once, and a --json file that check_output refuses."""
    if getattr(args, "json", None) == "-" and getattr(args, "output", "text") != "text":
        raise Ds4fError(f"--json - and -o {args.output} would both write to stdout; "
                        f"give --json a file, or leave -o at text")
    if getattr(args, "json", None) not in (None, "-"):
        check_output(args.json, "--json", getattr(args, "force", False),
                     inputs=inputs if inputs is not None else command_inputs(getattr(args, "config", None)))


def human_stream(args) -> TextIO:
    """Where the human-readable lines go: stdout, unless stdout carries tables or JSON."""
    if getattr(args, "json", None) == "-" or getattr(args, "output", "text") != "text":
        return sys.stderr
    return sys.stdout


# -- what a command reads, which no output of it may replace -------------------------------------
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")
_WALK_LIMIT = 200_000      # entries of an input directory looked at for a hard link to the output


def _identity(path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)            # through symlinks: the file that would be written
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _real(path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


class Inputs:
    """The files and directories a command reads, each with what it is ("the checkpoint
    directory", "the config file in use", ...): an output may not be one of them, a hard link or
    symlink to one, a file inside one of the directories, nor (a directory output) hold one."""

    def __init__(self, items=()) -> None:
        self.items: list[tuple[str, Path]] = []
        self.add(*items)

    def add(self, *items) -> "Inputs":
        for item in items:
            what, path = item if isinstance(item, tuple) else ("this command's input", item)
            if path is not None and str(path) != "":
                path = Path(os.path.expanduser(os.fspath(path)))
                if (what, path) not in self.items:
                    self.items.append((what, path))
        return self

    def clash(self, out: Path) -> str | None:
        """How writing the file `out` would replace an input (a phrase), or None."""
        real, ident = _real(out), _identity(out)
        parent_ident = _identity(real.parent)
        for what, path in self.items:
            rp = _real(path)
            if rp in real.parents:           # (a directory, or one still to be made)
                return f"{'a file' if ident is not None else 'a path'} inside {what} {path}"
            if path.is_dir():
                if real == rp:
                    return f"{what} {path}"
                if ident is None and parent_ident is None:
                    continue
                for kind, hit in self._walk(path):
                    if kind == "file" and ident is not None and hit[0] == ident:
                        return f"{hit[1]}, a file of {what} {path}"
                    if kind == "dir" and parent_ident is not None and hit[0] == parent_ident:
                        return f"inside {what} {path} (as {hit[1]})"
            elif real == rp or (ident is not None and ident == _identity(path)):
                return f"{what} {path}"
        return None

    def held_by(self, out: Path) -> str | None:
        """An input that the directory `out`, replaced whole, would take with it (a phrase), or None."""
        real = _real(out)
        for what, path in self.items:
            rp = _real(path)
            if rp == real or real in rp.parents:
                return f"{what} {path}"
        return None

    @staticmethod
    def _walk(root: Path):
        """(("file" | "dir"), ((st_dev, st_ino), path)) for root and what is under it, symlinks
        followed to what they name (a shard linked from elsewhere is still the checkpoint's)."""
        seen = 0
        yield "dir", (_identity(root), root)
        for top, dirs, files in os.walk(root, followlinks=False):
            for name in dirs:
                yield "dir", (_identity(os.path.join(top, name)), Path(top, name))
            for name in files:
                seen += 1
                if seen > _WALK_LIMIT:
                    return
                yield "file", (_identity(os.path.join(top, name)), Path(top, name))


def command_inputs(config_path: str | None = None, model=None, *, extra=(), kv_dir=None,
                   known_checkpoints: bool = True) -> Inputs:
    """What every command may read and no output may replace, even with --force: `model`'s
    checkpoint directory (every file in it, through symlinks, and any file its layout names
    elsewhere) and the one ds4f.toml names, the config file in use and the built-in one, the run
    history (with SQLite's files beside it), ds4f's cache directory (the demo and bench
    checkpoints, the disk floors, the fingerprints, the prefix cache by default), the prefix
    cache's directory, and the command's own `extra` inputs. known_checkpoints=False (the commands
    that make checkpoints): not ds4f.toml's model nor the whole cache directory, only its files."""
    from importlib import resources

    from ds4f.api import load_settings, user_cache_dir

    inputs = Inputs()
    inputs.add(("the built-in config", Path(str(resources.files("ds4f").joinpath("ds4f.toml")))))
    try:
        settings = load_settings(config_path)
    except Ds4fError:
        settings = None       # the command itself says what is wrong with it
    cfg = settings.engine if settings is not None else None
    for m in (model, cfg.model_path if cfg is not None and known_checkpoints else None):
        if m:
            _add_checkpoint(inputs, m)
    if settings is not None:
        if settings.source != "built-in ds4f.toml":
            inputs.add(("the config file in use", settings.source))
        inputs.add(("the run history", settings.history_path),
                   *(("the run history's journal", settings.history_path + s) for s in SQLITE_SIDECARS))
        if cfg.kv is not None:
            inputs.add(("the prefix cache's directory", cfg.kv.dir))
    inputs.add(("the prefix cache's directory", kv_dir))
    if known_checkpoints:
        inputs.add(("ds4f's cache directory (demo and bench checkpoints, disk floors, kept states)", user_cache_dir()))
    else:
        inputs.add(*((f"ds4f's {name}", user_cache_dir() / name) for name in ("floor.json", "fingerprints.json")))
    inputs.add(*extra)
    return inputs


def _add_checkpoint(inputs: Inputs, model) -> None:
    p = Path(os.path.expanduser(os.fspath(model)))
    root = p.parent if p.is_file() else p
    inputs.add(("the checkpoint directory", root))
    if not root.is_dir():
        return
    from ds4f.api import open_checkpoint

    try:                          # files the layout names outside its directory are read too
        with open_checkpoint(root) as ck:
            named = [getattr(ck, "pool_path", None), getattr(ck, "trunk_path", None),
                     *(getattr(ck, "files", None) or ())]
    except (Ds4fError, OSError, TypeError, AttributeError):
        return
    for f in named:
        if isinstance(f, (str, os.PathLike)):
            inputs.add(("the checkpoint's file", f))


def check_output(path: str | Path, option: str, force: bool = False, inputs=(), suffixes=(),
                 makes_dirs: bool = False) -> Path:
    """The file a command is about to write, refused before any work when writing it would lose
    something or land elsewhere: a directory, a device, FIFO or socket (never replaced, even with
    --force), one of the command's `inputs` (an Inputs, or paths: a file, a hard link or symlink to
    one, or a path inside an input directory; never, even with --force), an existing file without
    `force`, (with `suffixes`) a name a library would extend with a suffix of its own, or a place
    no file can be made: no directory there (makes_dirs: the writer creates the missing ones), a
    read-only filesystem, a directory this user may not write. Every writing command calls it."""
    p = Path(path).expanduser()
    param = option.lstrip("-") if option.startswith("-") else None
    if "\x00" in str(p):
        raise Ds4fError(f"{option}: a path with a NUL byte names no file", param=param)
    if suffixes and p.suffix.lower() not in suffixes:
        raise Ds4fError(f"{option}: {p} must end in {' or '.join(suffixes)} (the file is written under exactly"
                        f" this name)", param=param)
    if p.is_dir():
        raise Ds4fError(f"{option}: {p} is a directory; give a file path", param=param)
    if p.exists() and not p.is_file():
        raise Ds4fError(f"{option}: {p} is not a regular file (a device, FIFO or socket); it is never replaced",
                        param=param)
    problem = _unwritable(p, makes_dirs)
    if problem is not None:
        raise Ds4fError(f"{option}: cannot write {p}: {problem}; nothing was done", param=param, path=str(p))
    clash = (inputs if isinstance(inputs, Inputs) else Inputs(inputs)).clash(p)
    if clash is not None:
        raise Ds4fError(f"{option}: {p} is {clash}, which this command reads: never replaced or written into,"
                        f" even with --force; give another path", param=param, path=str(p))
    if (p.exists() or p.is_symlink()) and not force:
        raise Ds4fError(f"{option}: {p} already exists; pass --force to overwrite it", path=str(p))
    return p


def _unwritable(p: Path, makes_dirs: bool) -> str | None:
    """Why no file could be made at `p` (its directory, or with makes_dirs the nearest existing
    one, is missing, not a directory, on a read-only filesystem or not writable by this user), or
    None: said before any work."""
    d = Path(os.path.abspath(p)).parent
    if not makes_dirs and not (d.exists() or d.is_symlink()):
        return f"no directory {d}"
    while not (d.exists() or d.is_symlink()) and d != d.parent:
        d = d.parent                    # the writer creates the directories missing below it
    if not d.is_dir():
        return f"{d} is not a directory"
    try:
        if os.statvfs(d).f_flag & getattr(os, "ST_RDONLY", 1):
            return f"{d} is on a read-only filesystem"
    except OSError:
        pass
    if not os.access(d, os.W_OK | os.X_OK):
        return f"{d} is not writable (permission denied)"
    return None


def check_output_dir(path: str | Path, option: str, inputs: Inputs) -> Path:
    """A directory a command creates or (with --force) replaces whole: refused when it is, is
    inside, or holds one of the command's inputs."""
    p = Path(path).expanduser()
    clash = inputs.clash(p)
    if clash is None and (p.exists() or p.is_symlink()):
        held = inputs.held_by(p)
        clash = f"a directory holding {held}" if held else None
    if clash is not None:
        raise Ds4fError(f"{option}: {p} is {clash}, which ds4f reads: never replaced or written into, even with"
                        f" --force; give another path", param=option.lstrip("-") or None, path=str(p))
    return p


def write_json(data: Any, dest: str, option: str = "--json") -> None:
    """`data` as indented JSON to the file `dest`, or to stdout for '-'."""
    text = json.dumps(_finite(data), indent=1, default=_json_default, allow_nan=False) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    dest_p = Path(dest).expanduser()
    tmp = dest_p.with_name(f".{dest_p.name}.partial-{os.getpid()}")
    try:   # whole or not at all: a failed write leaves no file that looks complete
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, dest_p)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise Ds4fError(f"{option}: cannot write {dest}: {exc.strerror or exc}", path=str(dest)) from None


def _finite(obj):
    """NaN and infinities as null: JSON has no numbers for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


@dataclass(frozen=True)
class Label:
    """A row label: `key` in CSV and JSON, `text` in Markdown and text."""

    key: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Cell:
    """A value with its own format spec (a table whose rows are metrics of different kinds)."""

    value: Any
    spec: str = ""


@dataclass(frozen=True)
class Column:
    key: str                 # the CSV header and JSON key
    label: str = ""          # the Markdown and text header (default: the key)
    spec: str = ""           # format spec for the human formats ("" = str())
    align: str = "right"     # "left" | "right"

    def header(self) -> str:
        return self.label or self.key

    def human(self, value) -> str:
        spec = self.spec
        if isinstance(value, Cell):
            value, spec = value.value, value.spec or spec
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return DASH
        if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
            return format(value, spec)
        return str(value)

    def raw(self, value):
        if isinstance(value, Cell):
            value = value.value
        if isinstance(value, Label):
            return value.key
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value


@dataclass
class Table:
    name: str                                   # key of the table when a command has several
    columns: Sequence[Column]
    rows: list[list] = field(default_factory=list)
    title: str = ""

    def add(self, *values) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"table {self.name}: {len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))

    # -- renderers --------------------------------------------------------------------------
    def text(self) -> str:
        cells = [[c.header() for c in self.columns]] + [[c.human(v) for c, v in zip(self.columns, r)]
                                                         for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = []
        for row in cells:
            parts = [v.ljust(w) if c.align == "left" else v.rjust(w) for c, v, w in zip(self.columns, row, widths)]
            lines.append("  ".join(parts).rstrip())
        return "\n".join(lines)

    def markdown(self) -> str:
        def esc(s: str) -> str:
            return s.replace("|", "\\|")

        lines = ["| " + " | ".join(esc(c.header()) for c in self.columns) + " |",
                 "|" + "|".join(":---" if c.align == "left" else "---:" for c in self.columns) + "|"]
        for r in self.rows:
            lines.append("| " + " | ".join(esc(c.human(v)) for c, v in zip(self.columns, r)) + " |")
        return "\n".join(lines)

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([c.key for c in self.columns])
        for r in self.rows:
            w.writerow(["" if (x := c.raw(v)) is None else x for c, v in zip(self.columns, r)])
        return buf.getvalue().rstrip("\n")

    def records(self) -> list[dict]:
        return [{c.key: c.raw(v) for c, v in zip(self.columns, r)} for r in self.rows]


def render(tables: Sequence[Table], fmt: str) -> str:
    """The tables in `fmt` (md, csv or json). One table: just that table (JSON: a list of row
    objects). Several: Markdown and CSV put each under a `# title` line with a blank line between
    (CSV readers skip them with comment='#'); JSON is an object of row lists keyed by table name."""
    if fmt == "json":
        if len(tables) == 1:
            return json.dumps(tables[0].records(), indent=1, default=_json_default)
        return json.dumps({t.name: t.records() for t in tables}, indent=1, default=_json_default)
    if fmt not in ("md", "csv"):
        raise ValueError(fmt)
    parts = []
    for t in tables:
        body = t.markdown() if fmt == "md" else t.csv()
        if len(tables) > 1:
            body = f"# {t.title or t.name}\n{body}"
        parts.append(body)
    return "\n\n".join(parts)


def print_tables(tables: Sequence[Table], fmt: str) -> None:
    print(render(tables, fmt))
