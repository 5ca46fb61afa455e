"""kill -9 at random moments, some inside save_snapshot (at a chosen fsync, rename or link of it),
some during delete_snapshot and garbage collection: the path reopens to the last snapshot.

A worker process trains a cached_ssd embedding and saves snapshot "ckpt" every few steps. Before
each save it records the SHA-256 of the table it is about to save ("pending") in a side file, and
after ``save_snapshot`` returns it records that hash as "done". After each SIGKILL the test opens
the path (which runs the snapshot recovery), loads "ckpt" and requires its hash to be the last
"done" one, or the "pending" one when the kill fell after the publishing rename but before
``save_snapshot`` returned. Anything else (a half-written or older state) fails. The test then
records the hash it found as the state the next run starts from.
"""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import one_embedding as oe

import helpers

ROOT = str(helpers.ROOT)

WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    import one_embedding as oe

    path, engine, side, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    opts = oe.make_cached_ssd_store_options(0.25, path, engine=engine, size_factor=2,
                                            host_cache_budget_mb=0.5)
    emb = oe.MultiTableEmbedding("c", 8, np.float32, np.int64, None, opts, seed=1)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    if "ckpt" in emb.snapshot_names():
        emb.load_snapshot("ckpt")
    state = {"done": None, "pending": None, "phase": "train"}
    if os.path.exists(side):
        with open(side) as f:
            state = json.load(f)

    def record():
        state["run"] = seed
        with open(side + ".tmp", "w") as f:
            json.dump(state, f)
        real["replace"](side + ".tmp", side)

    # kill_at > 0: SIGKILL this process at the kill_at-th durability step (fsync, fdatasync,
    # rename, replace, link) inside save_snapshot, so kills land inside saves however fast
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "rename", "replace", "link")}
    calls = [0]

    def counted(name):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), 9)
            return real[name](*args, **kwargs)
        return call

    rng = np.random.default_rng(seed)
    step = 0
    while True:
        ids = rng.integers(0, 40000, size=(2048, 2))
        out = emb(ids)
        emb.backward(rng.standard_normal(out.shape).astype(np.float32))
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 2 == 0:
            keys, lines = emb.export()
            state["pending"] = hashlib.sha256(keys.tobytes() + lines.tobytes()).hexdigest()
            state["phase"] = "saving"
            record()
            if kill_at:
                for name in real:
                    setattr(os, name, counted(name))
            emb.save_snapshot("ckpt")
            for name in real:
                setattr(os, name, real[name])
            state["done"], state["pending"], state["phase"] = state["pending"], None, "train"
            record()
    """
)


def read_side(side):
    with open(side) as f:
        return json.load(f)


def wait_for(predicate, timeout=90.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def saved_hash(path, engine):
    opts = oe.make_cached_ssd_store_options(0.25, path, engine=engine, size_factor=2,
                                            host_cache_budget_mb=0.5)
    emb = oe.MultiTableEmbedding("c", 8, np.float32, np.int64, None, opts, seed=1)
    try:
        assert not [e for e in os.listdir(os.path.join(path, "0-1", "snapshots")) if e.startswith(".")]
        if "ckpt" not in emb.snapshot_names():
            return None
        emb.load_snapshot("ckpt")
        keys, lines = emb.export()
        return hashlib.sha256(keys.tobytes() + lines.tobytes()).hexdigest()
    finally:
        emb.close()


def kill_loop(tmp_path, engines, kills, seed):
    rnd = random.Random(seed)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    during_save = verified = 0
    for i in range(kills):
        engine = engines[i % len(engines)]
        path, side = str(tmp_path / engine), str(tmp_path / f"{engine}.json")
        inside_save = (i // len(engines)) % 2 == 0
        kill_at = rnd.randint(1, 25) if inside_save else 0
        proc = subprocess.Popen([sys.executable, str(worker), path, engine, side, str(i),
                                 str(kill_at)], env=env)
        try:
            def this_run(phase=None):
                if not os.path.exists(side):
                    return False
                st = read_side(side)
                return st.get("run") == i and (phase is None or st["phase"] == phase)

            if inside_save:  # the worker kills itself at a durability step of a save
                proc.wait(timeout=300)
                assert proc.returncode == -signal.SIGKILL, f"worker exited with {proc.returncode}"
                at_kill = read_side(side)
            else:  # kill anywhere once this run has trained a step
                assert wait_for(lambda: proc.poll() is not None or this_run())
                time.sleep(rnd.uniform(0.0, 1.0))
                assert proc.poll() is None, f"worker exited with {proc.returncode}"
                at_kill = read_side(side)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        state = read_side(side)  # re-read: the worker may have advanced after at_kill
        during_save += at_kill["phase"] == "saving"
        if state["done"] is None and state["pending"] is None:
            continue
        got = saved_hash(path, engine)
        # no snapshot (None) is right only while the first save had not completed
        allowed = {state["done"]} | ({state["pending"]} if state["phase"] == "saving" else set())
        assert got in allowed, (f"kill {i} ({engine}): the snapshot is neither the last saved "
                                "nor the one in flight")
        verified += 1
        # what is on disk now is the last completed snapshot the next run starts from
        with open(side, "w") as f:
            json.dump({"done": got, "pending": None, "phase": "train", "run": None}, f)
    return during_save, verified


def test_kill9_reopens_to_last_snapshot(tmp_path):
    during_save, verified = kill_loop(tmp_path, ["slots"], kills=2, seed=1)
    assert verified == 2


@pytest.mark.slow
def test_kill9_twelve_times_both_engines(tmp_path):
    during_save, verified = kill_loop(tmp_path, ["slots", "rocksdb"], kills=12, seed=7)
    assert verified == 12
    assert during_save >= 3


# ---------------------------------------------------------------- kills during delete and GC
GC_WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    import one_embedding as oe

    path, engine, side, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    kill_after, before = int(sys.argv[5]), sys.argv[6] == "before"
    opts = oe.make_cached_ssd_store_options(0.25, path, engine=engine, size_factor=2)
    emb = oe.MultiTableEmbedding("c", 8, np.float32, np.int64, None, opts, seed=1)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    state = {"hashes": {}, "n": 0, "phase": "train", "target": []}

    # kill -9 this process at the kill_after-th file removal of a delete_snapshot (the rename,
    # the reap of the folder, the garbage collection of segments), before or after it
    unlinks, real_unlink = [0], os.unlink

    def unlink_then_maybe_die(*args, **kwargs):
        unlinks[0] += 1
        if unlinks[0] == kill_after and before:
            os.kill(os.getpid(), 9)
        try:
            real_unlink(*args, **kwargs)
        finally:  # (a file already gone raises, and is a removal all the same)
            if unlinks[0] == kill_after:
                os.kill(os.getpid(), 9)
    if os.path.exists(side):
        with open(side) as f:
            state = json.load(f)
    names = sorted(emb.snapshot_names(), key=lambda s: int(s[1:]))
    if names:
        emb.load_snapshot(names[-1])

    def record(phase, target):
        state.update(phase=phase, target=target, run=seed)
        with open(side + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(side + ".tmp", side)

    rng = np.random.default_rng(seed)
    while True:
        ids = rng.integers(0, 40000, size=(4096, 2))
        out = emb(ids)
        emb.backward(rng.standard_normal(out.shape).astype(np.float32))
        opt.step()
        opt.zero_grad()
        state["n"] += 1
        name = f"s{state['n']}"
        keys, lines = emb.export()
        state["hashes"][name] = hashlib.sha256(keys.tobytes() + lines.tobytes()).hexdigest()
        record("saving", [name])
        emb.save_snapshot(name)
        names = sorted(emb.snapshot_names(), key=lambda s: int(s[1:]))
        record("deleting", names[:-2])
        os.unlink = unlink_then_maybe_die
        for doomed in names[:-2]:  # each delete ends in a garbage collection
            emb.delete_snapshot(doomed)
        os.unlink = real_unlink
        record("train", [])
    """
)


