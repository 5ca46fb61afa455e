"""The manifest guards the whole snapshot: its own checksum, and every file below the folder."""
import json
import os

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.store.snapshots import SnapshotDirectory


def trained(path, engine="rocksdb"):
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 oe.make_cached_ssd_store_options(0.001, str(path), engine=engine))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    emb.backward(np.ones_like(emb(np.arange(300))))
    opt.step()
    emb.save_snapshot("a")
    emb.save_snapshot("b")
    return emb


def snapshot_dir(path, name):
    return path / "0-1" / "snapshots" / name


@pytest.mark.parametrize("damage", ["truncate", "garbage", "edit"])
def test_a_damaged_manifest_is_refused_naming_the_file(tmp_path, damage):
    emb = trained(tmp_path)
    manifest = snapshot_dir(tmp_path, "a") / "manifest.json"
    text = manifest.read_text()
    if damage == "truncate":
        manifest.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        manifest.write_bytes(b"\x00\xff" * 40)
    else:  # valid JSON, one value changed: only the manifest's own checksum can tell
        m = json.loads(text)
        m["row_count"] += 1
        manifest.write_text(json.dumps(m))
    with pytest.raises(oe.SnapshotError, match=r"snapshot 'a'.*manifest\.json.*damaged"):
        emb.load_snapshot("a")
    emb.load_snapshot("b")  # the others are unaffected
    emb.close()


def test_every_file_below_the_snapshot_is_checked(tmp_path):
    emb = trained(tmp_path)
    folder = snapshot_dir(tmp_path, "a")
    m = json.loads((folder / "manifest.json").read_text())
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(m["files"]) == on_disk
    # the SSTs are shared (hard links): recorded with their CRC32, checked by size at load
    ssts = [name for name in m["files"] if name.startswith("db/") and name.endswith(".sst")]
    assert ssts and all(m["files"][name].get("shared") for name in ssts)
    own = next(name for name in m["files"] if not m["files"][name].get("shared")
               and name.startswith("db/MANIFEST"))
    data = bytearray((folder / own).read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / own).write_bytes(bytes(data))
    with pytest.raises(oe.SnapshotError, match=r"MANIFEST.*checksum"):
        emb.load_snapshot("a")
    emb.close()


def test_a_flipped_byte_in_a_shared_file_is_found_by_a_full_check(tmp_path):
    """Reading every shared byte at each load would cost the table; a full check (what
    ``one-embedding inspect`` does) reads them, and names the file."""
    emb = trained(tmp_path)
    emb.close()
    snaps = SnapshotDirectory(str(tmp_path / "0-1"), create=False)
    m = json.loads((snapshot_dir(tmp_path, "a") / "manifest.json").read_text())
    sst = snapshot_dir(tmp_path, "a") / next(n for n in m["files"] if n.endswith(".sst"))
    data = bytearray(sst.read_bytes())
    data[len(data) // 2] ^= 0x01
    sst.write_bytes(bytes(data))
    snaps.open("a", {}, verify=True)  # sizes only for shared files
    with pytest.raises(oe.SnapshotError, match=r"\.sst.*checksum"):
        snaps.open("a", {}, verify="full")


@pytest.mark.parametrize("saved,loaded", [("slots", "rocksdb"), ("rocksdb", "slots"),
                                          ("slots", "memory")])
def test_a_snapshot_of_another_engine_loads_row_by_row(tmp_path, saved, loaded):
    emb = trained(tmp_path, engine=saved)
    want = emb.export()
    emb.close()
    if loaded == "memory":
        opts = oe.make_device_mem_store_options(str(tmp_path), 1000)
    else:
        opts = oe.make_cached_ssd_store_options(0.001, str(tmp_path), engine=loaded)
    other = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, opts)
    other.load_snapshot("a")
    got = other.export()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    other.close()
