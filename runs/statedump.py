"""state.bin: the reference artifact of a run (ds4f.runs.diff compares two of them).

Layout (little-endian):
    b"DS4FSTAT"  u32 version  u32 header_len  header_json (utf-8, space-padded to 8 bytes)
    then one record per decoded token. Two kinds of dump (the version says which):

    full (version 3): every float of each layer's state, for short experiments:
        i32 token_id, i32 next_token_id, u8 backend code, 3 pad bytes,
        i32 expert_ids[n_layers, top_k], f32 weights[n_layers, top_k], f32 hidden[n_layers, width],
        f32 attn[n_layers, hidden_size] (the whole model only), i32 top_ids[8], f32 top_logits[8]
    compact (version 4): a size to keep for every served or chatted token (under 4 KB a token on
    DeepSeek-V4-Flash, against 3.5 MB for a full record):
        i32 token_id, i32 next_token_id, u8 backend code, 3 pad bytes,
        i16 expert_ids[n_layers, top_k] (i32 past 32,767 experts), f32 weights[n_layers, top_k],
        u64 digest[n_layers]                 a hash of the layer's exact bits (hidden, then attn)
        f32 hidden_sketch[n_layers, 6]       max |h|, rms(h), and h on 4 fixed +-1/sqrt(width) directions
        f32 attn_sketch[n_layers, 3]         the same for the attention output, 1 direction (whole model)
        i32 top_ids[8], f32 top_logits[8]
      The digest says "same bits or not" per token and layer; the sketches measure how far apart
      two states are (ds4f.runs.diff: low-bit or drift), as the full floats do. A full record
      gives its compact one exactly (compact_records), so any two dumps can be compared.
    width = hc_mult x hidden_size: each layer's output state, the hyper-connection streams one
    after the other (hidden_size alone for a MoE-only geometry, which has one residual stream).
    attn: each layer's attention sublayer output; top_ids / top_logits: the step's 8 largest
    logits, largest first (equal values: lower id first).
Older dumps (version 1: the MoE half only; 2: no attention outputs or top logits) are refused
with a message.
The header holds only what determines the numbers (format, geometry, prompt, token count),
never thread counts, paths or times, so equal math gives equal bytes (the determinism
invariant).

A run's artifacts are a pair, state.bin and report.json, the report carrying the state's
sha256 (`state_sha256`) and size (`state_nbytes`). Both are written as `<name>.partial`, then
committed in this order: the report renamed into place, then the state. Whatever point a
process is killed at, the files under the final names are one of: the previous pair (or
nothing), a new report beside an old or missing state (its sha256 does not match: not a
finished run), or the new pair. A new state never stands beside an old report. Readers
(read_state, diff, the server) treat a pair whose sha256 does not match as not done
(`pair_problem`). While writing, the writer holds an exclusive lock on `state.bin.partial`;
the next writer in the same place removes what a killed one left (`*.partial`, a half-committed
pair) unless that lock shows its writer is still alive.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.safe_read import open_regular
from ds4f.native.kernels import BACKENDS
from ds4f.engine.model.records import ATTN_SKETCH, HIDDEN_SKETCH, TOP_LOGITS, compact_of, top_logits
from ds4f.engine.model.records import sketch  # noqa: F401  (named here too: a compact record's sketch)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, leftovers are still removed
    fcntl = None

MAGIC = b"DS4FSTAT"
VERSION = 3               # full records
COMPACT_VERSION = 4       # compact records
VERSIONS = {VERSION: "full", COMPACT_VERSION: "compact"}
DUMP_MODES = ("full", "compact", "off")    # what a run writes: full or compact records, or no dump
BACKEND_CODES = {name: code for code, name in enumerate(BACKENDS)}   # a record's backend: the C enum's number
BACKEND_BY_CODE = dict(enumerate(BACKENDS))



def record_dtype(n_layers: int, top_k: int, width: int, attn_width: int = 0) -> np.dtype:
    """One step's full record: width = floats of a layer's output state; attn_width = floats of a
    layer's attention output (0: a MoE-only model, no attention field)."""
    fields = [("token", "<i4"), ("next", "<i4"), ("backend", "u1"), ("pad", "u1", (3,)),
              ("ids", "<i4", (n_layers, top_k)), ("weights", "<f4", (n_layers, top_k)),
              ("hidden", "<f4", (n_layers, width))]
    if attn_width:
        fields.append(("attn", "<f4", (n_layers, attn_width)))
    fields += [("top_ids", "<i4", (TOP_LOGITS,)), ("top_logits", "<f4", (TOP_LOGITS,))]
    return np.dtype(fields)