def referenced_segments(rank_folder):
    ids = set()
    snaps = os.path.join(rank_folder, "snapshots")
    for entry in os.listdir(snaps):
        layout = os.path.join(snaps, entry, "slots.json")
        if os.path.isfile(layout):
            with open(layout) as f:
                ids |= {s["id"] for s in json.load(f)["segments"]}
    return ids


def check_after_kill(path, engine, state):
    """Reopen (recovery + garbage collection) and load every snapshot: each is exactly what was
    saved under its name; only a snapshot being saved may be missing, only ones being deleted
    may be gone; no segment is left that nothing refers to."""
    opts = oe.make_cached_ssd_store_options(0.25, path, engine=engine, size_factor=2)
    emb = oe.MultiTableEmbedding("c", 8, np.float32, np.int64, None, opts, seed=1)
    try:
        folder = os.path.join(path, "0-1")
        assert not [e for e in os.listdir(os.path.join(folder, "snapshots")) if e.startswith(".")]
        present = set(emb.snapshot_names())
        saved = set(state["hashes"])
        in_flight = set(state["target"]) if state["phase"] in ("saving", "deleting") else set()
        assert present <= saved, present - saved
        for name in present:
            emb.load_snapshot(name)
            keys, lines = emb.export()
            digest = hashlib.sha256(keys.tobytes() + lines.tobytes()).hexdigest()
            assert digest == state["hashes"][name], f"{name} is not what was saved under it"
        newest = sorted(saved, key=lambda s: int(s[1:]))[-2:]
        missing = set(newest) - present
        assert missing <= in_flight, f"{missing} vanished without being deleted or saved"
        if engine == "slots":
            pool = os.path.join(folder, "slots", "segments")
            on_disk = {int(f[:16], 16) for f in os.listdir(pool)}
            assert on_disk <= referenced_segments(folder), "garbage left after the reopen"
    finally:
        emb.close()


def gc_kill_loop(tmp_path, engines, kills, seed):
    """Each run kills itself with SIGKILL at a random file removal inside delete_snapshot (the
    reap of the folder or the garbage collection after it); the path must then reopen cleanly."""
    rnd = random.Random(seed)
    worker = tmp_path / "gc_worker.py"
    worker.write_text(GC_WORKER)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    phases = []
    for i in range(kills):
        engine = engines[i % len(engines)]
        path, side = str(tmp_path / engine), str(tmp_path / f"{engine}.json")
        when = rnd.choice(["before", "after"])
        proc = subprocess.Popen([sys.executable, str(worker), path, engine, side, str(i),
                                 str(rnd.randint(1, 40)), when], env=env)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"worker exited with {proc.returncode}"
        state = read_side(side)
        phases.append(state["phase"])
        check_after_kill(path, engine, state)
    return phases


def test_kill9_during_delete_snapshot_and_gc_reopens_cleanly(tmp_path):
    assert gc_kill_loop(tmp_path, ["slots"], kills=2, seed=3) == ["deleting"] * 2


@pytest.mark.slow
def test_kill9_during_delete_and_gc_ten_times_both_engines(tmp_path):
    assert gc_kill_loop(tmp_path, ["slots", "rocksdb"], kills=10, seed=11) == ["deleting"] * 10
