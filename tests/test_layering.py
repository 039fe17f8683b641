"""The package's layers, checked from the source: no import cycles, front ends reach the engine
only through ds4f.api, the engine knows nothing of its front ends, and the model's math owns no
threads and no files.

Every .py file under the package root (tests/ and virtualenvs aside) is parsed with ast; every
import counts, at module level or inside a function. `from ds4f.a.b import X` is an import of the
module ds4f.a.b.X if that is a module, else of the package ds4f.a.b (its __init__).
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]     # the repository root is the ds4f package
PACKAGE = "ds4f"
SKIP_DIRS = {"tests", "tools", "build", "dist", "__pycache__", "node_modules"}


@dataclass(frozen=True)
class Import:
    importer: str   # module doing the import
    target: str     # what it names: a ds4f module after resolution, else the dotted name as written
    line: int

    @property
    def where(self) -> str:
        return f"{_MODULES[self.importer].relative_to(ROOT)}:{self.line}"


def _skip(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts[:-1]
    return any(p in SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") or p.startswith("venv")
               for p in parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _find_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))
            if not _skip(p) and p != ROOT / "setup.py"}     # the build, not a module of the package


_MODULES = _find_modules()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _within(source, PACKAGE):
                out.append(Import(module, source, node.lineno))
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append(Import(module, sub if sub in _MODULES else source, node.lineno))
    return out


@functools.lru_cache(maxsize=1)
def _all_imports() -> tuple[Import, ...]:
    """Every import of the package, parsed once for all the tests of this module."""
    found = {imp for module, path in _MODULES.items() for imp in _imports_of(module, path)}
    return tuple(sorted(found, key=lambda imp: (imp.importer, imp.line, imp.target)))


def _internal_graph() -> dict[str, dict[str, Import]]:
    graph: dict[str, dict[str, Import]] = {m: {} for m in _MODULES}
    for imp in _all_imports():
        if imp.target in _MODULES and imp.target != imp.importer:
            graph[imp.importer].setdefault(imp.target, imp)
    return graph


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.append(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _a_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[str]:
    """One cycle through the component's first module (shortest, by breadth-first search)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component  # pragma: no cover - a strongly connected component always has a cycle


# ---------------------------------------------------------------------------------- the tests
def test_the_walk_sees_the_package():
    for module in ("ds4f", "ds4f.api", "ds4f.errors", "ds4f.paths", "ds4f.native.kernels", "ds4f.runs.run",
                   "ds4f.engine.model.forward", "ds4f.cachelab.replay", "ds4f.bench.engine", "ds4f.cli.runs"):
        assert module in _MODULES, module
    assert not any(_within(m, "ds4f.tests") for m in _MODULES)
    targets = {(imp.importer, imp.target) for imp in _all_imports()}
    assert ("ds4f.api", "ds4f.runs.run") in targets                          # from ds4f.runs.run import ...
    assert ("ds4f.cli.runs", "ds4f.api") in targets                          # inside functions too
    assert ("ds4f.engine.model.forward", "ds4f.native.kernels") in targets   # from ds4f.native import kernels


def test_the_cycle_finder_finds_cycles():
    def edges(**graph):
        return {a: {b: Import(a, b, 1) for b in bs} for a, bs in graph.items()}

    graph = edges(a=["b"], b=["c"], c=["a", "d"], d=[], e=["e"])
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _strongly_connected(edges(a=["b"], b=["c"], c=[])) == []


def _cycles(graph: dict[str, dict[str, Import]], what: str) -> list[str]:
    found = []
    for component in _strongly_connected(graph):
        cycle = _a_cycle(graph, component)
        steps = "\n".join(f"      {a} -> {b}  ({graph[a][b].where})" for a, b in zip(cycle, cycle[1:]))
        found.append(f"  {' -> '.join(cycle)}\n    (all of: {', '.join(component)})\n{steps}")
    return [f"{len(found)} import cycle(s) between {what}:"] + found if found else []


def test_no_import_cycles():
    problems = _cycles(_internal_graph(), "ds4f modules")
    assert not problems, "\n".join(problems)


def unit_of(module: str) -> str:
    """The unit a package-level cycle is counted between: a package, its __init__ and its plain
    modules together; a subpackage is a unit of its own. Each module of the root package is its
    own unit (errors and paths are below everything, api above)."""
    path = _MODULES[module]
    if path.name == "__init__.py":
        return module
    package = module.rsplit(".", 1)[0]
    return module if package == PACKAGE else package


