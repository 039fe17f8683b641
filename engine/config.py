"""ds4f.toml: the file read and merged (read_config), and the engine's settings in it: [model],
[engine], [presets], [kv] (load_config, Config).

Lookup order: an explicit path, ./ds4f.toml, the user's config directory, the built-in
defaults (the ds4f.toml shipped in the package). A user file is merged over the defaults,
so it only needs the keys it changes. Every problem names the file and the key.

The file's other sections are the front ends': ds4f.settings reads the whole file through
read_config, naming their sections, and so refuses a section nobody reads; load_config alone
reads the engine's sections and passes over the others.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ds4f.errors import Ds4fError
from ds4f.native.kernels import BACKENDS, available_backends
from ds4f.units import format_bytes
from ds4f.paths import check_path_value, directory_problem, user_cache_dir, user_config_path
from ds4f.safe_read import read_regular_text

BACKEND_NAMES = ("auto",) + BACKENDS  # what a config or a request may name

# The limits of a run, the same for every front end.
DEFAULT_GEN = 8            # tokens to generate when a front end is not told
MAX_GEN = 100_000          # tokens per run (a prompt has no limit of its own: with them it must fit the
                           # preset's context, the positions its KV cache is allocated for)
MAX_THREADS = 256          # kernel or I/O threads
MAX_PARALLEL = 64          # sequences a server steps together
DEFAULT_PARALLEL = 4       # what [server] parallel = 0 gives where the memory plan fits it
DEFAULT_CONTEXT = 4096     # positions a preset's KV cache holds when its [presets] entry does not say
MAX_CONTEXT = 1 << 20      # the model's 1M positions
DEFAULT_CHUNK = 64         # prompt tokens a layer-major prefill chunk takes when a preset does not say
MAX_CHUNK = 4096
AUTO_CHUNK = -1            # prefill_chunk = "auto": the largest chunk the memory plan fits (runs.plan.chunk_that_fits)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$", re.I)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True)
class Budget:
    """A byte size, or a fraction of some whole (the expert pool, the layer count)."""

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, whole: int) -> int:
        """Bytes, at most `whole` (a budget above the whole it divides would only cost memory)."""
        if self.fraction is not None:
            return int(self.fraction * whole)
        return min(int(self.nbytes or 0), whole)

    def exceeds(self, whole: int) -> bool:
        """A byte size larger than the whole: resolve() clamps it, and the caller says so."""
        return self.fraction is None and int(self.nbytes or 0) > whole

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        return format_bytes(self.nbytes or 0)


MAX_BYTES = 1 << 60      # a size past this is a typo, not a machine


def parse_budget(value, where: str) -> Budget:
    """'25%' / 0.25 (fraction of the pool) or '4 GiB' / '512MiB' / a byte count."""
    if isinstance(value, bool):
        raise Ds4fError(f"{where}: expected a size like '4 GiB' or a fraction like '25%', got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= 1:
            raise Ds4fError(f"{where}: a bare number is a fraction of the pool between 0 and 1, got {value!r};"
                            f" write a size with its unit ('4 GiB') or a percentage ('25%')")
        return Budget(fraction=value)
    if isinstance(value, int):
        if value <= 0:
            raise Ds4fError(f"{where}: a size in bytes must be positive, got {value}")
        if value > MAX_BYTES:
            raise Ds4fError(f"{where}: {value} bytes is more than any machine has (at most 1 EiB)")
        return Budget(nbytes=value)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise Ds4fError(f"{where}: {value!r} is not a percentage") from None
            if not 0 < pct <= 100:
                raise Ds4fError(f"{where}: {value!r} must be more than 0% and at most 100%")
            return Budget(fraction=pct / 100)
        m = _SIZE_RE.match(text)
        if m and m.group(2) is None:
            raise Ds4fError(f"{where}: {value!r} has no unit: write '{text} GiB', '{text} MiB' or a percentage")
        if m:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if not math.isfinite(size) or size > MAX_BYTES:
                raise Ds4fError(f"{where}: {value!r} is more than any machine has (at most 1 EiB)")
            nbytes = int(size)
            if nbytes <= 0:
                raise Ds4fError(f"{where}: {value!r} is no room at all")
            return Budget(nbytes=nbytes)
    raise Ds4fError(f"{where}: expected a size like '4 GiB' or a fraction like '25%', got {value!r}")


@dataclass(frozen=True)
class Preset:
    name: str
    pinned_layers: str          # "all" | "none" | "N" | "P%"
    cache: Budget               # expert-cache budget
    policy: str = "cycle"
    io_threads: int | None = None       # None: the [engine] default
    kernel_threads: int | None = None
    prefetch: bool = False              # router lookahead prefetch
    context: int = DEFAULT_CONTEXT      # positions a run may reach (the KV cache is sized for them)
    cache_limit: Budget | None = None   # a size the expert cache never exceeds, whatever `cache` gives
    prefill_chunk: int = DEFAULT_CHUNK  # prompt tokens per layer-major prefill chunk (0: token by token;
                                        # AUTO_CHUNK: the largest the memory plan fits, runs.plan.chunk_that_fits)

    def cache_bytes(self, pool_bytes: int) -> int:
        """The expert cache's budget on a pool of pool_bytes: `cache`, at most `cache_limit`."""
        n = self.cache.resolve(pool_bytes)
        return min(n, self.cache_limit.resolve(pool_bytes)) if self.cache_limit is not None else n

    def pinned_count(self, n_layers: int) -> int:
        """How many trunk layers (from layer 0) stay resident."""
        p = self.pinned_layers
        if p == "all":
            return n_layers
        if p == "none":
            return 0
        if p.endswith("%"):
            return min(n_layers, round(float(p[:-1]) / 100 * n_layers))
        return min(n_layers, int(p))

    def describe(self) -> str:
        return f"{self.name}: pinned {self.pinned_layers}, cache {self.cache}, {self.policy}"


