"""The exchange codecs: int8 per row against a float64 statement of its formula, fp16, bytes."""
import numpy as np
import pytest

from one_embedding.errors import ConfigError
from one_embedding.parallel import codec


def int8_reference(rows):
    """REFERENCE.md's int8 formula in float64 Python arithmetic, value by value."""
    out_q, out_x = [], []
    for row in rows.astype(np.float64):
        f = float(np.float32(np.abs(row).max()))
        q = []
        for x in row:
            if f == 0:
                q.append(0)
                continue
            x, f32 = np.float32(x), np.float32(f)
            s = float(np.float32(x / f32) * np.float32(127.0)) if f > codec.BIG_SCALE else \
                float(np.float32(x * np.float32(127.0)) / f32)
            q.append(int(np.sign(s) * np.floor(abs(s) + 0.5)))  # half away from zero
        out_q.append(q)
        out_x.append([float(np.float32(np.float32(v) / np.float32(127.0)) * np.float32(f))
                      if f > codec.BIG_SCALE else
                      float(np.float32(np.float32(v) * np.float32(f)) / np.float32(127.0))
                      for v in q])
    return np.array(out_q, np.int8), np.array(out_x, np.float32)


def test_int8_matches_the_formula_and_bounds_the_error():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((200, 64)).astype(np.float32) * rng.uniform(1e-3, 10, (200, 1)).astype(np.float32)
    rows[3] = 0.0  # f = 0: the row is zero
    rows[4, :] = 0.0
    rows[4, 7] = -2.5  # the max is negative
    rows[5, :4] = [0.5, -0.5, 1.5, 127.0]  # exact halves after scaling
    want_q, want_x = int8_reference(rows)
    scale, q = codec.quantize_int8(rows)
    np.testing.assert_array_equal(q, want_q)
    got = codec.decode(codec.encode(rows, "int8"), "int8", 64)
    np.testing.assert_array_equal(got, want_x)
    assert (got[3] == 0).all() and got[4, 7] == -2.5
    err = np.abs(got - rows).max(axis=1)
    assert (err <= np.abs(rows).max(axis=1) / 254 * (1 + 1e-6)).all()  # half a step of f/127


def test_int8_of_rows_near_float32s_limit_stays_finite_and_rounds_exactly():
    """A finite row whose max exceeds FLT_MAX / 127 (~2.68e36) decoded as inf (x * 127 and
    q * f overflowed first), blamed later on the learning rate; and s = 0.49999997 was rounded
    up to 1 (trunc(s + 0.5): float32 sums 0.49999997 + 0.5 to 1.0)."""
    rows = np.zeros((5, 4), np.float32)
    rows[0] = [2.7e36, 1.3e36, -1e35, 1.0]
    rows[1] = [1e37, 5e36, -1e36, 1.0]
    rows[2] = [3.4028235e38, -3.4028235e38, 1.7e38, 1.0]
    rows[3] = [3e36, 3e36, 3e36, 3e36]
    rows[4] = [127.0, np.nextafter(np.float32(0.5), np.float32(0)), 0.0, 0.0]
    with np.errstate(over="raise"):
        scale, q = codec.quantize_int8(rows)
        got = codec.decode(codec.encode(rows, "int8"), "int8", 4)
    want_q, want_x = int8_reference(rows)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(got, want_x)
    assert np.isfinite(got).all() and q[1, 1] == 64 and q[4, 1] == 0
    err = np.abs(got.astype(np.float64) - rows).max(axis=1)
    assert (err <= np.abs(rows.astype(np.float64)).max(axis=1) / 254 * (1 + 1e-6)).all()


def test_fp16_and_fp32_round_trips():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((50, 16)).astype(np.float32)
    np.testing.assert_array_equal(codec.decode(codec.encode(rows, "fp32"), "fp32", 16), rows)
    np.testing.assert_array_equal(codec.decode(codec.encode(rows, "fp16"), "fp16", 16),
                                  rows.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("dtype,dim,bytes_", [("fp32", 64, 256), ("fp16", 64, 128), ("int8", 64, 68)])
def test_bytes_per_row(dtype, dim, bytes_):
    assert codec.row_bytes(dtype, dim) == bytes_
    assert codec.encode(np.ones((3, dim), np.float32), dtype).shape == (3, bytes_)


def test_oneflow_environment_switch_and_bad_names(monkeypatch):
    monkeypatch.delenv(codec.QUANTIZED_COMM_ENV, raising=False)
    assert codec.resolve_exchange_dtype(None) == "fp32"
    monkeypatch.setenv(codec.QUANTIZED_COMM_ENV, "1")
    assert codec.resolve_exchange_dtype(None) == "int8"
    assert codec.resolve_exchange_dtype("fp16") == "fp16"  # an explicit choice wins
    with pytest.raises(ConfigError, match="exchange_dtype='bf8'.*fp32"):
        codec.resolve_exchange_dtype("bf8")
