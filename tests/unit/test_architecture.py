"""The layout keeps its promises: dependencies point one way, and compiled kernels release the GIL.

    embedding -> parallel, shard -> chain -> cache, store -> tiers -> hashing
"""
import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest
from numba.core.registry import CPUDispatcher

import one_embedding

PACKAGE = Path(one_embedding.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the one_embedding modules a source file imports (relative imports
    resolved)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    package = parts if path.name == "__init__.py" else parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "one_embedding" or n.startswith("one_embedding.")}


def sources(subpath: str):
    p = PACKAGE / subpath
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


def imports_of(subpath: str) -> set[str]:
    return set().union(*(imported_modules(p) for p in sources(subpath)))


def touches(imports: set[str], package: str) -> bool:
    full = f"one_embedding.{package}"
    return any(n == full or n.startswith(full + ".") for n in imports)


@pytest.mark.parametrize("module,forbidden", [
    ("embedding.py", ["store", "cache", "tiers", "chain"]),  # the front end reaches rows via shuffles
    ("cache", ["store", "chain", "shard", "embedding"]),
    ("store", ["cache", "chain", "shard", "embedding"]),
    ("tiers", ["cache", "store", "chain", "shard", "embedding", "parallel", "step"]),
    ("parallel", ["store", "cache", "tiers", "chain", "shard", "embedding"]),
    ("chain.py", ["shard", "embedding", "parallel"]),
    ("shard.py", ["embedding"]),
    ("write_log.py", ["store", "cache", "chain", "shard", "embedding", "parallel"]),
    ("step.py", ["store", "cache", "chain", "shard", "embedding"]),
    ("lifecycle.py", ["cache", "tiers", "chain", "shard", "embedding", "parallel"]),
])
def test_dependencies_point_one_way(module, forbidden):
    imports = imports_of(module)
    assert imports, f"found no imports in {module}: is the path right?"
    bad = [f for f in forbidden if touches(imports, f)]
    assert not bad, f"{module} imports {bad}: {sorted(imports)}"


def all_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="one_embedding."):
        if ".kernels.cuda" in info.name or info.name.endswith("__main__"):
            continue
        if info.name == "one_embedding.torch" and importlib.util.find_spec("torch") is None:
            continue  # the optional PyTorch bridge needs torch
        yield importlib.import_module(info.name)


def test_every_compiled_kernel_releases_the_gil():
    kernels = {}
    for module in all_modules():
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__:
                kernels[f"{module.__name__}.{name}"] = obj
    assert len(kernels) >= 20, sorted(kernels)
    holding = sorted(name for name, k in kernels.items() if not k.targetoptions.get("nogil"))
    assert not holding, f"numba kernels that hold the GIL: {holding}"