@dataclass(frozen=True)
class KvSettings:
    """The prefix cache ([kv]): session states kept in RAM up to ram_bytes and in `dir` up to
    disk_bytes (0: no disk tier), so a prompt that starts as an earlier one did reuses its state."""
    ram_bytes: int
    dir: str                             # resolved, never empty
    disk_bytes: int
    block: int = 256                     # positions a block of kept rows spans (rounded up to the ratios)
    write_budget: int = 0                # bytes written to `dir` a day; 0: no bound


@dataclass(frozen=True)
class Config:
    source: str                          # the file the user's values came from ("built-in" if none)
    model_path: str                      # "" = demo model
    preset: str
    io_threads: int
    kernel_threads: int                  # 0 = all cores
    backend: str
    probe_floor: bool
    presets: dict[str, Preset] = field(default_factory=dict)
    kv: "KvSettings | None" = None       # the prefix cache ([kv]); None: off

    def default_backend(self) -> str:
        """The backend a run gets when it names none: engine.backend unless it is auto; else
        DS4F_KERNELS when it names a backend this machine has; else auto (the best here)."""
        if self.backend != "auto":
            return self.backend
        env = os.environ.get("DS4F_KERNELS", "").strip()
        return env if env in available_backends() else "auto"

    def get_preset(self, name: str | None = None) -> Preset:
        name = name or self.preset
        if name not in self.presets:
            raise Ds4fError(f"{self.source}: no preset named {name!r} (have: {', '.join(self.presets)})")
        return self.presets[name]

    def effective_kernel_threads(self, preset: Preset | None = None) -> int:
        n = (preset.kernel_threads if preset and preset.kernel_threads else None) or self.kernel_threads
        return n if n and n > 0 else (os.cpu_count() or 1)

    def effective_io_threads(self, preset: Preset | None = None) -> int:
        return (preset.io_threads if preset and preset.io_threads else None) or self.io_threads

    def kv_directory(self, option: str | None = None) -> str | None:
        """The prefix cache's directory a run keeps states in: --kv-dir (`option`, refused as [kv] dir
        is at load when it is a file) or [kv] dir; None when none is kept on disk ([kv] off, budget 0)."""
        if self.kv is None or not self.kv.disk_bytes:
            return None
        return check_kv_dir(option, "--kv-dir", "kv_dir") if option else self.kv.dir


