"""Serving side by side: an inference forward keeps no activations, so requests run their forwards
concurrently without a lock; the dynamic batcher merges concurrent requests and answers each
exactly as it would have been answered alone."""
import os
import threading

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.data.features import FeatureTransform
from one_embedding.serving import Predictor
from one_embedding.training import train

CFG = dict(steps=4, batch_size=128, synthetic_rows=5000, eval_batches=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "run"
    train(TrainConfig(persistent_path=str(path), **CFG), metrics_path=os.devnull, progress=False)
    return path


def raw_rows(n: int, seed: int):
    """n raw synthetic requests rows: dense (n, 13) with NaNs, categorical (n, 26) strings."""
    rng = np.random.default_rng(seed)
    t = FeatureTransform.for_config(TrainConfig(**CFG))
    dense = rng.integers(0, 50, (n, 13)).astype(np.float32)
    dense[rng.random((n, 13)) < 0.2] = np.nan
    cat = np.array([[str(int(rng.integers(0, c))) for c in t.cardinalities] for _ in range(n)],
                   dtype=object)
    return dense, cat


def activations(model) -> list:
    """Names of the arrays a model's modules hold for a backward pass."""
    held = []
    for m in model.modules():
        for name in ("_x", "_mask", "_xs", "_keep"):
            if getattr(m, name, None) is not None:
                held.append(f"{type(m).__name__}.{name}")
    return held


def test_an_inference_forward_keeps_no_activations_and_runs_side_by_side(run):
    requests = [raw_rows(int(n), seed) for seed, n in enumerate([1, 7, 64, 3, 200, 64, 2, 31])]
    with Predictor(run) as p:
        alone = [p.predict(d, c) for d, c in requests]
        assert activations(p._current.model) == []
        got = [None] * (len(requests) * 4)
        start = threading.Barrier(8)

        def work(k):
            start.wait()
            for i in range(k, len(got), 8):
                got[i] = p.predict(*requests[i % len(requests)])

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, alone[i % len(requests)])
        assert activations(p._current.model) == []