def _package_graph(modules: dict[str, dict[str, Import]]) -> dict[str, dict[str, Import]]:
    """The module graph between units: every package and subpackage a node, an edge wherever one
    of a unit's modules imports one of another's, a subpackage importing its parent included (the
    parent importing its subpackage is an edge the other way, so the two make a cycle)."""
    graph: dict[str, dict[str, Import]] = {}
    for a, targets in modules.items():
        ua = unit_of(a)
        graph.setdefault(ua, {})
        for b, imp in targets.items():
            ub = unit_of(b)
            graph.setdefault(ub, {})
            if ua != ub:
                graph[ua].setdefault(ub, imp)
    return graph


def test_the_package_graph_sees_a_subpackage_importing_its_parent():
    def imp(a, b):
        return Import(a, b, 1)

    modules = {"ds4f.engine.engine": {"ds4f.engine.checkpoint.fingerprint":
                                      imp("ds4f.engine.engine", "ds4f.engine.checkpoint.fingerprint")},
               "ds4f.engine.checkpoint.synth": {"ds4f.engine.config":
                                                imp("ds4f.engine.checkpoint.synth", "ds4f.engine.config")},
               "ds4f.console.widgets.common": {"ds4f.console.widgets": imp("ds4f.console.widgets.common",
                                                                           "ds4f.console.widgets")}}
    graph = _package_graph(modules)
    assert set(graph["ds4f.engine.checkpoint"]) == {"ds4f.engine"}       # up to its parent
    assert set(graph["ds4f.engine"]) == {"ds4f.engine.checkpoint"}
    assert graph["ds4f.console.widgets"] == {}                              # a package's own __init__
    assert _strongly_connected(graph) == [["ds4f.engine", "ds4f.engine.checkpoint"]]


def test_no_package_level_cycles():
    """No cycle between packages either: every package and subpackage is a node, and a subpackage
    imports nothing of its parent that imports it (ds4f.engine's own modules, engine.py,
    session.py, config.py..., are above the engine's subpackages and never imported by them)."""
    problems = _cycles(_package_graph(_internal_graph()), "packages")
    assert not problems, "\n".join(problems)



def test_the_consoles_core_draws_nothing():
    """ds4f.console.core is below the console's app, screens and widgets, which import it: it
    imports none of them, and nothing of Textual but the Binding records of its key tables."""
    assert "ds4f.console.core.chat" in _MODULES and "ds4f.console.core.bindings" in _MODULES
    bad = [f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in _all_imports()
           if _within(imp.importer, "ds4f.console.core")
           and ((_within(imp.target, "ds4f.console") and not _within(imp.target, "ds4f.console.core"))
                or (_within(imp.target, "textual")
                    and (imp.importer, imp.target) != ("ds4f.console.core.bindings", "textual.binding")))]
    assert not bad, "ds4f.console.core imports the console's app, screens, widgets or Textual:\n" + "\n".join(bad)

# The layers, lowest first: a module may import its own layer and the layers below it, never one
# above. Each layer is a set of packages (or root modules).
LAYERS = (
    ("base", ("ds4f.errors", "ds4f.paths", "ds4f.safe_read", "ds4f.partials", "ds4f.units", "ds4f.themes")),
    ("native", ("ds4f.native",)),
    ("engine", ("ds4f.engine",)),          # inference: weights in, logits out
    ("settings", ("ds4f.settings",)),      # ds4f.toml whole: the engine's settings and the front ends'
    ("cachelab", ("ds4f.cachelab",)),      # traces, policies' replay, Belady
    ("runs", ("ds4f.runs",)),              # a measured run and its artifacts
    ("bench", ("ds4f.bench",)),            # the benchmarks
    ("api", ("ds4f.api",)),                # the front ends' one facade
    ("front ends", ("ds4f.server", "ds4f.console")),
    ("cli", ("ds4f.cli",)),                # serves, and opens the console's benchmark
)


def _layer_of(module: str) -> int | None:
    for i, (_, packages) in enumerate(LAYERS):
        if any(_within(module, p) for p in packages):
            return i
    return None


def test_every_module_has_a_layer():
    loose = [m for m in _MODULES if m != PACKAGE and _layer_of(m) is None]
    assert not loose, f"modules outside every layer of LAYERS: {loose}"


