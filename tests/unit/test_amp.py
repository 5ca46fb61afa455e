"""Mixed precision (nn.amp): rounding to fp16 / bf16 against independent references, the products
of Linear and DotInteraction in half precision against float64 references of the rounded
operands, nothing changed when off, and training with --amp fp16 / bf16 (loss scale, resume)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.nn import DotInteraction, Linear, amp
from one_embedding.training import train

FP16_ULP = 2.0 ** -10  # relative spacing of fp16 values in [1, 2)
BF16_ULP = 2.0 ** -7


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Nearest bf16 value (8 significant bits, ties to even) by float64 arithmetic, for normal
    finite inputs: frexp's mantissa in [0.5, 1) scaled to 8 bits and rounded half to even."""
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(m * 256.0) / 256.0, e).astype(np.float32)


def test_fp16_rounding_is_numpys_float16():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    x[:4] = [65504.0, 65520.0, -1e6, 2.0 ** -30]  # largest fp16, overflow, underflow
    with np.errstate(over="ignore"):
        got = amp.round_to(x, "fp16")
    assert got.dtype == np.float32
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    assert got[1] == np.inf and got[2] == -np.inf and got[3] == 0.0


def test_bf16_rounding_matches_a_float64_reference_and_ties_go_to_even():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20_000) * np.exp2(rng.integers(-60, 60, 20_000))).astype(np.float32)
    np.testing.assert_array_equal(amp.round_to(x, "bf16"), bf16_reference(x))
    one = np.float32(1.0)
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)], np.float32)
    np.testing.assert_array_equal(amp.round_to(ties, "bf16"),
                                  np.array([one, 1 + 2.0 ** -6, -one], np.float32))
    specials = np.array([np.inf, -np.inf, np.nan, np.finfo(np.float32).max], np.float32)
    got = amp.round_to(specials, "bf16")
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and got[3] == np.inf


def test_float64_is_rounded_once_to_the_nearest_bf16_and_tf32_value():
    """A float64 model under autocast: each value goes to its nearest bf16 / tf32 value, not
    through the nearest float32 first (1 + 2**-8 + 2**-30 rounded to float32 is a bf16 tie,
    which went down to 1.0; its nearest bf16 value is 1 + 2**-7)."""
    def nearest(x, bits):   # by float64 arithmetic, normal range: frexp's mantissa to ``bits``
        m, e = np.frexp(x)
        return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e)

    rng = np.random.default_rng(4)
    x = rng.standard_normal(200_000) * np.exp2(rng.integers(-60, 60, 200_000))
    m, e = np.frexp(x[:50_000])   # just off a float32-level bf16 / tf32 tie, either side
    x[:50_000] = np.ldexp((np.round(m * 512) + rng.choice([-1, 1], 50_000) * 2.0 ** -20) / 512, e)
    x[-3:] = [1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -11 + 2.0 ** -40, -(1 + 2.0 ** -8 + 2.0 ** -30)]
    for precision, bits in (("bf16", 8), ("tf32", 11)):
        got = amp.round_to(x, precision)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, nearest(x, bits), err_msg=precision)
    assert amp.round_to(x[-3:], "bf16")[0] == 1 + 2.0 ** -7


def test_off_changes_nothing_and_the_setting_is_scoped():
    a = np.random.default_rng(2).standard_normal((5, 7)).astype(np.float32)
    b = np.random.default_rng(3).standard_normal((7, 3)).astype(np.float32)
    assert amp.current() == "off" and amp.round_to(a) is a
    np.testing.assert_array_equal(amp.matmul(a, b), a @ b)
    with amp.autocast("fp16"):
        assert amp.current() == "fp16"
        with amp.autocast("bf16"):
            assert amp.current() == "bf16"
        with amp.autocast("off"):
            np.testing.assert_array_equal(amp.matmul(a, b), a @ b)
        assert amp.current() == "fp16"
    assert amp.current() == "off"
    with pytest.raises(ConfigError, match="amp='fp8'.*off, tf32, fp16, bf16"):
        with amp.autocast("fp8"):
            pass


