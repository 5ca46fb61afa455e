// 16-byte vector copies on the device: CUDA's float4 / double2 viewed over arrays of float /
// double, and a warp's copy of one line with them. Included by the sources that copy rows and
// lines (embedding.cu's gathers; hashindex.cu's and cache.cu's line copies), after common.cuh;
// kept out of common.cuh so that its host builds (test_cuda_sources.py's hash check) need no
// vector types. Like every header here: no host header (NVRTC has none).
#pragma once

namespace oe {

// Vector16<T>::type holds LANES = 16 / sizeof(T) values of T in one 16-byte aligned struct
// (CUDA's float4 / double2: one 128-bit load or store); ::bits holds their fp16 / bf16 patterns
// (ushort4 / ushort2). as_vectors views an array of T as an array of such vectors: its address
// must be a multiple of the vector's size (the launching code checks it on the host:
// device_ops.vector_lanes; a GPU faults with "misaligned address" otherwise). The host emulator
// defines ONE_EMBEDDING_VECTOR_HOOK(address, alignment), which fails the launch there as the GPU
// would. Used by the gathers (embedding.cu) and the line copies (copy_line below).
template <typename T>
struct Vector16;
template <>
struct Vector16<float> {
  typedef float4 type;
  typedef ushort4 bits;
  static constexpr int LANES = 4;
};
template <>
struct Vector16<double> {
  typedef double2 type;
  typedef ushort2 bits;
  static constexpr int LANES = 2;
};

template <typename V, typename T>
__device__ __forceinline__ V* as_vectors(T* p) {
#ifdef ONE_EMBEDDING_VECTOR_HOOK
  ONE_EMBEDDING_VECTOR_HOOK((const void*)p, sizeof(V));
#endif
  return reinterpret_cast<V*>(p);
}

// The 32 lanes of a warp copy one line of line_size values, dst[c] = src[c]: one element per lane
// and step (a warp moves 128 bytes of float per step), or, when `vector` is set, one
// Vector16<T> per lane and step (512 bytes per step). `vector` requires line_size to be a
// multiple of LANES and both addresses multiples of 16 (the host decides: device_ops.line_vector);
// the same values either way (plain copies, so the same bits). Warp-uniform arguments: the branch
// does not diverge. The line copies of hashindex.cu and cache.cu.
template <typename T>
__device__ __forceinline__ void copy_line(T* dst, const T* src, int line_size, int vector,
                                          int lane) {
  if (vector) {
    typedef typename Vector16<T>::type V;
    const int groups = line_size / Vector16<T>::LANES;
    V* to = as_vectors<V>(dst);
    const V* from = as_vectors<const V>(src);
    for (int g = lane; g < groups; g += 32) to[g] = from[g];
  } else {
    for (int c = lane; c < line_size; c += 32) dst[c] = src[c];
  }
}

}  // namespace oe