def compact_record_dtype(n_layers: int, top_k: int, n_experts: int, attention: bool = True) -> np.dtype:
    """One step's compact record (see the module docstring); attention: the whole model's (else
    no attention sketch)."""
    fields = [("token", "<i4"), ("next", "<i4"), ("backend", "u1"), ("pad", "u1", (3,)),
              ("ids", "<i2" if n_experts <= 32767 else "<i4", (n_layers, top_k)),
              ("weights", "<f4", (n_layers, top_k)), ("digest", "<u8", (n_layers,)),
              ("hidden_sketch", "<f4", (n_layers, HIDDEN_SKETCH))]
    if attention:
        fields.append(("attn_sketch", "<f4", (n_layers, ATTN_SKETCH)))
    fields += [("top_ids", "<i4", (TOP_LOGITS,)), ("top_logits", "<f4", (TOP_LOGITS,))]
    return np.dtype(fields)


def fill_compact(rec, hidden: np.ndarray, attn: np.ndarray | None) -> None:
    """A compact record's digest and sketches from a step's layer states (fp32 [n_layers, width])
    and attention outputs (fp32 [n_layers, hidden_size]; None: a MoE-only model)."""
    with_attn = "attn_sketch" in rec.dtype.names
    digest, hidden_sketch, attn_sketch = compact_of(hidden, attn if with_attn else None)
    rec["digest"], rec["hidden_sketch"] = digest, hidden_sketch
    if with_attn:
        rec["attn_sketch"] = attn_sketch


def compact_records(records: np.ndarray, g: dict) -> np.ndarray:
    """Records of either kind as compact ones (a full record's compact one is exactly what a
    compact dump of the same step holds)."""
    dtype = geometry_record_dtype(g, "compact")
    if records.dtype == dtype:
        return records
    out = np.zeros(len(records), dtype)
    for name in ("token", "next", "backend", "weights", "top_ids", "top_logits"):
        out[name] = records[name]
    out["ids"] = records["ids"]
    with_attn = "attn" in records.dtype.names
    for i, r in enumerate(records):
        fill_compact(out[i], r["hidden"], r["attn"] if with_attn else None)
    return out


PARTIAL = ".partial"
HASH_CHUNK = 1 << 20


def partial_path(path: str | os.PathLike) -> Path:
    """Where `path` is written before it is committed: `<path>.partial`."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL)


def write_error(path: str | os.PathLike, exc: OSError, what: str = "write") -> Ds4fError:
    """An OSError of writing `path` as a Ds4fError that names the path and the cause."""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        why = "no space left on device" if exc.errno == errno.ENOSPC else "no space left (disk quota exceeded)"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied"
    elif exc.errno == errno.EROFS:
        why = "read-only file system"
    else:
        why = exc.strerror or str(exc)
    where = exc.filename if isinstance(exc.filename, str) else str(path)
    return Ds4fError(f"{where}: cannot {what}: {why}", path=str(path))


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


RUN_STATE, RUN_REPORT = "state.bin", "report.json"   # the pair in a run's own directory


def report_path_for(state_path: str | os.PathLike, own_dir: bool = False) -> Path:
    """Where a run puts the report of its state dump at `state_path`: report.json when the dump is
    the state.bin of the run's own directory (own_dir), else beside it named after it
    (`a.bin` -> `a.report.json`)."""
    p = Path(state_path)
    return p.with_name(RUN_REPORT) if own_dir else p.with_name(p.stem + ".report.json")


def report_paths_for(state_path: str | os.PathLike) -> list[Path]:
    """Where a run's report may sit next to its state dump (report_path_for, either way): `a.bin`
    -> `a.report.json`, and `state.bin` -> `report.json` in the same directory too."""
    p = Path(state_path)
    out = [report_path_for(p)]
    if p.name == RUN_STATE:
        out.append(report_path_for(p, own_dir=True))
    return out


def _load_report(path: Path) -> dict | None:
    """The report at `path` if it is a ds4f report naming a state sha256, else None."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("ds4f.report/"):
        return None
    if not isinstance(doc.get("state_sha256"), str) or not isinstance(doc.get("state_path"), str):
        return None
    return doc