def builtin_config_text() -> str:
    return resources.files("ds4f").joinpath("ds4f.toml").read_text()


def find_config(explicit: str | os.PathLike | None = None) -> Path | None:
    """The config file in force: explicit, ./ds4f.toml, the user's, else None (built-in)."""
    if explicit:
        path = Path(check_path_value(os.fspath(explicit), "--config", param="config")).expanduser()
        if not (path.exists() or path.is_symlink()):
            raise Ds4fError(f"{path}: config file not found", path=path)
        return path   # a FIFO, device or directory there is refused when it is read, naming what it is
    for candidate in (Path.cwd() / "ds4f.toml", user_config_path()):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def _parse_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Ds4fError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:     # arrays or inline tables inside one another past the parser's depth
        raise Ds4fError(f"{source}: not valid TOML: arrays or tables nested too deeply") from None


# The engine's sections: each key and the types its value may have ([presets] apart: a table of presets).
SECTIONS = {
    "model": {"path": str},
    "engine": {"preset": str, "io_threads": int, "kernel_threads": int, "backend": str, "probe_floor": bool},
    "kv": {"enabled": bool, "ram": (str, int), "dir": str, "budget": (str, int), "block": int,
           "write_budget": (str, int)},
}
PATH_KEYS = (("model", "path"), ("kv", "dir"))   # checked at load: no NUL byte, not too long
MAX_CONFIG_BYTES = 1 << 20     # a config file larger than this is refused unread
_PRESET_KEYS = {"pinned_layers": (str, int), "cache": (str, int, float), "policy": str,
                "io_threads": int, "kernel_threads": int, "prefetch": bool, "context": int,
                "cache_limit": (str, int), "prefill_chunk": (int, str)}


def _check_type(value, types, where: str):
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:
        raise Ds4fError(f"{where}: expected {' or '.join(t.__name__ for t in types)}, got {value!r}")
    if not isinstance(value, types):
        raise Ds4fError(f"{where}: expected {' or '.join(t.__name__ for t in types)}, got {value!r}")


