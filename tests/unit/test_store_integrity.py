"""The slot engine's integrity: block checksums that see every flipped bit, snapshots of the
earlier checksum still loading, a segment file cut short by another process (an error naming it,
never SIGBUS), and a seal that failed half-way and was retried recording the right CRC32."""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.config import TrainConfig
from one_embedding.errors import SnapshotError, StoreError
from one_embedding.serving import Predictor
from one_embedding.store import segments
from one_embedding.store.segments import (BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM,
                                          block_checksums)
from one_embedding.store.slot_file import SlotFileStore
from one_embedding.store.snapshots import SnapshotDirectory
from one_embedding.training import train

import helpers
from helpers import TierProbe

BLOCK = 4096
#: a format-2 snapshot (the hand-made block checksum) written by main 4489fa1; see
#: ``test_a_snapshot_of_the_earlier_checksum_loads_and_is_still_checked``
FORMAT2 = helpers.TESTS / "data" / "slots_format2"


def lines_for(keys, line_size, salt=0.0):
    """A line that encodes its key, so a row read back from the wrong slot is caught."""
    k = (np.asarray(keys, np.uint64) % np.uint64(1 << 20)).astype(np.float64)[:, None]
    return (k * 0.001 + np.arange(line_size) + salt).astype(np.float32)


def snapshot(store, name="snap"):
    snaps = SnapshotDirectory(store.directory)
    snaps.save(name, store.save_snapshot, {})
    return snaps.path(name)


def flip(path, byte, bit):
    with open(path, "r+b") as f:
        f.seek(byte)
        b = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([b ^ (1 << bit)]))


def misses(algorithm, block, variants):
    """How many of ``variants`` (m, BLOCK) uint8, each ``block`` with some bits flipped, get the
    checksum of ``block`` under ``algorithm``."""
    want = block_checksums(block[None], algorithm)[0]
    n = 0
    for c in range(0, variants.shape[0], 1024):
        n += int((block_checksums(variants[c:c + 1024], algorithm) == want).sum())
    return n