def _claims(report: dict, state_path: Path) -> bool:
    """Does `report` name `state_path` as its state? By file name: the reports looked at sit next
    to the dump (report_paths_for) or are given by the caller, and a run's directory may move."""
    return Path(report["state_path"]).name == state_path.name


def pair_problem(state_path: str | os.PathLike, sha256: str | None = None,
                 report_path: str | os.PathLike | None = None) -> str | None:
    """Why the state dump at `state_path` is not a finished run's (None when it is, or when no
    report claims it). A report claims it when `report_path` is given, or one of report_paths_for
    names it; it is finished when the file's sha256 equals the report's `state_sha256`.
    `sha256`, if given, is the file's hash already computed."""
    state_path = Path(state_path)
    candidates = [Path(report_path)] if report_path is not None else report_paths_for(state_path)
    for rp in candidates:
        doc = _load_report(rp)
        if doc is None or not _claims(doc, state_path):
            continue
        want = doc["state_sha256"]
        if not state_path.is_file():
            return f"{state_path}: missing, but its report {rp} says the run is done (an interrupted commit)"
        nbytes = doc.get("state_nbytes")
        if sha256 is None and isinstance(nbytes, int) and state_path.stat().st_size != nbytes:
            return (f"{state_path}: {state_path.stat().st_size} bytes, but its report {rp} says {nbytes}:"
                    f" not a finished run's pair (an interrupted commit, or one of the two was replaced)")
        got = sha256 or file_sha256(state_path)
        if got != want:
            return (f"{state_path}: sha256 {got[:16]}…, but its report {rp} says {want[:16]}…:"
                    f" not a finished run's pair (an interrupted commit, or one of the two was replaced)")
    return None


