"""With admission and eviction on, training stays bit-identical across store presets, engines,
cache sizes and prefetch depths, and a resumed run continues bit for bit.

The stream brings new keys every step with heavy duplicates; the rules bite every few steps:
ids are admitted on their second step, rows expire 6 steps after their last use (a sweep every
2 steps), and the table is held to 150 rows (frequency halving every 4 steps), so prefetched
lookups regularly hold rows a sweep removes before they are used.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.pipeline import Prefetcher

E = 8
STEPS = 30
BATCH = 64
KEYS_SEEN = 40 + 25 * STEPS
LIFECYCLE = oe.make_lifecycle_options(admit_min_count=2, steps_to_live=6, evict_interval=2,
                                      max_rows=150, frequency_half_life=4, low_water=0.8)


def batches(seed=5):
    rng = np.random.default_rng(seed)
    for k in range(STEPS):
        ids = rng.zipf(1.3, size=(BATCH, 2)) % (40 + 25 * k)
        yield (ids * 7919 + 3).astype(np.int64)


def store(preset: str, path):
    sf, line = 3, 3 * E + 2  # Adam; the tiers hold the lifecycle's two columns too
    if preset == "device_mem":
        return oe.make_device_mem_store_options(str(path), capacity=KEYS_SEEN, size_factor=sf,
                                                lifecycle=LIFECYCLE)
    kind, engine, rows, *host = preset.split(":")
    mb = int(rows) * 4 * line / 2**20
    if kind == "host":
        return oe.make_cached_host_mem_store_options(mb, str(path), KEYS_SEEN, size_factor=sf,
                                                     cache_policy=engine, lifecycle=LIFECYCLE)
    host_mb = int(host[0]) * 4 * line / 2**20 if host else 0
    return oe.make_cached_ssd_store_options(mb, str(path), size_factor=sf, engine=engine,
                                            host_cache_budget_mb=host_mb, lifecycle=LIFECYCLE)


def train(preset, path, depth):
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, None, store(preset, path),
                                 default_initializer=oe.make_uniform_initializer(-0.1, 0.1), seed=3)
    opt = oe.Optimizer(oe.optim.Adam(lr=0.01), embeddings=[emb])
    grad_rng = np.random.default_rng(9)
    outputs = []
    with Prefetcher(batches(), emb, depth=depth, ids=lambda ids: ids) as prefetcher:
        for _, state in prefetcher:
            out = emb.embed(state)
            outputs.append(out.copy())
            emb.backward(grad_rng.standard_normal(out.shape).astype(np.float32))
            opt.step()
    keys, lines = emb.export()
    counters = {k: emb.store_stats()[-1][k]
                for k in ("admitted_rows", "not_admitted_lookups", "evicted_rows")}
    emb.close()
    return outputs, keys, lines, counters


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train("device_mem", tmp_path_factory.mktemp("ref"), 0)


def test_the_rules_bite(reference):
    _, keys, _, counters = reference
    assert counters["not_admitted_lookups"] > 100
    assert counters["evicted_rows"] > 100
    assert counters["admitted_rows"] - counters["evicted_rows"] == keys.shape[0] <= 150


@pytest.mark.parametrize("preset,depth", [
    ("device_mem", 2),
    ("host:lru:20", 0), ("host:lfu:60", 2), ("host:lru:20", 3),
    ("ssd:slots:10", 0), ("ssd:slots:10", 2), ("ssd:slots:30:60", 1),
    ("ssd:rocksdb:10", 0), ("ssd:rocksdb:20:40", 2),
])
def test_bit_identical_across_presets_and_prefetch(reference, preset, depth, tmp_path):
    want_out, want_keys, want_lines, want_counters = reference
    outputs, keys, lines, counters = train(preset, tmp_path, depth)
    for step, (got, want) in enumerate(zip(outputs, want_out)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {step + 1}")
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(lines, want_lines)
    assert counters == want_counters


# ---------------------------------------------------------------- resume through the CLI

RULES = ["--admit-min-count", "2", "--steps-to-live", "8", "--max-rows", "30000",
         "--frequency-half-life", "10"]
SMALL = ["--synthetic-rows", "40000", "--batch-size", "256", "--eval-interval", "20",
         "--eval-batches", "5", "--snapshot-interval", "10", "--no-progress", "--store",
         "cached_ssd", "--cache-mb", "0.5", *RULES]


def cli(path, metrics, *args):
    cmd = [sys.executable, "-m", "one_embedding", "train", *SMALL, "--persistent-path", str(path),
           "--metrics", str(metrics), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def results(metrics):
    out = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "train":
            out[("train", r["step"])] = r["loss"]
        elif r["event"] == "eval":
            out[("eval", r["step"])] = (r["auc"], r["logloss"])
        elif r["event"] == "final":
            out[("final", r["steps"])] = (r["auc"], r["logloss"], r["rows_stored"],
                                          r["admitted_rows"], r["not_admitted_lookups"],
                                          r["evicted_rows"])
    return out


def test_resume_with_admission_and_eviction_is_bit_identical(tmp_path):
    cli(tmp_path / "full", tmp_path / "full.jsonl", "--steps", 50)
    full = results(tmp_path / "full.jsonl")
    final = full[("final", 50)]
    assert final[4] > 0 and final[5] > 0, "admission and eviction both acted"
    cli(tmp_path / "run", tmp_path / "a.jsonl", "--steps", 25)
    cli(tmp_path / "run", tmp_path / "b.jsonl", "--steps", 50, "--resume")
    resumed = results(tmp_path / "b.jsonl")
    assert resumed == {k: v for k, v in full.items() if k[1] > 25}


def test_kill_during_admission_and_eviction_resumes_bit_identical(tmp_path):
    """kill -9 at an arbitrary moment of a run that admits and evicts every step (sweeps every
    step, the row limit biting): --resume still gives the uninterrupted run's every record."""
    import os
    import signal
    import time

    aggressive = ["--evict-interval", "1", "--max-rows", "3000", "--steps-to-live", "4"]
    cli(tmp_path / "full", tmp_path / "full.jsonl", "--steps", 40, *aggressive)
    full = results(tmp_path / "full.jsonl")
    path = tmp_path / "run"
    cmd = [sys.executable, "-m", "one_embedding", "train", *SMALL, "--persistent-path", str(path),
           "--metrics", str(tmp_path / "a.jsonl"), "--steps", "40", *aggressive]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    snaps = path / "0-1" / "snapshots"
    deadline = time.monotonic() + 300
    while not (snaps / "step-10" / "manifest.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # into the steps after it: lookups, sweeps, erases
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cli(path, tmp_path / "b.jsonl", "--steps", 40, "--resume", *aggressive)
    first = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[1])
    assert first["event"] == "resume"
    assert results(tmp_path / "b.jsonl") == {k: v for k, v in full.items() if k[1] > first["step"]}
