"""``one-embedding plan`` against stores built and measured: RAM per tier and disk within 10 %."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.plan import ROCKSDB_TABLE_READER_BYTES, plan_capacity
from one_embedding.store.rocksdb_store import tree_disk_bytes

import helpers

ROOT = str(helpers.ROOT)
ROWS, DIM, CACHE_MB = 200_000, 32, 4


def trained(path, engine, host_mb=0.0):
    opts = oe.make_cached_ssd_store_options(CACHE_MB, str(path), engine=engine, size_factor=3,
                                            host_cache_budget_mb=host_mb)
    emb = oe.MultiTableEmbedding("t", DIM, np.float32, np.int64, None, opts, seed=0)
    opt = oe.Optimizer(oe.optim.Adam(lr=1e-3), embeddings=[emb])
    for start in range(0, ROWS, 50_000):
        out = emb(np.arange(start, start + 50_000))
        emb.backward(np.full(out.shape, 0.01, np.float32))
        opt.step()
        opt.zero_grad()
    return emb, opt


def within(measured, planned, tol=0.10):
    return abs(measured - planned) <= tol * planned


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_plan_matches_a_measured_table(tmp_path, engine):
    emb, opt = trained(tmp_path, engine, host_mb=2.0)
    emb.save_snapshot("s0")
    plan = plan_capacity(ROWS, DIM, "adam", "cached_ssd", CACHE_MB, 2.0, engine,
                         keep_snapshots=3, changed_per_snapshot=0.01)
    stats = emb.store_stats()
    assert [s["tier"] for s in stats] == [t.tier for t in plan.tiers]
    for tier, measured in zip(plan.tiers[:2], stats[:2]):  # the caches: reserved bytes, exactly
        assert measured["memory_bytes"] == tier.ram_bytes, tier.tier
    ssd, planned = stats[-1], plan.tiers[-1]
    if engine == "slots":
        assert within(ssd["memory_bytes"], planned.ram_bytes), (ssd["memory_bytes"], planned)
    else:  # RocksDB's per-key RAM (its caches and write buffers are fixed budgets)
        readers = emb._owner()._chain.bottom._int_property("rocksdb.estimate-table-readers-mem",
                                                           both=True)
        assert within(readers, ROWS * ROCKSDB_TABLE_READER_BYTES), readers / ROWS
    disk = tree_disk_bytes(str(tmp_path))
    assert within(disk, plan.disk_live_bytes), (disk, plan.disk_live_bytes)
    # three retained snapshots of 1 %-changed tables stay under the planned peak
    rng = np.random.default_rng(0)
    names, worst = ["s0"], disk
    for r in range(1, 9):
        ids = rng.choice(ROWS, ROWS // 100, replace=False)
        out = emb(ids)
        emb.backward(np.full(out.shape, 0.01, np.float32))
        opt.step()
        opt.zero_grad()
        emb.save_snapshot(f"s{r}")
        names.append(f"s{r}")
        while len(names) > 3:
            emb.delete_snapshot(names.pop(0))
        worst = max(worst, tree_disk_bytes(str(tmp_path)))
    assert worst <= plan.disk_peak_bytes, (worst / disk, plan.disk_peak_bytes / disk)
    assert plan.disk_peak_bytes <= 2.0 * plan.disk_live_bytes
    emb.close()


def test_memory_presets_plan_the_full_table_and_a_copy_per_snapshot(tmp_path):
    opts = oe.make_device_mem_store_options(str(tmp_path), capacity=ROWS)
    emb = oe.MultiTableEmbedding("t", DIM, np.float32, np.int64, None, opts)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    out = emb(np.arange(ROWS))
    emb.backward(np.ones_like(out))
    opt.step()
    emb.save_snapshot("a")
    plan = plan_capacity(ROWS, DIM, "sgd", "device_mem", keep_snapshots=1)
    assert within(emb.store_stats()[0]["memory_bytes"], plan.tiers[0].ram_bytes)
    assert within(tree_disk_bytes(str(tmp_path)), plan.disk_peak_bytes)
    emb.close()


def test_plan_command_prints_a_table_or_json_and_refuses_bad_input():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "one_embedding", "plan", *args],
                              capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)

    r = run("--rows", "1e9", "--embedding-dim", "128", "--optimizer", "adam", "--store",
            "cached_ssd", "--cache-mb", "8192", "--keep-snapshots", "3")
    assert r.returncode == 0, r.stderr
    # --keep-snapshots as train's: 3 interval checkpoints and the final one
    assert "| ssd.slots | 1,000,000,000 |" in r.stdout and "peak with 4 retained" in r.stdout
    j = run("--rows", "2e6", "--embedding-dim", "32", "--optimizer", "adam", "--cache-mb", "16",
            "--engine", "rocksdb", "--json")
    plan = json.loads(j.stdout)
    assert plan["line_size"] == 96 and plan["tiers"][-1]["tier"] == "ssd.rocksdb"
    bad = run("--rows", "-5", "--embedding-dim", "8", "--cache-mb", "1")
    assert bad.returncode == 2 and "--rows" in bad.stderr and "Traceback" not in bad.stderr
    # issue 31: the message names the flag (it said "device.lru: 0.0 MB ...: raise it")
    no_cache = run("--rows", "10", "--embedding-dim", "8")
    assert no_cache.returncode == 2 and "give its size per rank with --cache-mb" in no_cache.stderr
    tiny = run("--rows", "10", "--embedding-dim", "8", "--cache-mb", "1e-6")
    assert tiny.returncode == 2 and "cache_mb=1e-06 (--cache-mb" in tiny.stderr
    assert run("--rows", "10", "--embedding-dim", "8", "--store", "device_mem").returncode == 0

    # the optimizers train takes, no other (momentum SGD has no train flag)
    momentum = run("--rows", "10", "--embedding-dim", "8", "--cache-mb", "1", "--optimizer",
                   "momentum")
    assert momentum.returncode == 2 and "invalid choice: 'momentum'" in momentum.stderr
    # a fault campaign's (2026-12-07): tracebacks (OverflowError, ValueError, ZeroDivisionError),
    # argparse's internal name, or a disk figure for a block size the store refuses
    for args, said in ((("--rows", "inf"), "'inf' must be a positive whole number of rows"),
                       (("--rows", "nan"), "'nan' must be a positive whole number of rows"),
                       (("--rows", "10", "--cache-mb", "nan"), "cache_mb=nan (--cache-mb)"),
                       (("--rows", "10", "--cache-mb", "1", "--host-cache-mb", "inf"),
                        "host_cache_mb=inf (--host-cache-mb)"),
                       (("--rows", "10", "--cache-mb", "1", "--physical-block-size", "0"),
                        "physical_block_size=0"),
                       (("--rows", "10", "--cache-mb", "1", "--physical-block-size", "1000"),
                        "must be a power of two in 512..65536")):
        r = run(*args, "--embedding-dim", "8")
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plan_counts_the_lifecycle_columns_and_the_admission_sketch():
    import numpy as np

    import one_embedding as oe
    from one_embedding.plan import plan_capacity

    plain = plan_capacity(10_000, 16, "adagrad", "device_mem")
    evicting = plan_capacity(10_000, 16, "adagrad", "device_mem", eviction=True, admit_sketch_mb=3)
    assert evicting.line_bytes == plain.line_bytes + 8
    sketch = [t for t in evicting.tiers if t.tier == "admission sketch"][0]
    rules = oe.make_lifecycle_options(admit_min_count=2, steps_to_live=5, sketch_mb=3)
    with oe.MultiTableEmbedding("t", 16, np.float32, np.int64, None,
                                oe.make_device_mem_store_options(None, 100, size_factor=2,
                                                                 lifecycle=rules)) as emb:
        assert sketch.ram_bytes == emb._shard._lifecycle.sketch.nbytes  # what it allocates
        assert emb._shard.layout.stored_size * 4 == evicting.line_bytes


def test_plan_refuses_a_slot_table_past_its_32_bit_locations_and_names_the_ranks():
    """A rank's slot directory holds 32-bit locations: 6e9 rows on one rank was planned without
    a word, and training would have stopped with a StoreError once the table grew there."""
    from one_embedding.errors import ConfigError

    with pytest.raises(ConfigError, match=r"6,000,000,000 rows per rank on the slot engine .* "
                                          r"at least 2 ranks \(--world 2; 1 now\)"):
        plan_capacity(6_000_000_000, 16, cache_mb=64)
    assert plan_capacity(6_000_000_000, 16, cache_mb=64, world=2).rows_per_rank == 3_000_000_000
    assert plan_capacity(6_000_000_000, 16, cache_mb=64, engine="rocksdb").rows_per_rank == \
        6_000_000_000


def test_plan_api_takes_numpy_integers_and_names_bad_types():
    from one_embedding.errors import ConfigError

    assert plan_capacity(np.int64(1000), np.int32(16), cache_mb=64).rows == 1000
    with pytest.raises(ConfigError, match=r"keep_snapshots=1.5 must be a whole number"):
        plan_capacity(1000, 16, cache_mb=64, keep_snapshots=1.5)
    with pytest.raises(ConfigError, match=r"cache_mb='64' \(--cache-mb\) must be a finite number"):
        plan_capacity(1000, 16, cache_mb="64")


def test_plan_refuses_what_train_refuses_and_keeps_snapshots_as_train_does(capsys):
    """A fault campaign's: settings of tiers the store lacks were ignored (train refuses them),
    and --keep-snapshots 0 planned the smallest disk for what keeps every checkpoint in train."""
    from one_embedding import cli

    base = ["plan", "--rows", "1e6", "--embedding-dim", "16"]
    for args, said in ((["--store", "device_mem", "--host-cache-mb", "100"],
                        "--host-cache-mb 100 is a setting of --store cached_ssd's SSD tier"),
                       (["--store", "cached_host_mem", "--cache-mb", "4", "--engine", "rocksdb"],
                        "--engine rocksdb is a setting of --store cached_ssd's SSD tier"),
                       (["--store", "device_mem", "--cache-mb", "64"],
                        "--cache-mb 64 sizes the device cache of the cached stores"),
                       (["--cache-mb", "4", "--keep-snapshots", "0"],
                        "as train's, 0 keeps every checkpoint")):
        assert cli.main(base + args) == 2
        assert said in capsys.readouterr().err
    assert cli.main(base + ["--cache-mb", "4"]) == 0
    assert "peak with 4 retained" in capsys.readouterr().out  # train's default 3, and the final
