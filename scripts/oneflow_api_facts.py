"""Read OneFlow's public ``oneflow.one_embedding`` names out of its source, as facts: each name,
its kind and, for a callable, its parameters with their defaults as written. The names table of
docs/oneflow.md ("Coming from OneFlow") is measured against this file by tests/unit/test_oneflow_names.py.

    python scripts/oneflow_api_facts.py ONEFLOW_CHECKOUT [COMMIT] > tests/data/oneflow_one_embedding_api.json

Public means: not starting with "_"; at module level every function and class defined there and
every name imported from ``oneflow._oneflow_internal``; in a public class every method defined
there or in a public base class of the file, and every ``self.<name> =`` its ``__init__`` assigns
(the attributes a script reads). Nothing is run: the source is parsed with ``ast``.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SOURCE = "python/oneflow/one_embedding.py"


def _parameters(fn: ast.FunctionDef) -> list[list]:
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [[a.arg, None if d is None else ast.unparse(d)] for a, d in zip(positional, defaults)]
    out += [[a.arg, None if d is None else ast.unparse(d)]
            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [p for p in out if p[0] != "self"]


def _attributes(init: ast.FunctionDef) -> list[str]:
    names = []
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and not target.attr.startswith("_")
                        and target.attr not in names):
                    names.append(target.attr)
    return names


def facts(text: str) -> list[dict]:
    tree = ast.parse(text)
    classes = {}    # the classes defined so far: a base named later is another (imported) one
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defined_before = dict(classes)
            classes[node.name] = node
        if isinstance(node, ast.ImportFrom) and node.module == "oneflow._oneflow_internal":
            out += [{"name": a.asname or a.name, "kind": "imported"} for a in node.names
                    if not (a.asname or a.name).startswith("_")]
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out.append({"name": node.name, "kind": "function", "parameters": _parameters(node)})
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            chain = [node]
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            chain += [defined_before[b] for b in bases if b in defined_before]
            methods, attributes, init = {}, [], None
            for cls in chain:
                for item in cls.body:
                    if isinstance(item, ast.FunctionDef):
                        if item.name == "__init__" and init is None:
                            init = item
                        if not item.name.startswith("_") and item.name not in methods:
                            methods[item.name] = item
                        if item.name == "__init__":
                            attributes += [a for a in _attributes(item) if a not in attributes]
            # parameters None: __init__ comes from a class outside this file
            out.append({"name": node.name, "kind": "class",
                        "parameters": _parameters(init) if init else None,
                        "bases": [ast.unparse(b) for b in node.bases]})
            out += [{"name": f"{node.name}.{m}", "kind": "method", "parameters": _parameters(fn)}
                    for m, fn in methods.items()]
            out += [{"name": f"{node.name}.{a}", "kind": "attribute"} for a in attributes
                    if a not in methods]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(argv[0])
    commit = argv[1] if len(argv) > 1 else "unknown"
    names = facts((checkout / SOURCE).read_text())
    json.dump({"source": f"Oneflow-Inc/oneflow {SOURCE}", "commit": commit, "names": names},
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