def _merge(base: dict, over: dict, source: str, known: dict, strict: bool) -> dict:
    """`over` merged over `base`, each key of the `known` sections checked for its type; a section
    not known is refused (strict), else passed over."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in over.items():
        if section == "presets":
            if not isinstance(values, dict):
                raise Ds4fError(f"{source}: [presets] must be a table")
            presets = dict(out.get("presets", {}))
            for name, body in values.items():
                if not isinstance(body, dict):
                    raise Ds4fError(f"{source}: presets.{name} must be a table")
                presets[name] = {**presets.get(name, {}), **body}
            out["presets"] = presets
            continue
        if section not in known:
            if not strict:
                continue
            raise Ds4fError(f"{source}: unknown section [{section}] (known: {', '.join([*known, 'presets'])})")
        if not isinstance(values, dict):
            raise Ds4fError(f"{source}: [{section}] must be a table")
        for key, value in values.items():
            if key not in known[section]:
                raise Ds4fError(f"{source}: unknown key {section}.{key} (known: {', '.join(known[section])})")
            _check_type(value, known[section][key], f"{source}: {section}.{key}")
            out.setdefault(section, {})[key] = value
    return out


def _preset(name: str, body: dict, source: str) -> Preset:
    where = f"{source}: presets.{name}"
    for key, value in body.items():
        if key not in _PRESET_KEYS:
            raise Ds4fError(f"{where}.{key}: unknown key (known: {', '.join(_PRESET_KEYS)})")
        _check_type(value, _PRESET_KEYS[key], f"{where}.{key}")
    pinned = str(body.get("pinned_layers", "all")).strip().lower()
    if not (pinned in ("all", "none") or re.fullmatch(r"\d+", pinned)
            or re.fullmatch(r"\d+(\.\d+)?%", pinned) and float(pinned[:-1]) <= 100):
        raise Ds4fError(f"{where}.pinned_layers: expected 'all', 'none', a count or a percentage, got {body['pinned_layers']!r}")
    policy = body.get("policy", "cycle")
    from ds4f.engine.runtime.policies import ONLINE_POLICIES

    if policy not in ONLINE_POLICIES:
        raise Ds4fError(f"{where}.policy: unknown policy {policy!r} (known: {', '.join(ONLINE_POLICIES)})")
    for key in ("io_threads", "kernel_threads"):
        if key in body and not 0 <= body[key] <= MAX_THREADS:
            raise Ds4fError(f"{where}.{key}: must be between 0 (the [engine] default) and {MAX_THREADS}, got {body[key]}")
    context = body.get("context", DEFAULT_CONTEXT)
    limit = parse_budget(body["cache_limit"], f"{where}.cache_limit") if "cache_limit" in body else None
    if limit is not None and limit.nbytes is None:
        raise Ds4fError(f"{where}.cache_limit: a size like '12 GiB', not a fraction, got {body['cache_limit']!r}")
    if not 1 <= context <= MAX_CONTEXT:
        raise Ds4fError(f"{where}.context: must be between 1 and {MAX_CONTEXT} positions, got {context}")
    chunk = body.get("prefill_chunk", DEFAULT_CHUNK)
    if chunk == "auto":
        chunk = AUTO_CHUNK
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk <= MAX_CHUNK:
        raise Ds4fError(f"{where}.prefill_chunk: must be from 0 (token by token) to {MAX_CHUNK} prompt tokens,"
                        f' or "auto" (the largest the memory plan fits), got {chunk!r}')
    return Preset(name=name, pinned_layers=pinned, cache=parse_budget(body.get("cache", "25%"), f"{where}.cache"),
                  policy=policy, io_threads=body.get("io_threads") or None,
                  kernel_threads=body.get("kernel_threads") or None, prefetch=bool(body.get("prefetch", False)),
                  context=context, cache_limit=limit, prefill_chunk=chunk)


@dataclass(frozen=True)
class ConfigFile:
    """ds4f.toml as read: the built-in file with the user's merged over it, each key checked for its type."""
    values: dict             # section -> key -> value; "presets": name -> its table
    path: Path | None        # the user's file; None: the built-in one alone
    source: str              # what messages name: the user's file, else "built-in ds4f.toml"


def read_config(explicit: str | os.PathLike | None = None, sections: dict | None = None,
                path_keys: tuple = ()) -> ConfigFile:
    """The config in force (see the module docstring), read once: merged over the built-in file,
    each key checked for its type and each path key for a usable path; raise Ds4fError naming file
    and key. `sections` (section -> key -> the types a value may have) and `path_keys`: the other
    readers' sections, known beside the engine's; with them a section nobody reads is refused,
    without them the sections that are not the engine's are passed over."""
    known, strict = {**SECTIONS, **(sections or {})}, sections is not None
    builtin = "built-in ds4f.toml"
    raw = _merge({}, _parse_toml(builtin_config_text(), builtin), builtin, known, strict)
    path = find_config(explicit)
    source = builtin
    if path is not None:
        source = str(path)
        # a regular file of at most MAX_CONFIG_BYTES, whatever st_size says (a FIFO would block, a
        # device never end); not UTF-8 is refused naming the byte
        text = read_regular_text(path, "config file", MAX_CONFIG_BYTES)
        raw = _merge(raw, _parse_toml(text, source), source, known, strict)
    for section, key in (*PATH_KEYS, *path_keys):
        value = raw.get(section, {}).get(key)
        if value:
            check_path_value(value, f"{source}: {section}.{key}", param=f"{section}.{key}")
    return ConfigFile(values=raw, path=path, source=source)


def load_config(explicit: str | os.PathLike | None = None, *, check_dirs: bool = True) -> Config:
    """The engine's settings of the config in force (read_config; ds4f.settings.load_settings reads
    them with the front ends'); raise Ds4fError naming file and key. check_dirs: as config_from."""
    return config_from(read_config(explicit), check_dirs=check_dirs)