@pytest.mark.parametrize("precision, ulp", [("fp16", FP16_ULP), ("bf16", BF16_ULP)])
def test_matmul_is_the_product_of_rounded_operands_rounded(precision, ulp):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((64, 200)).astype(np.float32)
    b = rng.standard_normal((200, 32)).astype(np.float32)
    exact = (amp.round_to(a, precision).astype(np.float64)
             @ amp.round_to(b, precision).astype(np.float64))
    with amp.autocast(precision):
        got = amp.matmul(a, b)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(amp.round_to(got, precision), got)  # half-representable
    # fp32 accumulation, then one rounding: within one unit of the half type's precision
    assert np.all(np.abs(got - exact) <= ulp * np.abs(exact) + 1e-6)
    # and far from fp32's own product: the rounding really happened
    assert np.abs(got - a @ b).max() > 10 * np.finfo(np.float32).eps * np.abs(a @ b).max()


@pytest.mark.parametrize("precision, ulp", [("fp16", FP16_ULP), ("bf16", BF16_ULP)])
def test_linear_forward_and_backward_in_half_precision(precision, ulp):
    rng = np.random.default_rng(5)
    layer = Linear(48, 16, relu=True, seed=1)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    dy = rng.standard_normal((32, 16)).astype(np.float32)
    r = lambda v: amp.round_to(v, precision).astype(np.float64)  # noqa: E731
    w, bias = layer.weight.data, layer.bias.data.astype(np.float64)
    h = r(x) @ r(w).T            # the product of the rounded operands, exactly
    with amp.autocast(precision):
        y = layer(x)
        dx = layer.backward(dy)

    def close(got, want_exact, added=0.0):
        """got = round(want_exact) (+ added in fp32): within one half-type unit of want_exact."""
        assert np.all(np.abs(got - (want_exact + added)) <= ulp * np.abs(want_exact) + 1e-5)

    mask = y > 0
    close(np.where(mask, y, 0.0), np.where(mask, h, 0.0), np.where(mask, bias, 0.0))
    assert np.all(h[~mask] + bias[np.nonzero(~mask)[1]] <= ulp * np.abs(h[~mask]) + 1e-5)
    dh = np.where(mask, dy, 0.0)
    close(dx, r(dh) @ r(w))
    close(layer.weight.grad, r(dh).T @ r(x))
    np.testing.assert_allclose(layer.bias.grad, dh.sum(axis=0), rtol=1e-5, atol=1e-5)  # fp32
    assert layer.weight.data.dtype == np.float32  # master weights stay fp32


def test_dot_interaction_rounds_its_products_and_keeps_the_concat():
    rng = np.random.default_rng(6)
    feats = rng.standard_normal((8, 5, 16)).astype(np.float32)
    concat = rng.standard_normal((8, 16)).astype(np.float32) * np.float32(1 + 2.0 ** -20)
    op = DotInteraction()
    with amp.autocast("fp16"):
        out = op(feats, concat)
        dfeats, dconcat = op.backward(np.ones_like(out))
    np.testing.assert_array_equal(out[:, :16], concat)  # the concatenated part is not rounded
    products = out[:, 16:]
    np.testing.assert_array_equal(amp.round_to(products, "fp16"), products)
    r = amp.round_to(feats, "fp16").astype(np.float64)
    gram = np.einsum("bie,bje->bij", r, r)
    want = np.concatenate([gram[:, i, :i] for i in range(1, 5)], axis=1)
    np.testing.assert_allclose(products, want, rtol=FP16_ULP, atol=1e-5)
    np.testing.assert_array_equal(amp.round_to(dfeats, "fp16"), dfeats)
    np.testing.assert_array_equal(dconcat, np.ones_like(concat))


# ---------------------------------------------------------------- training
#: long enough for the model, not the batch, to decide the metrics (~4-7 s a run)
SMALL = dict(batch_size=512, synthetic_rows=200_000, synthetic_scale=0.001, eval_batches=20,
             steps=200, eval_interval=0)


