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

import argparse
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


def add_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=FORMATS, default="text",
                        help="format of the tables on stdout: text (default), md, csv or json; "
                             "with md, csv and json stdout holds only the tables")


def add_dump_option(parser: argparse.ArgumentParser, kind: str) -> None:
    """--dump full|compact|off: the state dump the run writes (default: ds4f.toml's [dump] `kind`)."""
    parser.add_argument("--dump", choices=("full", "compact", "off"), default=None,
                        help="the state dump to write: full (every float of every layer: for short experiments),"
                             " compact (ids, routing, top logits, per-layer digests and sketches: a few KB a"
                             f" token) or off (default: ds4f.toml's [dump] {kind})")


def add_kv_options(parser) -> None:
    """The prefix cache's options of the text commands and the server."""
    parser.add_argument("--kv-dir", metavar="DIR", default=None,
                        help="where the prefix cache keeps session states on disk (default: ds4f.toml's [kv] dir)")
    parser.add_argument("--no-kv", action="store_true", help="reuse no kept prefix: compute every prompt whole")


def add_json_option(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    parser.add_argument("--json", metavar="PATH",
                        help=f"write {what} as JSON to PATH ('-': stdout, the other output then goes to stderr)")
    parser.add_argument("--force", action="store_true", help="overwrite the --json file if it exists")


def check_streams(args) -> None:
    """Refuse two things on stdout at once, and a --json file that check_output refuses."""
    if getattr(args, "json", None) == "-" and getattr(args, "output", "text") != "text":
        raise Ds4fError(f"--json - and -o {args.output} would both write to stdout; "
                        f"give --json a file, or leave -o at text")
    if getattr(args, "json", None) not in (None, "-"):
        check_output(args.json, "--json", getattr(args, "force", False))


def human_stream(args) -> TextIO:
    """Where the human-readable lines go: stdout, unless stdout carries tables or JSON."""
    if getattr(args, "json", None) == "-" or getattr(args, "output", "text") != "text":
        return sys.stderr
    return sys.stdout


def check_output(path: str | Path, option: str, force: bool = False, inputs=(), suffixes=()) -> Path:
    """The file a command is about to write, refused before any work when writing it would lose
    something or land elsewhere: a directory, a device, FIFO or socket (never replaced, even with
    --force), one of the command's `inputs`, an existing file without `force`, or (with `suffixes`)
    a name a library would extend with a suffix of its own. Every writing command calls it."""
    p = Path(path).expanduser()
    if suffixes and p.suffix.lower() not in suffixes:
        raise Ds4fError(f"{option}: {p} must end in {' or '.join(suffixes)} (the file is written under exactly"
                        f" this name)", param=option.lstrip("-"))
    if p.is_dir():
        raise Ds4fError(f"{option}: {p} is a directory; give a file path", param=option.lstrip("-"))
    if p.exists() and not p.is_file():
        raise Ds4fError(f"{option}: {p} is not a regular file (a device, FIFO or socket); it is never replaced",
                        param=option.lstrip("-"))
    for source in inputs:
        if source is not None and Path(source).exists() and p.exists() and os.path.samefile(p, source):
            raise Ds4fError(f"{option}: {p} is this command's input {source}; give another path",
                            param=option.lstrip("-"))
    if (p.exists() or p.is_symlink()) and not force:
        raise Ds4fError(f"{option}: {p} already exists; pass --force to overwrite it", path=str(p))
    return p


def write_json(data: Any, dest: str, option: str = "--json") -> None:
    """`data` as indented JSON to the file `dest`, or to stdout for '-'."""
    text = json.dumps(_finite(data), indent=1, default=_json_default, allow_nan=False) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(dest, "w") as f:
            f.write(text)
    except OSError as exc:
        raise Ds4fError(f"{option}: cannot write {dest}: {exc.strerror}") from None


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
