// Row codecs of the embedding and gradient shuffles (parallel/codec.py), with exactly its
// operation order so both sides decode the same bits.
//
// int8, per row: f = max |x|; q = roundf(s) (half away from zero) with s = (x * 127) / f (f = 0:
// divide by 1; f > OE_CODEC_BIG_SCALE: (x / f) * 127), clipped to [-127, 127]; x^ = (q * f) / 127
// (f > OE_CODEC_BIG_SCALE: (q / 127) * f), every step in float32. A row with a
// NaN or an inf in it gets f = NaN (0x7fc00000) and q = 0, so it decodes as all NaN. A row travels
// as dim int8 values followed by the 4 little-endian bytes of f: payload (n, dim + 4) u8.
// fp16: round to nearest even, done on the bits (no float arithmetic, so CuPy's flush-to-zero of
// float32 subnormals cannot change a result): payload (n, dim) u16 = (n, 2 dim) bytes.
//
// Rows arrive as T and are rounded to float32 first, as codec.encode does with any input.
#include "common.cuh"
#include "precision.cuh"

namespace oe {
namespace codec {

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(FULL_WARP, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// the fp16 conversions live in precision.cuh (shared with dense.cu's AMP casts)
using oe::precision::float_to_half_bits;
using oe::precision::half_bits_to_float;

}  // namespace codec
}  // namespace oe

// the row scale above which the codec divides first (parallel/codec.py's BIG_SCALE)
#define OE_CODEC_BIG_SCALE 2.0e36f

// Warp per row: the lanes find max |x| together, then each quantizes its columns.
// rows: (n, dim) T; payload: (n, dim + 4) u8.
template <typename T>
__global__ void codec_int8_encode(const T* rows, oe::i64 n, int dim, unsigned char* payload) {
  const int lane = threadIdx.x & 31;
  const oe::i64 stride = (oe::i64)dim + 4;
  for (oe::i64 r = oe::grid_warp(); r < n; r += oe::grid_warps()) {
    const T* x = rows + r * dim;
    float local = 0.0f;
    bool finite = true;
    for (int c = lane; c < dim; c += 32) {
      const float a = fabsf((float)x[c]);
      finite = finite && a <= 3.40282347e38f;  // false for inf and NaN
      local = a > local ? a : local;
    }
    // a row holding NaN or inf travels as scale NaN and q = 0: it decodes as all NaN
    const bool poisoned = __ballot_sync(oe::FULL_WARP, !finite) != 0u;
    const float scale = poisoned ? __uint_as_float(0x7fc00000u) : oe::codec::warp_max(local);
    const float safe = scale > 0.0f ? scale : 1.0f;
    // above OE_CODEC_BIG_SCALE (parallel/codec.py's BIG_SCALE) x * 127 could overflow
    const bool big = safe > OE_CODEC_BIG_SCALE;
    unsigned char* out = payload + r * stride;
    for (int c = lane; c < dim; c += 32) {
      const float v = (float)x[c];
      const float scaled = poisoned ? 0.0f : (big ? (v / safe) * 127.0f : (v * 127.0f) / safe);
      float q = roundf(scaled);  // exactly half away from zero
      q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
      out[c] = (unsigned char)(signed char)(int)q;
    }
    if (lane == 0) {
      const unsigned bits = __float_as_uint(scale);
      for (int b = 0; b < 4; ++b) out[dim + b] = (unsigned char)(bits >> (8 * b));
    }
  }
}

// out[r, c] = (q[r, c] * f_r) / 127. payload: (n, dim + 4) u8; out: (n, dim) T.
template <typename T>
__global__ void codec_int8_decode(const unsigned char* payload, oe::i64 n, int dim, T* out) {
  const oe::i64 stride = (oe::i64)dim + 4;
  for (oe::i64 t = oe::grid_thread(); t < n * dim; t += oe::grid_threads()) {
    const oe::i64 r = t / dim;
    const unsigned char* row = payload + r * stride;
    unsigned bits = 0;
    for (int b = 0; b < 4; ++b) bits |= (unsigned)row[dim + b] << (8 * b);
    const float q = (float)(signed char)row[t - r * dim];
    const float f = __uint_as_float(bits);
    out[t] = T(f > OE_CODEC_BIG_SCALE ? (q / 127.0f) * f : (q * f) / 127.0f);
  }
}

// half[i] = fp16(float32(values[i])). values: (n_values,) T; half: (n_values,) u16.
template <typename T>
__global__ void codec_fp16_encode(const T* values, oe::i64 n_values, unsigned short* half) {
  for (oe::i64 i = oe::grid_thread(); i < n_values; i += oe::grid_threads()) {
    half[i] = oe::codec::float_to_half_bits((float)values[i]);
  }
}

// out[i] = float32(half[i]) as T. half: (n_values,) u16; out: (n_values,) T.
template <typename T>
__global__ void codec_fp16_decode(const unsigned short* half, oe::i64 n_values, T* out) {
  for (oe::i64 i = oe::grid_thread(); i < n_values; i += oe::grid_threads()) {
    out[i] = T(oe::codec::half_bits_to_float(half[i]));
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(codec_int8_encode)
ONE_EMBEDDING_KERNEL(codec_int8_decode)
ONE_EMBEDDING_KERNEL(codec_fp16_encode)
ONE_EMBEDDING_KERNEL(codec_fp16_decode)
#endif
