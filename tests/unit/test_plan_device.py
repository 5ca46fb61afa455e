"""``one-embedding plan --device cuda`` against the device tiers built and filled on the CUDA
emulator (the tiers ``--device cuda`` training builds): GPU memory per tier, and RAM apart."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.plan import plan_capacity

import helpers

ROWS, DIM, CACHE_MB, HOST_MB = 20_000, 8, 0.25, 0.5


def _options(preset, path):
    if preset == "device_mem":
        return oe.make_device_mem_store_options(str(path), capacity=ROWS)
    if preset == "cached_host_mem":
        return oe.make_cached_host_mem_store_options(CACHE_MB, str(path), ROWS)
    return oe.make_cached_ssd_store_options(CACHE_MB, str(path), host_cache_budget_mb=HOST_MB)


@pytest.mark.parametrize("preset", ["device_mem", "cached_host_mem", "cached_ssd"])
def test_the_cuda_plan_is_what_the_device_tiers_reserve(launch, tmp_path, preset):
    emb = oe.MultiTableEmbedding("t", DIM, np.float32, np.int64, None,
                                 _options(preset, tmp_path), device=launch)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    for start in range(0, ROWS, 5_000):
        out = emb(np.arange(start, start + 5_000))
        emb.backward(np.ones_like(out))
        opt.step()
    stats = emb.store_stats()
    emb.close()
    plan = plan_capacity(ROWS, DIM, "sgd", preset, CACHE_MB,
                         HOST_MB if preset == "cached_ssd" else 0.0, device="cuda")
    assert [s["tier"] for s in stats] == [t.tier for t in plan.tiers]
    memory = {"device_mem": ["device"], "cached_host_mem": ["device", "host"],
              "cached_ssd": ["device", "host", "host"]}[preset]
    assert [t.memory for t in plan.tiers] == memory
    for tier, measured in zip(plan.tiers, stats):
        if tier.tier.endswith(".lru"):            # a cache reserves its whole budget: exactly
            assert measured["memory_bytes"] == tier.ram_bytes, tier
        elif tier.tier.endswith(".full"):         # the rows and the index, sized for ROWS
            assert abs(measured["memory_bytes"] - tier.ram_bytes) <= 0.01 * tier.ram_bytes, tier
    assert plan.device_bytes == sum(t.ram_bytes for t in plan.tiers if t.memory == "device") > 0
    assert plan.ram_bytes == sum(t.ram_bytes for t in plan.tiers if t.memory == "host")


def test_the_device_cache_is_planned_with_its_own_layout_not_the_cpu_caches():
    cpu = plan_capacity(ROWS, DIM, "sgd", "cached_host_mem", CACHE_MB)
    cuda = plan_capacity(ROWS, DIM, "sgd", "cached_host_mem", CACHE_MB, device="cuda")
    lines = int(CACHE_MB * 2**20 // (4 * DIM))
    assert cpu.tiers[0].ram_bytes == lines * (4 * DIM + 34) + lines // 32 * 8   # row, used flag
    assert cuda.tiers[0].ram_bytes == lines * (4 * DIM + 25)                    # neither
    assert cpu.device_bytes == 0 and cpu.ram_bytes == cpu.tiers[0].ram_bytes + cpu.tiers[1].ram_bytes
    assert cuda.ram_bytes == cuda.tiers[1].ram_bytes == cpu.tiers[1].ram_bytes
    with pytest.raises(oe.ConfigError, match="device='gpu': choose one of"):
        plan_capacity(ROWS, DIM, device="gpu")


def test_plan_command_puts_gpu_memory_in_its_own_column():
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "one_embedding", "plan", "--rows", "1e9",
                               "--embedding-dim", "128", "--optimizer", "adam", "--cache-mb",
                               "8192", "--host-cache-mb", "4096", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    r = run("--device", "cuda")
    assert r.returncode == 0, r.stderr
    assert "| tier | rows | RAM | GPU memory | disk | note |" in r.stdout
    assert "| device.lru | 5,592,405 | - | 8.1 GiB | - |" in r.stdout
    assert "| host.lru | 2,796,202 | 4.1 GiB | - | - |" in r.stdout
    assert "GPU memory in all: 8.1 GiB" in r.stdout
    plan = json.loads(run("--device", "cuda", "--json").stdout)
    assert plan["device"] == "cuda" and plan["device_bytes"] == plan["tiers"][0]["ram_bytes"]
    cpu = run()
    assert "GPU memory" not in cpu.stdout and "training on cpu" in cpu.stdout
    bad = run("--device", "gpu")
    assert bad.returncode == 2 and "invalid choice: 'gpu'" in bad.stderr
