// Rounding to the narrow float types of mixed precision (nn.amp, the fp16 row codec), on the
// bits, with no float arithmetic (CuPy's flush-to-zero of float32 subnormals cannot change a
// result) and no header: NVRTC, nvcc and the host emulator compile it alike.
//   fp16: IEEE binary16, round to nearest even; NaN stays NaN (quiet), overflow -> inf.
//   bf16: the top 16 bits of the float32, round to nearest even; NaN -> 0x7fc0.
//   tf32: the float32 with its low 13 mantissa bits rounded off (nearest even); NaN -> 0x7fc00000.
// These are numpy's astype(float16) and nn.amp.round_to bit for bit.
#pragma once

namespace oe {
namespace precision {

// dense.cu's ``kind`` codes (kernels/gemm.py KINDS): 0 none (fp32), 1 fp16, 2 bf16, 3 tf32.
constexpr int NONE = 0;
constexpr int FP16 = 1;
constexpr int BF16 = 2;
constexpr int TF32 = 3;

// float32 bits -> binary16 bits, round to nearest even; NaN stays NaN (quiet), overflow -> inf.
__device__ __forceinline__ unsigned short float_to_half_bits(float value) {
  const unsigned x = __float_as_uint(value);
  const unsigned sign = (x >> 16) & 0x8000u;
  const unsigned a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // |x| >= 65520 rounds to inf
  if (a >= 0x38800000u) {
    // normal half: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits; a
    // carry out of the mantissa correctly bumps the exponent
    unsigned r = a - 0x38000000u;
    r += 0x0fffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (r >> 13));
  }
  if (a <= 0x33000000u) return (unsigned short)sign;  // |x| <= 2^-25 (a tie at 2^-25 goes to 0)
  // subnormal half: the value in units of 2^-24 is m * 2^(e - 126) with m the 24-bit significand
  const unsigned e = a >> 23;
  const unsigned m = (a & 0x7fffffu) | 0x800000u;
  const unsigned shift = 126u - e;  // 14..24
  unsigned q = m >> shift;
  const unsigned rest = m & ((1u << shift) - 1u);
  const unsigned half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u))) ++q;  // q == 0x400 is the smallest normal: right
  return (unsigned short)(sign | q);
}

// binary16 bits -> float32 bits (exact: every half is a float).
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  const unsigned sign = ((unsigned)h & 0x8000u) << 16;
  const unsigned e = ((unsigned)h >> 10) & 0x1fu;
  unsigned m = (unsigned)h & 0x3ffu;
  unsigned bits;
  if (e == 0x1fu) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0u) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0u) {
    bits = sign;
  } else {
    // subnormal half m * 2^-24: shift the leading one up to the implicit bit
    unsigned exponent = 113u;  // the float exponent of 2^-14, lowered once per shift
    while ((m & 0x400u) == 0u) {
      m <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((m & 0x3ffu) << 13);
  }
  return __uint_as_float(bits);
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float value) {
  const unsigned x = __float_as_uint(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;  // NaN
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
  return __uint_as_float((unsigned)h << 16);
}

__device__ __forceinline__ float round_tf32(float value) {
  const unsigned x = __float_as_uint(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(0x7fc00000u);
  return __uint_as_float((x + 0x0fffu + ((x >> 13) & 1u)) & 0xffffe000u);
}

// The 16-bit pattern of ``value`` in ``kind`` (FP16 or BF16).
__device__ __forceinline__ unsigned short to_bits(float value, int kind) {
  return kind == FP16 ? float_to_half_bits(value) : float_to_bf16_bits(value);
}

// ``value`` rounded to ``kind``'s nearest value, as a float (NONE: unchanged).
__device__ __forceinline__ float round_to(float value, int kind) {
  if (kind == FP16) return half_bits_to_float(float_to_half_bits(value));
  if (kind == BF16) return bf16_bits_to_float(float_to_bf16_bits(value));
  if (kind == TF32) return round_tf32(value);
  return value;
}

}  // namespace precision
}  // namespace oe