def run(tmp_path, amp_mode, **kwargs):
    path = tmp_path / f"{amp_mode}.jsonl"
    final = train(TrainConfig(amp=amp_mode, **SMALL, **kwargs), metrics_path=str(path),
                  progress=False)
    losses = [json.loads(line)["loss"] for line in path.read_text().splitlines()
              if json.loads(line)["event"] == "train"]
    return final, np.array(losses)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return run(tmp_path_factory.mktemp("fp32"), "off")


@pytest.mark.parametrize("amp_mode", ["fp16", "bf16"])
def test_training_in_half_precision_follows_fp32(tmp_path, fp32_run, amp_mode):
    (want, want_losses), (got, losses) = fp32_run, run(tmp_path, amp_mode)
    assert got["amp"] == amp_mode and want["amp"] == "off"
    assert not np.array_equal(losses, want_losses)  # the products really ran in half precision
    # the trained models agree (measured 2026-11-26: AUC 0.8204 fp32, 0.8206 fp16, 0.8196 bf16;
    # logloss 0.4289, 0.4282, 0.4281); single batches' losses are too noisy to compare step by step
    assert abs(got["auc"] - want["auc"]) < 0.005
    assert abs(got["logloss"] - want["logloss"]) < 0.005
    assert abs(got["loss_last_10pct"] - want["loss_last_10pct"]) < 0.02 * want["loss_last_10pct"]
    if amp_mode == "fp16":  # a dynamic loss scale; the first steps may overflow and be skipped
        assert got["loss_scale"] > 1.0 and 0 <= got["skipped_steps"] <= 3
    else:
        assert "loss_scale" not in got


