"""The package's import graph: no cycle, and no import running back up DESIGN.md's layering.

The graph is read from the source (``ast``), not from ``sys.modules``: an edge is any
``import`` / ``from ... import`` of a module of the package, at module level or inside a function
(a function-level import is a cycle deferred, not removed), except under ``if TYPE_CHECKING:``
(never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``; importing a submodule is not counted as importing its package's ``__init__`` (Python runs
it, but every submodule would then "import" its package and every package its submodules).
"""
from __future__ import annotations

import ast

import helpers

PACKAGE = "one_embedding"

#: DESIGN.md "Packages": "Dependencies point one way: cli -> training -> pipeline -> embedding ->
#: parallel, shard -> chain -> cache, store -> tiers -> hashing, backend", top first; a module of a
#: layer imports nothing of a layer above it (training's builders and its progress records are
#: modules of the training layer)
LAYERS = (("cli",), ("training", "training_setup", "training_progress"), ("pipeline",),
          ("embedding",), ("parallel", "shard"), ("chain",), ("cache", "store"), ("tiers",),
          ("hashing", "backend"))
#: further one-way rules, (lower, what it must not import): "models and nn sit beside embedding,
#: above kernels"; ``store_dict`` knows OneFlow's dict layout only, ``options`` imports it
BELOW = {"kernels": {"models", "nn", "embedding", "pipeline", "training", "training_setup",
                     "training_progress", "cli"},
         "store_dict": {"options"}}


def _modules(root) -> dict:
    """dotted name -> (path, is a package's __init__)"""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking_only(tree) -> set:
    """ids of the import nodes under ``if TYPE_CHECKING:``"""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for part in node.body for n in ast.walk(part))
    return skipped


def _targets(module: str, is_package: bool, node, modules: dict) -> list:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                 for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != PACKAGE:
            continue
        while name not in modules and "." in name:  # `import a.b.c` of a name inside a module
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def import_graph(root=helpers.PACKAGE.parent) -> dict:
    """module -> {modules it imports}, over every one_embedding/**/*.py"""
    modules = _modules(root)
    graph = {}
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        graph[module] = {t for node in ast.walk(tree)
                         if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
                         for t in _targets(module, is_package, node, modules) if t != module}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
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
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _unit(module: str) -> str:
    """one_embedding.store.slot_file -> "store"; one_embedding.cli -> "cli"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict) -> list:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    wrong = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = _unit(module), _unit(target)
            if here in layer and there in layer and layer[there] < layer[here]:
                wrong.append(f"{module} -> {target}")
            if there in BELOW.get(here, ()):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert len(graph) > 90
    # a module-level and a function-level edge
    assert "one_embedding.errors" in graph["one_embedding.options"]
    assert "one_embedding.training" in graph["one_embedding.cli"]  # imported inside cmd_train


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_import_runs_back_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_checks_find_a_cycle_and_an_upward_import():
    """The checks themselves can fail: a made-up graph with both defects."""
    graph = {"one_embedding.tiers.tier": {"one_embedding.chain"},
             "one_embedding.chain": {"one_embedding.tiers.tier"},
             "one_embedding.store_dict": {"one_embedding.options"},
             "one_embedding.options": {"one_embedding.store_dict"}}
    assert sorted(cycles(graph)) == [["one_embedding.chain", "one_embedding.tiers.tier"],
                                     ["one_embedding.options", "one_embedding.store_dict"]]
    assert upward_imports(graph) == ["one_embedding.store_dict -> one_embedding.options",
                                     "one_embedding.tiers.tier -> one_embedding.chain"]
