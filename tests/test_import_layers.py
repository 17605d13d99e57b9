"""The package's import graph: no cycles, and no module importing up the layers.

The graph is read from the source with :mod:`ast` (nothing is imported), over every
module of ``kvserve``. An edge ``a -> b`` is an import in ``a`` of module ``b`` (a
``from b import name`` where ``b.name`` is itself a module is an edge to ``b.name``;
the implicit import of a parent package is not an edge). Each edge has a kind:

- ``module``: executed when ``a`` is imported;
- ``function``: inside a function or method body, executed when it runs. Such an
  import used to dodge a cycle still couples the two modules both ways, so it counts
  for both rules below;
- ``type``: under ``if TYPE_CHECKING:``, never executed. The names it brings are
  still the other module's, so it counts too.

Rules (the tests), over edges of every kind:

1. no cycle (strongly connected components of more than one module);
2. a module imports only modules of its own layer or a lower one (:data:`LAYERS`:
   folders are the layers; the command-line modules are the one exception);
3. no two folders import each other but the pairs :data:`FOLDER_CYCLES` names (a
   cycle of folders through modules that form no cycle themselves).

Both hold with no exception: a shared piece moves down a layer (e.g.
``model/llama_params.py`` under ``llama.py``, ``llama_native.py`` and
``llama_weights.py``; the sampler into ``sampling/``, under ``worker/`` and
``spec_decode/``), a deferred or ``TYPE_CHECKING`` import does not pay for it.

Run ``python tests/test_import_layers.py [checkout]`` for the report: edges of each kind, the
cycles, the imports that go up the layers and the folders that import each other.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvserve"
RUNTIME = ("module", "function")
STRICT = ("module", "function", "type")

# Layers, lowest first. A module belongs to the layer of the longest prefix below that
# names it (a prefix names a module and everything under it). Each folder is one layer,
# or shares one with folders it neither imports nor is imported by; the exceptions are
# named: ``lora/config`` and ``lora/errors`` (configuration, imported by ``config.py``),
# ``model/`` with ``lora/`` (see FOLDER_CYCLES) and the command lines.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "kvserve.errors",
            "kvserve.checks",
            "kvserve.seeding",
            "kvserve.buckets",
            "kvserve.prompt_check",
            "kvserve.switches",
            "kvserve.child_process",
        ),
    ),
    (
        "config",
        (
            "kvserve.config",
            "kvserve.speculative_config",
            "kvserve.lora.config",
            "kvserve.lora.errors",
        ),
    ),
    ("structured", ("kvserve.structured",)),
    ("request", ("kvserve.request",)),
    ("kv_cache", ("kvserve.kv_cache",)),
    ("kv_store", ("kvserve.kv_offload", "kvserve.kv_transfer")),
    ("model", ("kvserve.model", "kvserve.lora")),
    ("sched", ("kvserve.sched",)),
    # below both the runner and speculative decoding, which draw from the same sampler
    ("sampling", ("kvserve.sampling",)),
    ("spec_decode", ("kvserve.spec_decode",)),
    ("worker", ("kvserve.worker",)),
    ("engine", ("kvserve.engine",)),
    # fronts on an engine: the HTTP server, the offline LLM (vllm/entrypoints/llm.py
    # in vLLM), the simulator, the benchmarks, the public API
    ("front", ("kvserve.entrypoints", "kvserve.sim", "kvserve.bench", "kvserve")),
    ("cluster", ("kvserve.cluster",)),
    # the command lines, which start any of the above
    (
        "cli",
        (
            "kvserve.entrypoints.cli",
            "kvserve.entrypoints.serve_cmd",
            "kvserve.entrypoints.serve_replicas",
            "kvserve.entrypoints.generate_cmd",
            "kvserve.bench.cli",
            "kvserve.sim.cli",
        ),
    ),
)

# Pairs of folders that still import each other (so they share a layer), each with the
# imports that tie them. The test fails when a new pair appears and when one listed here
# no longer exists (then delete its entry).
FOLDER_CYCLES: dict[frozenset[str], str] = {
    frozenset({"model", "lora"}): (
        "model/llama*.py use lora/weights.py (LoRAWeights, LoRABatch); lora/ uses"
        " model/arch.py and model/kernels/ (the LoRA kernel's build)"
    ),
}


@dataclass
class ImportGraph:
    modules: dict[str, Path]
    # src -> dst -> kind (the most binding kind when a module imports another twice)
    edges: dict[str, dict[str, str]] = field(default_factory=dict)

    def edges_of(self, kinds: tuple[str, ...]) -> dict[str, list[str]]:
        return {
            m: sorted(d for d, k in self.edges.get(m, {}).items() if k in kinds)
            for m in self.modules
        }


_ORDER = {"module": 0, "function": 1, "type": 2}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_graph(root: Path = ROOT) -> ImportGraph:
    """The import graph of ``root/kvserve`` (see the module docstring)."""
    modules = {_module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}
    graph = ImportGraph(modules)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: dict[str, str] = {}

        def add(target: str | None, kind: str, src: str = name, out: dict[str, str] = out) -> None:
            if target is None or target == src:
                return
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                return
            if target not in out or _ORDER[kind] < _ORDER[out[target]]:
                out[target] = kind

        def visit(
            node: ast.AST,
            kind: str,
            package: str = package,
            add=add,  # type: ignore[no-untyped-def]
        ) -> None:
            for child in ast.iter_child_nodes(node):
                k = kind
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    k = "type" if kind == "type" else "function"
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    for stmt in child.body:
                        visit(ast.Module(body=[stmt], type_ignores=[]), "type")
                    for stmt in child.orelse:
                        visit(ast.Module(body=[stmt], type_ignores=[]), k)
                    continue
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        add(owner(alias.name), k)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")
                        if child.level > 1:
                            parts = parts[: -(child.level - 1)]
                        base = ".".join([*parts, base] if base else parts)
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        add(full if full in modules else owner(base), k)
                visit(child, k)

        visit(tree, "module")
        graph.edges[name] = out
    return graph


def cycles(graph: ImportGraph, kinds: tuple[str, ...] = STRICT) -> list[list[str]]:
    """Strongly connected components (more than one module) over ``kinds`` edges."""
    adj = graph.edges_of(kinds)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:  # Tarjan, recursive: the graph is a few hundred nodes
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in adj[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in adj:
        if v not in index:
            connect(v)
    return sorted(found)


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank < 0:
        raise AssertionError(f"{module} is in no layer; add it to LAYERS")
    return rank


def upward_imports(
    graph: ImportGraph, kinds: tuple[str, ...] = STRICT
) -> list[tuple[str, str, str]]:
    """``(importer, imported, kind)`` for every ``kinds`` edge to a higher layer."""
    return [
        (a, b, kind)
        for a, targets in sorted(graph.edges.items())
        for b, kind in sorted(targets.items())
        if kind in kinds and layer_of(b) > layer_of(a)
    ]


def folder_of(module: str) -> str:
    """The folder (or top-level module) ``module`` lives in. A module LAYERS names
    below its folder (``lora/config``) counts as a folder of its own, and the command
    lines are one folder, ``cli``."""
    if layer_of(module) == len(LAYERS) - 1:
        return "cli"
    named = max(
        (p for _, ps in LAYERS for p in ps if module == p or module.startswith(p + ".")),
        key=len,
    )
    parts = named.split(".")
    if len(parts) > 2:
        return ".".join(parts[1:])
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def folder_cycles(graph: ImportGraph, kinds: tuple[str, ...] = STRICT) -> list[list[str]]:
    """Cycles of the graph of folders (an edge where any module of one imports any of
    the other), over ``kinds`` edges."""
    folders = ImportGraph({folder_of(m): Path() for m in graph.modules})
    for a, targets in graph.edges.items():
        for b, kind in targets.items():
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb:
                folders.edges.setdefault(fa, {})[fb] = kind
    return cycles(folders, kinds)


def _describe(graph: ImportGraph, components: Iterable[list[str]]) -> str:
    lines = []
    for comp in components:
        members = set(comp)
        lines.append("cycle: " + ", ".join(comp))
        for a in comp:
            for b, kind in sorted(graph.edges[a].items()):
                if b in members:
                    lines.append(f"    {a} -> {b} ({kind}-level import)")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph()


def test_graph_reads_the_imports(graph: ImportGraph) -> None:
    """The reader finds the imports it must (else the rules below prove nothing)."""
    edges = graph.edges
    assert edges["kvserve.config"]["kvserve.buckets"] == "module"
    assert edges["kvserve.worker.model_runner"]["kvserve.sched.output"] == "module"
    assert edges["kvserve.request"]["kvserve.structured.params"] == "function"
    assert edges["kvserve.engine.engine_core"]["kvserve.lora.manager"] == "type"
    assert len(graph.modules) > 150


def test_reader_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvserve.b import x\n")
    (pkg / "b.py").write_text("x = 1\n\ndef f():\n    from kvserve import a\n    return a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvserve.a\n"
    )
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nimport kvserve.c\nif TYPE_CHECKING:\n    import kvserve.d\n"
    )
    g = build_graph(tmp_path)
    assert g.edges["kvserve.b"] == {"kvserve.a": "function"}
    assert g.edges["kvserve.c"] == {"kvserve.a": "type"}
    assert cycles(g, RUNTIME) == [["kvserve.a", "kvserve.b"]]
    # counted the strict way, a TYPE_CHECKING import closes a cycle too
    (pkg / "a.py").write_text("from kvserve.b import x\nimport kvserve.c\n")
    g = build_graph(tmp_path)
    assert cycles(g) == [["kvserve.a", "kvserve.b", "kvserve.c"]]


def test_reader_finds_an_import_up_the_layers(tmp_path: Path) -> None:
    for sub in ("sched", "engine"):
        (tmp_path / PACKAGE / sub).mkdir(parents=True)
        (tmp_path / PACKAGE / sub / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "engine" / "core.py").write_text("from kvserve.sched import policy\n")
    (tmp_path / PACKAGE / "sched" / "policy.py").write_text(
        "def f():\n    from kvserve.engine.core import x\n"
    )
    g = build_graph(tmp_path)
    assert upward_imports(g) == [("kvserve.sched.policy", "kvserve.engine.core", "function")]


def test_no_import_cycles(graph: ImportGraph) -> None:
    """No cycle, function-level and TYPE_CHECKING imports included."""
    found = cycles(graph)
    assert not found, "import cycles (move the shared piece down a layer):\n" + _describe(
        graph, found
    )


def test_every_module_has_a_layer(graph: ImportGraph) -> None:
    for module in graph.modules:
        layer_of(module)


def test_no_import_goes_up_the_layers(graph: ImportGraph) -> None:
    """Every import counts (function-level and TYPE_CHECKING ones too)."""
    up = upward_imports(graph)
    names = [name for name, _ in LAYERS]
    assert not up, (
        "imports up the layers (lowest first: "
        + " < ".join(names)
        + "):\n"
        + "\n".join(
            f"    {a} ({names[layer_of(a)]}) -> {b} ({names[layer_of(b)]}), {k}-level"
            for a, b, k in up
        )
    )


def test_folders_import_each_other_only_where_listed(graph: ImportGraph) -> None:
    """Folders are the layers: no two folders import each other (every kind of import
    counts) but the pairs in FOLDER_CYCLES, and every pair listed still does."""
    found = {frozenset(c) for c in folder_cycles(graph)}
    ties = [
        f"    {a} -> {b} ({k}-level)"
        for a, targets in sorted(graph.edges.items())
        for b, k in sorted(targets.items())
        if any({folder_of(a), folder_of(b)} <= c for c in found - set(FOLDER_CYCLES))
        and folder_of(a) != folder_of(b)
    ]
    assert found <= set(FOLDER_CYCLES), (
        "folders that import each other (move the shared piece down a layer):\n" + "\n".join(ties)
    )
    gone = set(FOLDER_CYCLES) - found
    assert not gone, f"no longer a cycle, delete from FOLDER_CYCLES: {sorted(map(sorted, gone))}"


def test_reader_finds_a_cycle_of_folders(tmp_path: Path) -> None:
    for sub in ("sched", "worker"):
        (tmp_path / PACKAGE / sub).mkdir(parents=True)
        (tmp_path / PACKAGE / sub / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "worker" / "runner.py").write_text("from kvserve.sched import a\n")
    (tmp_path / PACKAGE / "sched" / "a.py").write_text("x = 1\n")
    (tmp_path / PACKAGE / "sched" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvserve.worker.runner\n"
    )
    g = build_graph(tmp_path)
    assert cycles(g) == []  # no cycle of modules ...
    assert folder_cycles(g) == [["sched", "worker"]]  # ... but one of folders


def main(argv: list[str]) -> int:
    """The report for the checkout at ``argv[0]`` (default: this one)."""
    g = build_graph(Path(argv[0]) if argv else ROOT)
    counts = {k: sum(1 for t in g.edges.values() for v in t.values() if v == k) for k in _ORDER}
    print(
        f"{len(g.modules)} modules; internal imports: "
        + ", ".join(f"{n} {k}-level" for k, n in counts.items())
    )
    found = cycles(g)
    print(f"cycles (TYPE_CHECKING imports included): {len(found)}")
    if found:
        print(_describe(g, found))
    up = upward_imports(g)
    print(f"imports up the layers (all kinds): {len(up)}")
    for a, b, k in up:
        print(f"    {a} -> {b} ({k}-level)")
    tied = folder_cycles(g)
    print(f"folders that import each other: {len(tied)}")
    for comp in tied:
        print(
            "    "
            + ", ".join(comp)
            + ("  (listed in FOLDER_CYCLES)" if frozenset(comp) in FOLDER_CYCLES else "")
        )
    return 1 if found or up or {frozenset(c) for c in tied} - set(FOLDER_CYCLES) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