def config_from(file: ConfigFile, *, check_dirs: bool = True) -> Config:
    """The engine's settings in `file`, checked; raise Ds4fError naming file and key.
    check_dirs=False: a [kv] dir that is a file is not refused (a run's own load: the command or
    server that started it refused one at its start; a file put there since is said in the run's
    log, and its states are kept in RAM only)."""
    raw, path, source = file.values, file.path, file.source
    eng = raw["engine"]
    presets = {name: _preset(name, body, source) for name, body in raw.get("presets", {}).items()}
    if not presets:
        raise Ds4fError(f"{source}: no presets defined")
    if eng["backend"] not in BACKEND_NAMES:
        raise Ds4fError(f"{source}: engine.backend: unknown backend {eng['backend']!r} (known: {', '.join(BACKEND_NAMES)})")
    if eng["preset"] not in presets:
        raise Ds4fError(f"{source}: engine.preset: no preset named {eng['preset']!r} (have: {', '.join(presets)})")
    if not 1 <= eng["io_threads"] <= MAX_THREADS:
        raise Ds4fError(f"{source}: engine.io_threads: must be between 1 and {MAX_THREADS}, got {eng['io_threads']}")
    if not 0 <= eng["kernel_threads"] <= MAX_THREADS:
        raise Ds4fError(f"{source}: engine.kernel_threads: must be between 0 (all cores) and {MAX_THREADS},"
                        f" got {eng['kernel_threads']}")
    model_path = raw["model"]["path"]
    if model_path and path is not None and not os.path.isabs(os.path.expanduser(model_path)):
        model_path = str((path.parent / model_path))  # relative to the config file
    kv = _kv_settings(raw["kv"], source, path, check_dirs)
    return Config(source=source, model_path=os.path.expanduser(model_path), preset=eng["preset"],
                  io_threads=eng["io_threads"], kernel_threads=eng["kernel_threads"], backend=eng["backend"],
                  probe_floor=eng["probe_floor"], presets=presets, kv=kv)


def check_kv_dir(where: str, source: str, param: str) -> str:
    """The prefix cache's directory ([kv] dir, --kv-dir) when one can be made there: refused, naming
    `source` and the file in the way, when it is a file (or a part of its path is) rather than a
    directory; a directory that becomes a file later is said in the run's log (states kept in RAM)."""
    check_path_value(where, source, param=param)
    problem = directory_problem(where)
    if problem is not None:
        raise Ds4fError(f"{source}: {problem}; the prefix cache keeps its states in a directory: give one"
                        f" (or kv.budget = 0 to keep them in RAM only)", param=param, path=where)
    return where


def _kv_settings(kv: dict, source: str, path: Path | None, check_dirs: bool = True) -> KvSettings | None:
    if not kv["enabled"]:
        return None
    sizes = {}
    for key in ("ram", "budget", "write_budget"):
        if kv[key] in (0, "0"):              # none kept in that tier
            sizes[key] = 0
            continue
        size = parse_budget(kv[key], f"{source}: kv.{key}")
        if size.nbytes is None:
            raise Ds4fError(f"{source}: kv.{key}: a size like '2 GiB' or '20 GB', not a fraction, got {kv[key]!r}")
        sizes[key] = size.nbytes
    where = os.path.expanduser(kv["dir"]) if kv["dir"] else str(user_cache_dir() / "kv")
    if kv["dir"] and path is not None and not os.path.isabs(where):
        where = str(path.parent / where)   # relative to the config file
    if not 1 <= kv["block"] <= 1 << 16:
        raise Ds4fError(f"{source}: kv.block: positions a block of kept rows spans, from 1 to 65536, got {kv['block']}")
    if sizes["budget"] and check_dirs:
        check_kv_dir(where, f"{source}: kv.dir", "kv.dir")
    return KvSettings(ram_bytes=sizes["ram"], dir=where, disk_bytes=sizes["budget"], block=kv["block"],
                      write_budget=sizes["write_budget"])
