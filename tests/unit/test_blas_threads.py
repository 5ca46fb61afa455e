"""BLAS threads of a training run: half of the rank's share of the cores by default (two
OpenBLAS threads beside the prefetch, loader and generator threads took twice the CPU per step
on 2 cores, found by a profiling campaign), --blas-threads to choose, and given back at close."""
import os

from threadpoolctl import threadpool_info

from one_embedding import cli
from one_embedding.training_setup import blas_threads_for


def _blas_threads() -> int:
    return max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")


def test_the_default_leaves_half_the_ranks_cores_to_the_threads_beside_the_step(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [blas_threads_for(ranks) for ranks in (1, 2, 4, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert blas_threads_for(1) == 1
    assert blas_threads_for(1, blas_threads=3) == 3


def test_a_run_uses_its_blas_threads_and_gives_them_back(monkeypatch, tmp_path):
    from one_embedding import training

    before = _blas_threads()
    seen = []
    train_step = training.Trainer.train_step

    def step(self, *args):
        seen.append(_blas_threads())
        return train_step(self, *args)

    monkeypatch.setattr(training.Trainer, "train_step", step)
    assert cli.main(["train", "--steps", "2", "--batch-size", "64", "--synthetic-rows", "4000",
                     "--eval-batches", "1", "--no-progress", "--blas-threads", "3",
                     "--metrics", str(tmp_path / "m.jsonl")]) == 0
    assert seen and set(seen) == {3}
    assert _blas_threads() == before