class StateWriter:
    """Streams records to `path`.partial, hashing as it goes.

    finish() closes it and renames it into place (a dump on its own). A run's pair goes:
    close() (flushed and fsynced, still `.partial`; returns the sha256), the report written
    to `report_path`.partial, then commit() (the report renamed into place, then the state).
    abort() removes both partial files. Every write error is a Ds4fError naming the file.

    With `report_path`, the writer first cleans the place: what a killed writer left there
    (`*.partial` of both, a report that claims the state dump but whose sha256 does not match
    it, with that dump) is removed; `notes` says what went. A place whose `.partial` is locked
    by a live writer is refused."""

    def __init__(self, path: str | os.PathLike, geometry: dict, prompt: list[int], n_tokens: int,
                 report_path: str | os.PathLike | None = None, sampling: dict | None = None,
                 mode: str = "full", response_format: dict | None = None) -> None:
        if mode not in ("full", "compact"):
            raise Ds4fError(f"dump: a state dump is full or compact, not {mode!r}", param="dump")
        self.mode = mode
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        self.report_path = Path(report_path) if report_path is not None else None
        self.report_tmp = partial_path(self.report_path) if self.report_path is not None else None
        self.notes: list[str] = []
        self.sha256: str | None = None
        self.nbytes = 0
        self._f = None
        for d in {self.path.parent, *([self.report_path.parent] if self.report_path is not None else [])}:
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise write_error(d, exc, "create the directory") from None
        g = geometry
        self.dtype = geometry_record_dtype(g, mode)
        version = VERSION if mode == "full" else COMPACT_VERSION
        # the settings that determine the numbers; `sampling` only when tokens are drawn (greedy: absent),
        # `response_format` only when the picks were held to one (engine.text.constraint)
        self._header = {"format": "ds4f.state", "version": version, "geometry": geometry,
                        "prompt": list(prompt), "n_tokens": n_tokens}
        if sampling is not None:
            self._header["sampling"] = sampling
        if response_format is not None:
            self._header["response_format"] = response_format
        self.n_tokens = n_tokens
        header = json.dumps(self._header, sort_keys=True).encode()
        header += b" " * (-(len(header) + 16) % 8)
        self._header_len = len(header)
        self._rec = np.zeros(1, self.dtype)
        self._no_attn = np.zeros((g["num_hidden_layers"], g["hidden_size"]), np.float32)   # a full record's zeros
        self._sha = hashlib.sha256()
        self._open_locked()
        try:
            if self.report_path is not None:
                self.notes = clean_leftovers(self.path, self.report_path)
            self._write(MAGIC + struct.pack("<II", version, len(header)) + header)
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc, "clean up") from None
        except BaseException:
            self.abort()
            raise
        self.n_written = 0

    def _open_locked(self) -> None:
        """Open `.partial` without truncating, take its lock (or refuse: a live writer has it), then truncate."""
        try:
            fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise write_error(self.tmp, exc) from None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise Ds4fError(f"{self.path}: another run is writing here right now ({self.tmp} is locked)",
                                path=str(self.path), kind="busy") from None
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:
            os.close(fd)
            raise write_error(self.tmp, exc) from None
        self._f = os.fdopen(fd, "wb")

    def _write(self, data: bytes) -> None:
        try:
            self._f.write(data)
        except OSError as exc:
            raise write_error(self.tmp, exc) from None
        self._sha.update(data)
        self.nbytes += len(data)

    def write(self, token: int, next_token: int, backend: str, ids, weights, hidden, attn=None,
              logits=None, compact=None, top=None) -> None:
        """One step: attn (each layer's attention output; whole-model dumps) and logits (the step's
        fp32 [vocab], of which the record keeps the top TOP_LOGITS, or those alone: `top`, (ids,
        values) as model.records.top_logits gives them) are zeros when not given.
        compact: the step's compact records made as it ran (model.records: digest, hidden_sketch,
        attn_sketch), where the session kept no full ones (hidden None); a compact dump takes them
        as they are, a full one cannot be written from them."""
        rec = self._rec[0]
        rec["token"], rec["next"], rec["backend"] = token, next_token, BACKEND_CODES[backend]
        rec["ids"], rec["weights"] = ids, weights
        with_attn = "attn_sketch" in self.dtype.names
        if hidden is None and (self.mode == "full" or compact is None):
            raise Ds4fError(f"a {self.mode} state dump needs the step's layer records, which the session did"
                            f" not keep", kind="internal")
        if self.mode == "full":
            rec["hidden"] = hidden
            if "attn" in self.dtype.names:
                rec["attn"] = attn if attn is not None else 0.0
        elif hidden is None:
            rec["digest"], rec["hidden_sketch"] = compact[0], compact[1]
            if with_attn:
                rec["attn_sketch"] = compact[2]
        else:
            fill_compact(rec, hidden, (attn if attn is not None else self._no_attn) if with_attn else None)
        if logits is not None:
            rec["top_ids"], rec["top_logits"] = top_logits(logits)
        elif top is not None:
            rec["top_ids"], rec["top_logits"] = top
        else:
            rec["top_ids"], rec["top_logits"] = -1, 0.0
        self._write(self._rec.tobytes())
        self.n_written += 1

    def write_records(self, records: np.ndarray) -> None:
        """Steps computed before, as whole records of this dump's dtype (a reused prefix's)."""
        records = np.ascontiguousarray(records)
        if records.dtype != self.dtype:
            raise Ds4fError("the reused records are not of this state dump's record layout", param="state")
        self._write(records.tobytes())
        self.n_written += len(records)

    def close(self) -> str:
        """Flush and fsync `.partial`; the sha256 of the file. The file stays open, and locked,
        until commit() or abort(): a sweeper never takes a finished but uncommitted dump for a leftover.
        A run that ended before its planned tokens (an end-of-sentence token, a stop string) gets
        its header's n_tokens rewritten in place to the records written (same header length)."""
        if self.sha256 is None:
            try:
                if self.n_written != self.n_tokens:
                    self._rewrite_count()
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                raise write_error(self.tmp, exc) from None
            self.sha256 = self._sha.hexdigest()
        return self.sha256

    def _rewrite_count(self) -> None:
        header = json.dumps({**self._header, "n_tokens": self.n_written}, sort_keys=True).encode()
        header += b" " * (self._header_len - len(header))    # fewer digits: the same length, spaces after
        self._f.flush()
        self._f.seek(16)
        self._f.write(header)
        self._f.seek(0, os.SEEK_END)
        self._f.flush()
        self.n_tokens = self.n_written
        sha = hashlib.sha256()      # the hash of the file as it now is
        with open(self.tmp, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        self._sha = sha

    def _release(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def commit(self) -> None:
        """Rename the written report (if any) into place, then the state dump."""
        if self.report_path is not None:
            try:
                os.replace(self.report_tmp, self.report_path)
            except OSError as exc:
                raise write_error(self.report_path, exc, "commit") from None
        try:
            os.replace(self.tmp, self.path)
        except OSError as exc:
            if self.report_path is not None:  # a report whose state never landed is not left behind
                self.report_path.unlink(missing_ok=True)
            raise write_error(self.path, exc, "commit") from None
        self._release()
        for d in {self.path.parent, *([self.report_path.parent] if self.report_path is not None else [])}:
            _fsync_dir(d)

    def finish(self) -> str:
        """Close, rename into place, and return the sha256 of the file (a dump without a report)."""
        sha = self.close()
        self.commit()
        return sha

    def abort(self) -> None:
        """Remove what this writer wrote under temporary names (never committed files), then let go of the lock."""
        for p in (self.tmp, self.report_tmp):
            if p is not None:
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
        self._release()


class NoDump:
    """The writer of a run that writes no state dump (dump off): the same calls, nothing written,
    no report file (the run's report stays in memory and in the history)."""

    mode = "off"
    path = tmp = report_path = report_tmp = dtype = sha256 = None
    nbytes = n_written = 0

    def __init__(self) -> None:
        self.notes: list[str] = []

    def write(self, *args, **kwargs) -> None:
        pass

    def write_records(self, records: np.ndarray) -> None:
        pass

    def close(self) -> None:
        return None

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


def clean_leftovers(state_path: str | os.PathLike, report_path: str | os.PathLike) -> list[str]:
    """Remove what a killed writer left in this place: the report's `.partial`, and a report
    claiming `state_path` whose sha256 does not match it (with that state dump). The caller
    holds the lock on the state's `.partial` (and has emptied it). What was removed, as notes."""
    state_path, report_path = Path(state_path), Path(report_path)
    notes = []
    rtmp = partial_path(report_path)
    if rtmp.exists():
        rtmp.unlink(missing_ok=True)
        notes.append(f"removed {rtmp}, left by an interrupted run")
    if report_path.is_file():
        problem = pair_problem(state_path, report_path=report_path)
        if problem is not None:
            report_path.unlink(missing_ok=True)
            gone = [str(report_path)]
            if state_path.is_file():
                state_path.unlink(missing_ok=True)
                gone.append(str(state_path))
            notes.append(f"removed {' and '.join(gone)}, a pair an interrupted run left half-committed")
    return notes


def sweep_run_dirs(runs_dir: str | os.PathLike, keep: str | os.PathLike | None = None,
                   min_age_s: float = 60.0, candidates: list | None = None) -> list[str]:
    """Remove what killed runs left in the per-run directories under `runs_dir` (a run's default
    place, one directory per run, never reused): the `.partial` files, a report.json whose
    state.bin never landed, and then the directory if nothing else is in it. A directory whose
    state.bin.partial a live writer holds locked, or was touched in the last min_age_s, is left
    alone, as is `keep`. `candidates`: the directories to look at (those the runs budget's last
    scan found holding a `.partial` no live run writes: budget.RunsBudget.leftover_dirs), not
    every run's directory; None: every one. What was removed, as notes."""
    notes = []
    if candidates is not None:
        dirs = [Path(d) for d in candidates]
    else:
        try:
            dirs = [d for d in Path(runs_dir).iterdir() if d.is_dir()]
        except OSError:
            return notes
    for d in dirs:
        if keep is not None and d == Path(keep):
            continue
        tmp = d / ("state.bin" + PARTIAL)
        try:
            if time.time() - tmp.stat().st_mtime < min_age_s:
                continue
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue
            gone = [p for p in d.iterdir() if p.name.endswith(PARTIAL)]
            if (d / "report.json").is_file() and not (d / "state.bin").exists():
                gone.append(d / "report.json")
            for p in gone:
                try:
                    p.unlink()
                except OSError:
                    pass
        finally:
            os.close(fd)
        try:
            d.rmdir()
            notes.append(f"removed {d}, what a killed run left")
        except OSError:
            notes.append(f"removed {', '.join(p.name for p in gone)} from {d}, left by a killed run")
    return notes


@dataclass
class State:
    path: Path
    header: dict
    records: np.ndarray      # structured, one per token (full or compact: `mode`)
    sha256: str

    @property
    def mode(self) -> str:
        """full | compact: the kind of records the dump holds."""
        return "compact" if "digest" in self.records.dtype.names else "full"

    def compact(self) -> np.ndarray:
        """Its records as compact ones (a compact dump's own)."""
        return compact_records(self.records, self.header["geometry"])

    @property
    def tokens(self) -> np.ndarray:
        return self.records["token"]

    @property
    def backends(self) -> list[str]:
        return [BACKEND_BY_CODE.get(int(b), "?") for b in self.records["backend"]]


def _header_length(path: Path, head: bytes) -> int:
    """The header's length, from a dump's first 16 bytes (magic, version, length)."""
    if len(head) < 16 or head[:8] != MAGIC:
        raise Ds4fError(f"{path}: not a ds4f state dump (bad magic)")
    version, hlen = struct.unpack("<II", head[8:16])
    if version not in VERSIONS:
        older = (" (written by an older ds4f that computed only the MoE half of the model: run it again to"
                 " compare)") if version < 2 else (" (written by an older ds4f, without the attention outputs"
                 " and top logits: run it again to compare)") if version < VERSION else ""
        raise Ds4fError(f"{path}: state dump version {version}; this ds4f reads versions {VERSION} (full) and"
                        f" {COMPACT_VERSION} (compact){older}")
    return hlen


def state_width(g: dict) -> int:
    """Floats of one layer's output state for a geometry (its config.json dict)."""
    return g.get("hc_mult", 1) * g["hidden_size"]


def geometry_record_dtype(g: dict, mode: str = "full") -> np.dtype:
    """The records of a dump of `mode` (full | compact) for a geometry (its config.json dict)."""
    if mode == "compact":
        return compact_record_dtype(g["num_hidden_layers"], g["num_experts_per_tok"], g["n_routed_experts"],
                                    "hc_mult" in g)
    attn = g["hidden_size"] if "hc_mult" in g else 0
    return record_dtype(g["num_hidden_layers"], g["num_experts_per_tok"], state_width(g), attn)


def record_nbytes(g: dict, mode: str) -> int:
    """Bytes a dump of `mode` (full | compact | off) writes per token for a geometry."""
    return 0 if mode == "off" else geometry_record_dtype(g, mode).itemsize


def _parse_header(path: Path, head: bytes, raw: bytes) -> tuple[dict, np.dtype]:
    """The JSON header and the record dtype it and the version (in `head`, the first 16 bytes) imply."""
    version = struct.unpack("<I", head[8:12])[0]
    try:
        header = json.loads(raw)
        return header, geometry_record_dtype(header["geometry"], VERSIONS[version])
    except (ValueError, KeyError, TypeError) as exc:
        raise Ds4fError(f"{path}: corrupt state dump header ({exc})") from None
    except RecursionError:
        raise Ds4fError(f"{path}: corrupt state dump header (JSON nested too deeply to read)") from None


MAX_HEADER_BYTES = 64 << 20   # a dump's JSON header: its geometry, prompt and settings (KBs; a long prompt MBs)


def _read_header(f, path: Path, size: int) -> tuple[bytes, bytes, dict, np.dtype]:
    """(first 16 bytes, header bytes, header, record dtype) of an open dump of `size` bytes, the
    header's length checked against MAX_HEADER_BYTES and the file before it is read."""
    head = f.read(16)
    hlen = _header_length(path, head)
    if hlen > MAX_HEADER_BYTES or 16 + hlen > size:
        raise Ds4fError(f"{path}: truncated or damaged state dump: its header says {hlen} bytes, the file has"
                        f" {max(size - 16, 0)}" + (f" (at most {MAX_HEADER_BYTES} are read)" if hlen > MAX_HEADER_BYTES
                                                  else ""))
    raw = f.read(hlen)
    header, dtype = _parse_header(path, head, raw)
    return head, raw, header, dtype


def _n_tokens(path: Path, header: dict, dtype: np.dtype, room: int) -> int:
    """The header's n_tokens, checked to be a count whose records fit in the `room` bytes the file
    has after its header."""
    n = header.get("n_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise Ds4fError(f"{path}: corrupt state dump header (n_tokens {n!r})")
    if n * dtype.itemsize > room:
        raise Ds4fError(f"{path}: truncated state dump: its header says {n} records of {dtype.itemsize} bytes,"
                        f" the file holds {room} bytes of them")
    return n


def _open_dump(path: Path):
    """open_regular for a dump, a missing one worded as a dump reader says it."""
    return open_regular(path, "state dump", missing=f"{path}: state dump not found")


def read_state(path: str | os.PathLike, check_report: bool = True) -> State:
    """The dump at `path`. check_report: refuse a dump whose run's report (next to it, see
    pair_problem) names another sha256: a run interrupted while committing, not a finished one."""
    path = Path(path)
    try:   # the header first, and the size it implies against the file's, before reading the records
        with _open_dump(path) as (f, st):
            head, raw, header, dtype = _read_header(f, path, st.st_size)
            hlen = len(raw)
            n = _n_tokens(path, header, dtype, st.st_size - 16 - hlen)
            if st.st_size - 16 - hlen != n * dtype.itemsize:
                raise Ds4fError(f"{path}: truncated or padded state dump: {st.st_size - 16 - hlen} bytes of records,"
                                f" expected {n} x {dtype.itemsize}")
            body = f.read(n * dtype.itemsize)
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror}") from None
    if len(body) != n * dtype.itemsize:
        raise Ds4fError(f"{path}: the state dump changed while it was read")
    records = np.frombuffer(body, dtype=dtype)
    h = hashlib.sha256(head)
    h.update(raw)
    h.update(body)
    sha = h.hexdigest()
    if check_report:
        problem = pair_problem(path, sha256=sha)
        if problem is not None:
            raise Ds4fError(problem, path=str(path))
    return State(path, header, records, sha)


def read_records(path: str | os.PathLike, start: int, stop: int) -> np.ndarray:
    """Records [start, stop) of a state dump, read from their place in the file (not the whole
    dump), with the record dtype of its header."""
    path = Path(path)
    try:
        with _open_dump(path) as (f, st):
            _, raw, _, dtype = _read_header(f, path, st.st_size)
            room = st.st_size - 16 - len(raw)
            if not 0 <= start <= stop or stop * dtype.itemsize > room:
                raise Ds4fError(f"{path}: fewer than {stop} records")
            f.seek(16 + len(raw) + start * dtype.itemsize)
            data = f.read((stop - start) * dtype.itemsize)
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) != (stop - start) * dtype.itemsize:
        raise Ds4fError(f"{path}: fewer than {stop} records")
    return np.frombuffer(data, dtype=dtype).copy()


def read_routing(path: str | os.PathLike, chunk_tokens: int = 256) -> np.ndarray:
    """Just the expert ids of a dump (int32 [tokens, n_layers, top_k]), read a chunk of records at a
    time: memory for the ids, not for the hidden states (read_state holds the whole file)."""
    path = Path(path)
    try:
        with _open_dump(path) as (f, st):
            _, raw, header, dtype = _read_header(f, path, st.st_size)
            g = header["geometry"]
            n = _n_tokens(path, header, dtype, st.st_size - 16 - len(raw))   # before the ids are allocated
            ids = np.empty((n, g["num_hidden_layers"], g["num_experts_per_tok"]), np.int32)
            for start in range(0, n, chunk_tokens):
                count = min(chunk_tokens, n - start)
                data = f.read(count * dtype.itemsize)
                if len(data) != count * dtype.itemsize:
                    raise Ds4fError(f"{path}: truncated state dump: record {start + len(data) // dtype.itemsize}"
                                    f" of {n} is missing")
                ids[start:start + count] = np.frombuffer(data, dtype=dtype)["ids"]   # (int16 in a compact dump)
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror}") from None
    return ids
