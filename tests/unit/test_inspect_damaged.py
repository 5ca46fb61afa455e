"""``one-embedding inspect`` on a path where one snapshot is damaged: the others are still shown."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.inspect_snapshot import inspect_path

import helpers

ROOT = helpers.ROOT


def table(path, engine):
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 oe.make_cached_ssd_store_options(0.001, str(path), engine=engine))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    emb.backward(np.ones_like(emb(np.arange(200))))
    opt.step()
    for name in ("a", "b", "c"):
        emb.save_snapshot(name)
    emb.close()
    return path / "0-1" / "snapshots"


def damage(snaps, how):
    if how == "manifest_garbage":
        (snaps / "b" / "manifest.json").write_bytes(b"\x00\xff" * 40)
    elif how == "manifest_edited":  # valid JSON: only the manifest's own checksum can tell
        m = json.loads((snaps / "b" / "manifest.json").read_text())
        m["row_count"] += 1
        (snaps / "b" / "manifest.json").write_text(json.dumps(m))
    elif how == "manifest_deleted":
        (snaps / "b" / "manifest.json").unlink()
    else:  # a file of b's own flipped (not one it shares with a and c: see the test below)
        shared = {k for k, v in json.loads((snaps / "b" / "manifest.json").read_text())["files"]
                  .items() if v.get("shared")}
        f = next(p for p in sorted((snaps / "b").rglob("*"))
                 if p.is_file() and p.name not in ("manifest.json",) and p.stat().st_size > 64
                 and str(p.relative_to(snaps / "b")) not in shared)
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
@pytest.mark.parametrize("how", ["manifest_garbage", "manifest_edited", "manifest_deleted",
                                 "data_flipped"])
def test_inspect_lists_intact_snapshots_and_reports_the_damaged_one(tmp_path, engine, how):
    damage(table(tmp_path, engine), how)
    found = {s["snapshot"]: s for s in inspect_path(str(tmp_path), rows=2)}
    assert sorted(found) == ["a", "b", "c"]
    assert found["b"]["status"] == "damaged" and "snapshot 'b'" in found["b"]["error"]
    if how.startswith("manifest"):
        assert "manifest.json" in found["b"]["error"]
    for ok in ("a", "c"):
        assert found[ok]["status"] == "ok" and found[ok]["row_count"] == 200
        assert len(found[ok]["rows"]) == 2


def test_inspect_command_prints_all_and_exits_1_naming_the_damage(tmp_path):
    damage(table(tmp_path, "slots"), "manifest_garbage")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "one_embedding", "inspect", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    listed = json.loads(r.stdout)
    assert [(s["snapshot"], s["status"]) for s in listed] == [("a", "ok"), ("b", "damaged"),
                                                              ("c", "ok")]
    assert "one-embedding inspect: damaged: snapshot 'b'" in r.stderr
    assert "manifest.json" in r.stderr and "Traceback" not in r.stderr
    # one named damaged snapshot: reported the same way; a missing name stays a usage error
    one = subprocess.run([sys.executable, "-m", "one_embedding", "inspect", str(tmp_path),
                          "--name", "b", "--json"], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert one.returncode == 1 and json.loads(one.stdout)[0]["status"] == "damaged"
    missing = subprocess.run([sys.executable, "-m", "one_embedding", "inspect", str(tmp_path),
                              "--name", "zz"], capture_output=True, text=True, timeout=120,
                             env=env, cwd=ROOT)
    assert missing.returncode == 2 and "no snapshot named 'zz'" in missing.stderr


def test_inspect_leaves_unfinished_folders_alone(tmp_path):
    snaps = table(tmp_path, "slots")
    os.mkdir(snaps / ".tmp-d-0123")
    found = inspect_path(str(tmp_path), rows=1)
    assert [s["snapshot"] for s in found] == ["a", "b", "c"]
    assert all(s["status"] == "ok" for s in found)


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_damage_in_data_that_snapshots_share_is_reported_in_each_of_them(tmp_path, engine):
    """a, b and c were saved with nothing changed in between, so they refer to the same rows on
    disk (shared segments or hard-linked SSTs): one flipped byte there damages all three."""
    snaps = table(tmp_path, engine)
    if engine == "slots":
        layout = json.loads((snaps / "b" / "slots.json").read_text())
        pool = snaps / "b" / layout["pool"]
        target = pool / f"{layout['segments'][0]['id']:016x}.rows"
    else:
        target = next((snaps / "b" / "db").glob("*.sst"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    found = {s["snapshot"]: s for s in inspect_path(str(tmp_path), rows=2)}
    assert all(found[n]["status"] == "damaged" for n in "abc")
    assert all(target.name in found[n]["error"] for n in "abc")


def test_inspect_prints_one_line_per_snapshot_by_default(tmp_path):
    """issue 31: a human summary by default (it printed hundreds of lines of JSON): one line per
    snapshot with its status, rows and sizes, the damage named under the table, and what a line
    and the RAM per key hold; --json keeps the full record."""
    damage(table(tmp_path, "slots"), "manifest_garbage")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "one_embedding", "inspect", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{tmp_path / '0-1'}: 3 snapshots"
    assert lines[1].split()[:4] == ["snapshot", "status", "rows", "on"]
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert rows["a"][1:3] == ["ok", "200"] and rows["c"][1:3] == ["ok", "200"]
    assert rows["b"][1] == "damaged" and "ssd.slots" in rows["a"]
    assert any(line.startswith("  b: snapshot 'b'") for line in lines)  # the reason
    assert "A key's line: 4 floats (16 B)." in r.stdout  # SGD: the embedding alone
    assert "RAM/key: the training store's memory" in r.stdout
    assert len(lines) < 15 and "{" not in r.stdout