def single_flips(block, bits):
    """``block`` with each bit of ``bits`` (m,) flipped, one per row: (m, BLOCK) uint8."""
    out = np.repeat(block[None], bits.shape[0], axis=0)
    out[np.arange(bits.shape[0]), bits // 8] ^= (1 << (bits % 8)).astype(np.uint8)
    return out


def test_block_checksum_sees_every_single_bit_flip_and_burst_of_a_4k_block():
    rng = np.random.default_rng(0)
    rows = lines_for(rng.integers(0, 2**63, 32, dtype=np.uint64), 32)  # 32 float rows: 4 KiB
    for block in (rows.view(np.uint8).reshape(-1), np.zeros(BLOCK, np.uint8),
                  rng.integers(0, 256, BLOCK, dtype=np.uint8)):
        assert block.shape == (BLOCK,)
        n_missed = 0
        for c in range(0, 8 * BLOCK, 4096):  # all 32,768 single-bit flips, in slices
            n_missed += misses(BLOCK_CHECKSUM, block, single_flips(block, np.arange(c, c + 4096)))
        assert n_missed == 0
        # bursts of 2..64 bits: every bit of [start, start + length) flipped, and random patterns
        # over that span with its first and last bit flipped; starts random and at the bit that
        # the hand-made checksum lost (bit 41 of each word), so bursts cross word boundaries
        for length in range(2, 65):
            starts = np.concatenate([rng.integers(0, 8 * BLOCK - length, 96),
                                     np.arange(41, 8 * BLOCK - length, 64 * 37)])
            variants = np.repeat(block[None], 2 * starts.shape[0], axis=0)
            for i, s in enumerate(starts.tolist()):
                pattern = np.ones(length, bool)
                bits = s + np.flatnonzero(pattern)
                np.bitwise_xor.at(variants[2 * i], bits // 8, (1 << (bits % 8)).astype(np.uint8))
                pattern[1:-1] = rng.random(length - 2) < 0.5
                bits = s + np.flatnonzero(pattern)
                np.bitwise_xor.at(variants[2 * i + 1], bits // 8,
                                  (1 << (bits % 8)).astype(np.uint8))
            assert misses(BLOCK_CHECKSUM, block, variants) == 0, length
    # the same harness run on the hand-made checksum (kept to verify format-2 snapshots) finds
    # the flips it missed: bits 41-63 of every fourth 64-bit word
    block = rows.view(np.uint8).reshape(-1)
    lost = [misses(LEGACY_BLOCK_CHECKSUM, block, single_flips(block, np.arange(c, c + 4096)))
            for c in range(0, 8 * BLOCK, 4096)]
    assert sum(lost) == 2944  # 9.0 % of the 32,768 (issue 29)


def one_step_table(path, ids=200):
    """A cached_ssd slots table trained one step over ``ids`` ids, saved as snapshot 's'."""
    opts = oe.make_cached_ssd_store_options(0.001, str(path), engine="slots", size_factor=2)
    emb = oe.MultiTableEmbedding("t", 8, np.float32, np.int64, None, opts, seed=1)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    emb.backward(np.ones_like(emb(np.arange(ids))))
    opt.step()
    emb.save_snapshot("s")
    return emb


def rows_files(snap):
    layout = json.loads((snap / "slots.json").read_text())
    assert layout["format"] == 3
    assert {s["block_checksum"] for s in layout["segments"]} == {BLOCK_CHECKSUM}
    return [os.path.normpath(snap / layout["pool"] / f"{s['id']:016x}.rows")
            for s in layout["segments"]]


def test_a_flipped_bit_in_a_snapshots_rows_is_refused_at_the_first_read_naming_the_file(tmp_path):
    emb = one_step_table(tmp_path)
    keys, lines = emb.export()
    files = rows_files(tmp_path / "0-1" / "snapshots" / "s")
    rng = np.random.default_rng(3)
    # bit 7 of byte 22 (the example, unseen before), then one random bit in every block
    # of every rows file: all the blocks hold rows of the table, so each is read by export
    flips = [(files[0], 22, 7)] + [(f, BLOCK * b + int(rng.integers(0, BLOCK)),
                                    int(rng.integers(0, 8)))
                                   for f in files for b in range(os.path.getsize(f) // BLOCK)]
    assert len(flips) >= 3
    for path, byte, bit in flips:
        flip(path, byte, bit)
        emb.load_snapshot("s")  # sizes and key checksums: intact
        with pytest.raises(StoreError, match=re.escape(f"'{path}' fails its checksum")):
            emb.export()
        flip(path, byte, bit)  # put it back: the snapshot reads whole again
        emb.load_snapshot("s")
        got = emb.export()
        np.testing.assert_array_equal(got[0], keys)
        np.testing.assert_array_equal(got[1], lines)
    emb.close()


def test_a_flipped_bit_in_a_served_snapshots_rows_is_refused_naming_the_runs_file(tmp_path):
    path = tmp_path / "run"
    cfg = TrainConfig(steps=2, batch_size=64, synthetic_rows=2000, store="cached_ssd",
                      engine="slots", cache_mb=0.1, persistent_path=str(path), eval_batches=1)
    train(cfg, metrics_path=os.devnull, progress=False)
    with oe.make_persistent_table_reader([str(path / "0-1")], "final", np.int64, np.float32,
                                         2 * cfg.embedding_dim) as reader:
        keys, lines = map(np.concatenate, zip(*reader))
    files = rows_files(path / "0-1" / "snapshots" / "final")
    flip(files[0], 22, 7)
    with Predictor(path, cache_mb=0.01) as p:  # opening checks sizes and key checksums
        # (SnapshotError is a StoreError: the server may report it as either)
        with pytest.raises(StoreError, match=re.escape(files[0]) + ".*checksum"):
            p.lookup(keys)
    flip(files[0], 22, 7)
    with Predictor(path, cache_mb=0.01) as p:
        np.testing.assert_array_equal(p.lookup(keys), lines[:, :cfg.embedding_dim])


def format2_rows():
    """What snapshot 'b' of FORMAT2 holds: keys 977 * (11..500), those above 977 * 200 written
    again with salt 7 (keys 977 * (1..10) erased); line_size 4."""
    keys = np.arange(11, 501, dtype=np.uint64) * np.uint64(977)
    again = keys > 200 * 977
    return keys, np.where(again[:, None], lines_for(keys, 4, 7.0), lines_for(keys, 4))


def test_a_snapshot_of_the_earlier_checksum_loads_and_is_still_checked(tmp_path):
    """FORMAT2 was written by main 4489fa1 (``SlotFileStore(4, d, segment_rows=1024)``: 300 keys,
    snapshot 'a', 300 more keys (100 of them again), 10 erased, snapshot 'b')."""
    shutil.copytree(FORMAT2, tmp_path / "p")
    layout = json.loads((tmp_path / "p" / "snapshots" / "b" / "slots.json").read_text())
    assert layout["format"] == 2 and "block_checksum" not in layout["segments"][0]
    store = TierProbe(SlotFileStore(4, str(tmp_path / "p")))
    snaps = SnapshotDirectory(str(tmp_path / "p"))
    keys, lines = format2_rows()
    store.verify_snapshot(snaps.path("b"), full=True)
    store.load_snapshot(snaps.path("b"))
    assert len(store) == 490
    found, got = store.find(keys)
    assert found.all()
    np.testing.assert_array_equal(got, lines)
    # its blocks are checked with the checksum they were written with: a flip it sees is refused
    rows = tmp_path / "p" / "slots" / "segments" / "0000000000000002.rows"
    flip(rows, 4096 + 8, 0)  # block 1 holds keys 977 * (457..500)
    store.load_snapshot(snaps.path("b"))
    with pytest.raises(StoreError, match=re.escape(f"block 1 of '{rows}' fails its checksum")):
        store.find(keys)
    flip(rows, 4096 + 8, 0)
    # trained on and saved again: new segments take XXH3, the old ones keep theirs
    store.load_snapshot(snaps.path("b"))
    more = np.arange(1000, 1300, dtype=np.uint64)
    store.insert_or_assign(more, lines_for(more, 4, 3.0))
    snaps.save("c", store.save_snapshot, {})
    saved = json.loads((tmp_path / "p" / "snapshots" / "c" / "slots.json").read_text())
    assert saved["format"] == 3
    assert [s["block_checksum"] for s in saved["segments"]] == \
        [LEGACY_BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM, BLOCK_CHECKSUM]
    store.close()
    reopened = TierProbe(SlotFileStore(4, str(tmp_path / "p")))
    reopened.verify_snapshot(snaps.path("c"), full=True)
    reopened.load_snapshot(snaps.path("c"))
    found, got = reopened.find(np.concatenate([keys, more]))
    assert found.all()
    np.testing.assert_array_equal(got, np.concatenate([lines, lines_for(more, 4, 3.0)]))
    reopened.load_snapshot(snaps.path("a"))  # the older one, untouched
    assert len(reopened) == 300
    reopened.close()


def test_a_segment_entry_of_an_unknown_checksum_is_refused_naming_it(tmp_path):
    store = SlotFileStore(4, str(tmp_path))
    keys = np.arange(50, dtype=np.uint64)
    store.insert_or_assign(keys, lines_for(keys, 4))
    snap = snapshot(store)
    layout = json.loads(open(os.path.join(snap, "slots.json")).read())
    layout["segments"][0]["block_checksum"] = "sha7"
    with open(os.path.join(snap, "slots.json"), "w") as f:
        json.dump(layout, f)
    with pytest.raises(SnapshotError, match="'sha7'"):
        store.load_snapshot(snap)
    store.close()


# ---------------------------------------------------------------- files cut short under a store
TRUNCATE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from one_embedding.errors import StoreError
    from one_embedding.store.slot_file import SlotFileStore
    from one_embedding.store.snapshots import SnapshotDirectory

    kind, active = sys.argv[2], sys.argv[3] == "active"
    store = SlotFileStore(8, sys.argv[1], segment_rows=4096)
    keys = np.arange(1, 3001, dtype=np.uint64) * np.uint64(7919)
    store.insert_or_assign(keys, np.ones((3000, 8), np.float32))
    if not active:
        SnapshotDirectory(sys.argv[1]).save("s", store.save_snapshot, {})
    seg = max(store._segments.values(), key=lambda s: s.id)
    path = store.pool.path(seg.id, kind)
    os.truncate(path, 4096 if kind == "rows" else 16)
    try:
        store.find(keys, np.empty((3000, 8), np.float32), np.arange(3000))
    except StoreError as e:
        print("REFUSED", e)
        sys.exit(0)
    print("READ WITHOUT ERROR")
    sys.exit(1)
""")


@pytest.mark.parametrize("kind,state", [("rows", "sealed"), ("keys", "sealed"), ("sums", "sealed"),
                                        ("rows", "active"), ("keys", "active")])
def test_a_segment_file_truncated_under_an_open_store_is_an_error_naming_it(tmp_path, kind, state):
    """Another process cuts a segment file while the store has it open (and mapped): the read
    raises StoreError naming the file. Run in a child process, so a SIGBUS fails the test."""
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", TRUNCATE, str(tmp_path / "p"), kind, state],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])  # -7: SIGBUS
    assert "REFUSED" in r.stdout and f".{kind}'" in r.stdout and "shorter" in r.stdout, r.stdout


# ---------------------------------------------------------------- a seal that failed, retried
def test_a_seal_retried_after_disk_full_records_the_rows_crc_of_what_it_wrote(tmp_path,
                                                                              monkeypatch):
    store = TierProbe(SlotFileStore(8, str(tmp_path)))
    keys = np.arange(1, 301, dtype=np.uint64)  # 300 rows of 32 B: the last block partly filled
    store.insert_or_assign(keys, lines_for(keys, 8))
    real, calls = segments._write_synced, []

    def full_once(path, data):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(segments, "_write_synced", full_once)
    snaps = SnapshotDirectory(str(tmp_path))
    with pytest.raises(StoreError, match="No space left"):
        snaps.save("s", store.save_snapshot, {})
    snaps.save("s", store.save_snapshot, {})  # space again: the same seal, retried
    assert len(calls) == 2
    store.verify_snapshot(snaps.path("s"), full=True)  # every row block against its CRC32
    store.load_snapshot(snaps.path("s"))
    found, got = store.find(keys)
    assert found.all()
    np.testing.assert_array_equal(got, lines_for(keys, 8))
    store.close()