def cli(tmp_path, metrics, *args, amp_mode="fp16", check=True):
    cmd = [sys.executable, "-m", "one_embedding", "train", "--synthetic-rows", "40000",
           "--batch-size", "256", "--eval-batches", "5", "--snapshot-interval", "10",
           "--no-progress", "--amp", amp_mode, "--persistent-path", str(tmp_path / "run"),
           "--metrics", str(metrics), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_fp16_resume_continues_bit_for_bit_with_the_loss_scale(tmp_path):
    full = cli(tmp_path / "a", tmp_path / "full.jsonl", "--steps", 40)
    cli(tmp_path / "b", tmp_path / "first.jsonl", "--steps", 20)
    resumed = cli(tmp_path / "b", tmp_path / "rest.jsonl", "--steps", 40, "--resume")
    keep = lambda rs: [(r["step"], r["loss"]) for r in rs  # noqa: E731
                       if r["event"] == "train" and r["step"] > 20]
    assert keep(resumed) == keep(full) and keep(full)
    final = lambda rs: next(r for r in rs if r["event"] == "final")  # noqa: E731
    for key in ("auc", "logloss", "loss_scale", "skipped_steps"):
        assert final(resumed)[key] == final(full)[key], key
    # another precision changes results: resuming under it is refused, naming the difference
    refused = cli(tmp_path / "b", tmp_path / "bf16.jsonl", "--steps", 60, "--resume",
                  amp_mode="bf16", check=False)
    assert refused.returncode != 0 and "amp" in refused.stderr and "fp16" in refused.stderr


def test_bad_amp_values_are_refused():
    with pytest.raises(ConfigError, match="amp='half'"):
        TrainConfig(amp="half")
    proc = subprocess.run([sys.executable, "-m", "one_embedding", "train", "--amp", "fp8"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--amp" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the fp16 AUC gap (issue 32)


def test_weight_gradient_keeps_an_fp32_result_where_fp16_would_overflow():
    """dhᵀ x sums over the batch: 1024 rows of 64 x 10 (a scaled last-layer gradient) make
    655,360, past fp16's 65,504. The weight gradient keeps the fp32 accumulator's value; the
    input gradient (a sum over the layer's outputs) stays half-typed."""
    layer = Linear(32, 1, seed=0)
    x = np.full((1024, 32), 10.0, np.float32)
    dy = np.full((1024, 1), 64.0, np.float32)
    with amp.autocast("fp16"):
        layer(x)
        dx = layer.backward(dy)
    assert np.isfinite(layer.weight.grad).all()
    np.testing.assert_allclose(layer.weight.grad, np.full((1, 32), 655360.0), rtol=1e-6)
    np.testing.assert_array_equal(amp.round_to(dx, "fp16"), dx)


#: the issue's setting at a CPU's scale: 10,000 rows, --eval-fraction 0.2, one epoch of 1024-row
#: batches (7 steps), a loss logged every step
SHORT = dict(synthetic_rows=10_000, eval_fraction=0.2, batch_size=1024, epochs=1, log_interval=1)


def short_run(path, precision):
    final = train(TrainConfig(amp=precision, **SHORT), metrics_path=str(path), progress=False)
    losses = [json.loads(line)["loss"] for line in path.read_text().splitlines()
              if json.loads(line)["event"] == "train"]
    return final, np.array(losses)


@pytest.fixture(scope="module")
def short_fp32_run(tmp_path_factory):
    return short_run(tmp_path_factory.mktemp("short") / "off.jsonl", "off")


@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
def test_short_amp_run_follows_fp32_step_for_step(tmp_path, short_fp32_run, precision):
    """Before the weight gradients kept an fp32 result, the fp16 run's second step overflowed
    under the 2**16 loss-scale start and was skipped (1/7 of the training): its losses lagged
    fp32's by a step (step 3: 1.2196 against 0.8020) and it ended at AUC 0.6018 against fp32's
    0.6096 (logloss 0.6584 against 0.5638).

    Measured after the fix (Linear's forward and weight-gradient products keeping their fp32
    accumulator): AUC / logloss fp32 0.6096 / 0.5638, fp16 0.6117 / 0.5572, bf16 0.6205 /
    0.5578, tf32 0.6018 / 0.5560. After 7 steps the run is chaotic: from step 5 on any rounding
    moves single losses by up to 12%, and the AUC of 15- or 31-step runs by ±0.02 between any
    two precisions (AMP above fp32 as often as below; tf32's logloss is better than fp32's
    while its AUC is 0.008 lower). So the losses are compared over the first 4 steps, and the
    AUC and logloss one-sided for fp16, where the lag showed."""
    want, want_losses = short_fp32_run
    got, losses = short_run(tmp_path / f"{precision}.jsonl", precision)
    assert got["steps"] == want["steps"] == 7 and got["amp"] == precision
    assert len(losses) == len(want_losses) == 7
    np.testing.assert_allclose(losses[:4], want_losses[:4], rtol=0.03)
    assert not np.array_equal(losses, want_losses)  # the products really were rounded
    if precision == "fp16":
        assert got["skipped_steps"] == 0 and got["loss_scale"] == 2.0 ** 16
        assert got["auc"] > want["auc"] - 0.005
        assert got["logloss"] < want["logloss"] + 0.005
    else:
        assert "loss_scale" not in got


REAL_FILES = ("criteo1tb_day0_head1000.tsv", "kaggle_train_sample_a_100.tsv",
              "kaggle_train_sample_b_100_stripped.tsv", "kaggle_train_sample_c_100_stripped.tsv")


def test_amp_reaches_the_fp32_auc_on_real_criteo_rows(tmp_path, criteo_dir):
    """The issue's criterion on the real rows at hand (1,300: Criteo 1TB's first 1,000 and 300
    Kaggle rows), --eval-fraction 0.2, one epoch of 128-row batches (8 steps, 252 held out).
    Measured: fp32 AUC 0.7705; before the fix (main 05a5ee6) fp16 0.7647 (-0.0058) and bf16
    0.7682; after it tf32 0.7702, fp16 0.7713, bf16 0.7705."""
    files = tuple(str(criteo_dir / name) for name in REAL_FILES)
    common = dict(data=files, eval_fraction=0.2, batch_size=128, epochs=1)
    finals = {p: train(TrainConfig(amp=p, **common), metrics_path=str(tmp_path / f"{p}.jsonl"),
                       progress=False) for p in ("off", "tf32", "fp16", "bf16")}
    assert finals["off"]["eval_samples"] == 252 and finals["off"]["steps"] == 8
    for precision in ("tf32", "fp16", "bf16"):
        assert abs(finals[precision]["auc"] - finals["off"]["auc"]) < 0.005, precision
    assert finals["fp16"]["skipped_steps"] == 0