def test_layers_import_only_downwards():
    bad = []
    for imp in _all_imports():
        if imp.target not in _MODULES or imp.target == PACKAGE:
            continue
        a, b = _layer_of(imp.importer), _layer_of(imp.target)
        if a is not None and b is not None and b > a:
            bad.append(f"  {imp.where}: {imp.importer} ({LAYERS[a][0]}) imports {imp.target} ({LAYERS[b][0]})")
    assert not bad, "a layer imports one above it:\n" + "\n".join(bad)


# Which ds4f modules each front end may import: the API, itself, and what it runs or shows.
FRONT_ENDS = {
    "ds4f.console": ("ds4f.api", "ds4f.console", "ds4f.themes"),
    "ds4f.server": ("ds4f.api", "ds4f.server"),
    "ds4f.cli": ("ds4f.api", "ds4f.cli", "ds4f.server", "ds4f.console", "ds4f.bench"),   # `serve`, `bench ...`
}


def test_front_ends_reach_the_engine_only_through_the_api():
    bad = []
    for imp in _all_imports():
        layer = next((f for f in FRONT_ENDS if _within(imp.importer, f)), None)
        if layer is None or not _within(imp.target, PACKAGE):
            continue
        allowed = imp.target == PACKAGE or any(_within(imp.target, a) for a in FRONT_ENDS[layer])
        if not allowed:
            bad.append(f"  {imp.where}: {imp.importer} imports {imp.target}")
    assert not bad, "front ends must reach the engine and the runs through ds4f.api only:\n" + "\n".join(bad)


def test_only_the_benchmarks_and_the_cli_import_a_benchmark():
    benchmarks = ("ds4f.bench", "ds4f.console.bench")
    bad = [f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in _all_imports()
           if any(_within(imp.target, b) for b in benchmarks)
           and not any(_within(imp.importer, m) for m in (*benchmarks, "ds4f.cli"))]
    assert not bad, "only ds4f.bench and the CLI may import a benchmark:\n" + "\n".join(bad)


def test_the_engine_knows_nothing_of_runs_benchmarks_or_front_ends():
    forbidden = ("textual", "ds4f.runs", "ds4f.bench", "ds4f.cachelab", "ds4f.console", "ds4f.server", "ds4f.cli",
                 "ds4f.api", "ds4f.themes")
    bad = [f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in _all_imports()
           if _within(imp.importer, "ds4f.engine") and any(_within(imp.target, f) for f in forbidden)]
    assert not bad, ("the engine (inference) must not import runs, the cache lab, benchmarks, its front ends, "
                     "textual or ds4f.api:\n" + "\n".join(bad))


def test_the_model_math_has_no_threads_and_no_files():
    forbidden = ("threading", "_thread", "concurrent", "queue", "multiprocessing", "mmap", "os", "pathlib", "io",
                 "shutil", "tempfile", "ds4f.engine.runtime", "ds4f.engine.checkpoint", "ds4f.runs", "ds4f.bench",
                 "ds4f.cachelab")
    bad = [f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in _all_imports()
           if _within(imp.importer, "ds4f.engine.model") and any(_within(imp.target, f) for f in forbidden)]
    assert not bad, ("ds4f.engine.model is the math: no threads, no file access, no runtime, checkpoint, "
                     "runs, bench or cache lab:\n" + "\n".join(bad))


def test_the_servers_dialects_share_the_request_reader_not_each_other():
    dialects = ("ds4f.server.openai", "ds4f.server.responses", "ds4f.server.anthropic", "ds4f.server.routes",
                "ds4f.server.operator")
    shared = ("ds4f.server.request", "ds4f.server.generation")
    imports = _all_imports()
    bad = [f"  {imp.where}: {imp.importer} imports {imp.target}" for imp in imports
           if imp.importer in dialects + shared and imp.target in dialects and imp.target != imp.importer]
    assert not bad, ("the server's dialects read a request through ds4f.server.request and generate through "
                     "ds4f.server.generation; none imports another, nor does either shared module import one "
                     "(ds4f.server.app routes to them all):\n" + "\n".join(bad))
    readers = {imp.importer for imp in imports if imp.target == "ds4f.server.request"}
    assert set(dialects) <= readers, f"not reading through ds4f.server.request: {set(dialects) - readers}"
