"""OneFlow's public ``oneflow.one_embedding`` names, measured: every name read out of OneFlow's
source (tests/data/oneflow_one_embedding_api.json, written by scripts/oneflow_api_facts.py from
python/oneflow/one_embedding.py at the commit it records) is looked up here, and each callable's
arguments and defaults are compared with OneFlow's. The names table of docs/oneflow.md ("Coming
from OneFlow") is this measurement rendered; the test fails when the two differ. To rewrite it:

    python tests/unit/test_oneflow_names.py
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import one_embedding as oe

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
import helpers  # noqa: E402

FACTS = json.loads((helpers.ROOT / "tests" / "data" / "oneflow_one_embedding_api.json").read_text())
PAGE = helpers.ROOT / "docs" / "oneflow.md"
START, END = "<!-- oneflow-names: start (tests/unit/test_oneflow_names.py) -->", "<!-- oneflow-names: end -->"
EMBEDDINGS = ("Embedding", "MultiTableEmbedding", "MultiTableMultiColumnEmbedding")

#: why a name is absent or differs (explanations only: whether it is absent or differs is measured)
NOTES = {
    "OneEmbeddingHandler": "OneFlow's C++ handle of a table; the embedding holds its store itself",
    "shuffle_and_lookup": "OneFlow's graph-mode op; `prepare(ids)` + `embed(state)` here",
    "sgd_update": "called by OneFlow's `Optimizer`; `oe.Optimizer.step` updates rows here",
    "adam_update": "called by OneFlow's `Optimizer`; `oe.Optimizer.step` updates rows here",
    "adagrad_update": "called by OneFlow's `Optimizer`; `oe.Optimizer.step` updates rows here",
    "ftrl_update": "called by OneFlow's `Optimizer`; `oe.Optimizer.step` updates rows here",
    "is_full_cache": "OneFlow's flag for its update kernels",
    "key_value_store_options": "OneFlow's JSON of the store for its C++ side; `store_options` here",
    "embedding_tables": "OneFlow's JSON of the tables; `tables` here",
    "local_rank": "`comm.rank` here (one process per rank, `mpiexec`)",
    "rank_id": "`comm.rank` here",
    "world_size": "`comm.size` here",
    "handler": "OneFlow's C++ handle",
    "shadow": "OneFlow's shadow parameter that carries embedding gradients through autograd; "
              "none needed here",
    "embedding": "OneFlow's graph-mode attribute",
    "support_sparse": "OneFlow's graph compiler query",
    "embedding_param_group_dict": "OneFlow's bookkeeping of graph-mode updates",
    "defaults": "flow.optim.Optimizer's dict of settings; read them on the row optimizer "
                "(`opt.optimizer`) here",
    "state": "flow.optim.Optimizer's per-parameter state; an embedding row's state lives in its "
             "line here, a dense parameter's in the row optimizer",
}


def _instances():
    store = oe.make_device_mem_store_options(None, capacity=16)
    out = {name: getattr(oe, name)(f"names_{name}", 4, np.float32, np.int64, None, store,
                                   padding_idx=0) for name in EMBEDDINGS if hasattr(oe, name)}
    out["Optimizer"] = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[out["MultiTableEmbedding"]])
    out["Ftrl"] = oe.Ftrl(lr=0.1, convention="oneflow")
    return out


def _ours(fn) -> list[tuple[str, object]]:
    target = fn.__init__ if inspect.isclass(fn) else fn
    return [(p.name, p.default) for p in inspect.signature(target).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _same_default(theirs: str, ours) -> bool:
    try:
        value = ast.literal_eval(theirs)
    except ValueError:
        return True                      # an expression (a flow dtype ...): not comparable here
    if ours is inspect.Parameter.empty:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return float(value) == float(ours)
    return value == ours


def measure(entry: dict, instances: dict) -> tuple[str, str]:
    """-> (status, detail): status "same", "other defaults", "other arguments" or "missing"."""
    name, kind = entry["name"], entry["kind"]
    head, _, member = name.partition(".")
    obj = getattr(oe, head, None)
    if obj is None:
        return "missing", ""
    if kind == "attribute":
        holder = instances.get(head)
        return ("same", "") if holder is not None and hasattr(holder, member) else ("missing", "")
    if member:
        obj = getattr(obj, member, None)
        if obj is None:
            return "missing", ""
    theirs = entry.get("parameters")
    if kind == "imported" or theirs is None:
        return "same", ""
    ours = dict(_ours(obj))
    order = [n for n, _ in _ours(obj)]
    wanted = [n for n, _ in theirs]
    if order[:len(wanted)] != wanted:
        return "other arguments", f"OneFlow ({', '.join(wanted)}), here ({', '.join(order)})"
    differ = [f"{n}={ours[n] if ours[n] is not inspect.Parameter.empty else 'required'} "
              f"(OneFlow {d})" for n, d in theirs if d is not None and not _same_default(d, ours[n])]
    return ("other defaults", "; ".join(differ)) if differ else ("same", "")


def measure_all() -> list[tuple[dict, str, str]]:
    instances = _instances()
    try:
        return [(entry, *measure(entry, instances)) for entry in FACTS["names"]]
    finally:
        for name in EMBEDDINGS:
            if name in instances:
                instances[name].close()


def render(results) -> str:
    counts = {}
    for _, status, _ in results:
        counts[status] = counts.get(status, 0) + 1
    rows, done = [], set()
    for entry, status, detail in results:
        name = entry["name"]
        head, _, member = name.partition(".")
        label = f"`{name}`"
        if head in EMBEDDINGS and member:
            same = [r for r in results if r[0]["name"].partition(".")[2] == member
                    and r[0]["name"].partition(".")[0] in EMBEDDINGS]
            if all(r[1:] == (status, detail) for r in same):
                if member in done:
                    continue
                done.add(member)
                label = f"`<embedding>.{member}`"
        note = NOTES.get(member or name, "")
        text = {"same": "yes", "other defaults": "yes, other defaults",
                "other arguments": "yes, other arguments", "missing": "no"}[status]
        rows.append(f"| {label} | {entry['kind']} | {text} | {'; '.join(x for x in (detail, note) if x)} |")
    total = len(results)
    summary = (f"OneFlow's `python/oneflow/one_embedding.py` (commit {FACTS['commit'][:8]}) has {total} "
               f"public names (module names, class members, the attributes `__init__` sets): "
               f"{counts.get('same', 0)} are here with OneFlow's arguments and defaults, "
               f"{counts.get('other defaults', 0)} with other defaults, "
               f"{counts.get('other arguments', 0)} with other arguments, "
               f"{counts.get('missing', 0)} are not here. `<embedding>` stands for `Embedding`, "
               f"`MultiTableEmbedding` and `MultiTableMultiColumnEmbedding` where the three agree.")
    return "\n".join([START, summary, "", "| OneFlow name | kind | here | differences, why |",
                      "|---|---|---|---|", *rows, END])


def page_block() -> str:
    text = PAGE.read_text()
    match = re.search(re.escape(START) + ".*?" + re.escape(END), text, re.S)
    return match.group(0) if match else ""


def test_docs_names_table_is_the_measurement():
    want = render(measure_all())
    assert page_block() == want, ("docs/oneflow.md's OneFlow names table is stale: run "
                                    "`python tests/unit/test_oneflow_names.py`")


def test_the_facts_are_oneflows_names():
    names = {e["name"] for e in FACTS["names"]}
    # the names every OneEmbedding script touches are among the facts, so the walk covers them
    assert {"MultiTableEmbedding", "make_cached_ssd_store_options", "make_persistent_table_writer",
            "MultiTableEmbedding.forward", "MultiTableEmbedding.save_snapshot", "Optimizer",
            "Ftrl", "SmartDecayAdam", "PersistentTableReader"} <= names
    assert len(FACTS["commit"]) == 40


def test_a_missing_or_changed_name_is_measured_as_such(monkeypatch):
    instances = {}
    entry = {"name": "make_uniform_initializer", "kind": "function",
             "parameters": [["low", "0.0"], ["high", "1.0"]]}
    assert measure(entry, instances) == ("same", "")
    assert measure({**entry, "parameters": [["low", "0.0"], ["high", "2.0"]]}, instances)[0] == \
        "other defaults"
    assert measure({**entry, "parameters": [["high", "1.0"]]}, instances)[0] == "other arguments"
    assert measure({**entry, "name": "make_fancy_initializer"}, instances) == ("missing", "")


def test_the_optimizer_wrapper_has_the_framework_base_members():
    """Members OneFlow's Optimizer takes from flow.optim.Optimizer (outside one_embedding.py)."""
    instances = _instances()
    try:
        opt = instances["Optimizer"]
        for member in ("step", "zero_grad", "state_dict", "load_state_dict", "param_groups"):
            assert hasattr(opt, member), member
        assert opt.step(lambda: 3.0) == 3.0
    finally:
        for name in EMBEDDINGS:
            instances[name].close()


def test_oneflow_attribute_names_and_to():
    assert oe.PersistentTableReader is oe.table_io.PersistentTableReader
    assert oe.PersistentTableWriter is oe.table_io.PersistentTableWriter
    tables = [oe.make_table_options(oe.make_normal_initializer(0, 0.1)) for _ in range(3)]
    with oe.MultiTableEmbedding("sparse", 8, np.float32, np.int64, tables,
                                oe.make_device_mem_store_options(None, 10, size_factor=2)) as emb:
        assert (emb.embedding_name, emb.num_tables, emb.storage_dim) == ("sparse", 3, 16)
        assert emb.to("cpu") is emb
        with pytest.raises(oe.ConfigError, match="build it with device='cuda:0'"):
            emb.to("cuda:0")


if __name__ == "__main__":
    text = PAGE.read_text()
    block = page_block()
    if not block:
        sys.exit(f"docs/oneflow.md has no block between {START!r} and {END!r}")
    PAGE.write_text(text.replace(block, render(measure_all())))
    print("docs/oneflow.md names table rewritten")
