// What every kernel file of the engine's CPU operators shares: the includes, the features the
// build targets (the SHOAL_* macros below, from -march=native), bfloat16 conversions, 16-lane
// float32 vectors, and small helpers. Everything here is inline: it is included by every file.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace shoal {

using at::Tensor;

// Bytes of a group of 32 inputs x 16 output channels of GGUF 4-bit levels in the layouts of
// q4_linear and q4_lanes_linear: d[16] and m[16] float16, then 16 x 16 bytes of levels.
constexpr int64_t kQ4GroupBytes = 64 + 16 * 16;

// (Bit casts are __builtin_bit_cast: a memcpy through a local stops GCC's vectoriser.)
// Kernels are templated on the storage type: float for float32, uint16_t holding the bits of a
// bfloat16. Conversions are branch-free so GCC vectorises the loops (c10::BFloat16's own branch
// on NaN stops it): round to nearest even, and a NaN keeps a non-zero mantissa.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16);
}
template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline uint16_t from_float<uint16_t>(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

// Calls `fn` with a null pointer of the storage type of `dtype` (float32 or bfloat16).
template <typename Fn> void dispatch_storage(at::ScalarType dtype, const char* name, Fn&& fn) {
  if (dtype == at::kFloat)
    fn(static_cast<float*>(nullptr));
  else if (dtype == at::kBFloat16)
    fn(static_cast<uint16_t*>(nullptr));
  else
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", dtype);
}

template <typename T> inline T* ptr(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// exp(x) for float32 the vectoriser can inline: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a
// degree-6 polynomial (Cephes' expf coefficients), 2^n built in the exponent bits. Relative error
// about 2e-7; x below -87.3 gives about 1e-38 rather than 0, x above 88.7 gives +inf.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  // std::min/max take references: not vectorised
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX512F__)
// 16 lanes of the storage type to and from float32; the store rounds as from_float does.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// fast_exp on 16 lanes (the same reduction and polynomial; 2^n by vscalefps).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define SHOAL_LANES 1
// 16 float32 lanes: one zmm register with AVX-512, two ymm with AVX2 (AMD Zen 3, Intel before
// Skylake-SP). Decode attention and the weight-only lanes matmuls are written once on it; what
// differs between the two is how many accumulators fit in registers (16 ymm against 32 zmm).
#if defined(__AVX512F__)
struct Lanes16 {
  __m512 v;
  static Lanes16 zero() { return {_mm512_setzero_ps()}; }
  static Lanes16 all(float x) { return {_mm512_set1_ps(x)}; }
  static Lanes16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Lanes16 load(const uint16_t* p) { return {load16(p)}; }  // bfloat16
  static Lanes16 load_half(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Lanes16 load_int8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // The low and high nibbles of 16 bytes as float32 levels 0..15. vpermps reads only the low 4
  // bits of each index: a lookup turns a nibble into its level in one shuffle, with no mask and
  // no conversion (port 5 rather than port 0).
  static void load_nibbles(const uint8_t* p, Lanes16& lo, Lanes16& hi) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo.v = _mm512_permutexvar_ps(v, levels);
    hi.v = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels);
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline Lanes16 fmadd(Lanes16 a, Lanes16 b, Lanes16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes16 operator+(Lanes16 a, Lanes16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes16 operator*(Lanes16 a, Lanes16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
// Rows sharing a widened weight vector, and independent accumulator chains per row and group
// (to hide the multiply-add's latency): 32 registers hold 2 x 4 x 2 accumulators.
constexpr int64_t kLaneRows = 4;
constexpr int64_t kLaneChains = 2;
#else
struct Lanes16 {
  __m256 lo, hi;
  static Lanes16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes16 all(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
  static Lanes16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Lanes16 load(const uint16_t* p) {  // bfloat16
    const auto widen = [](const uint16_t* h) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), 16));
    };
    return {widen(p), widen(p + 8)};
  }
  static Lanes16 load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static Lanes16 load_int8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  // The low and high nibbles of 16 bytes as float32 levels 0..15 (vpermps takes 3 bits of index
  // here, so the levels come from converting the integers).
  static void load_nibbles(const uint8_t* p, Lanes16& lo, Lanes16& hi) {
    const __m256i mask = _mm256_set1_epi32(15);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
    hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
inline Lanes16 fmadd(Lanes16 a, Lanes16 b, Lanes16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes16 operator+(Lanes16 a, Lanes16 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline Lanes16 operator*(Lanes16 a, Lanes16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
// 16 ymm registers: 2 rows x 2 groups x 2 halves of accumulators leave room for the weights;
// those 8 chains already cover two FMA pipes of 4 cycles' latency.
constexpr int64_t kLaneRows = 2;
constexpr int64_t kLaneChains = 1;
#endif
#endif

// What the build target provides, beside SHOAL_LANES above (the kernels each macro brings are
// in the files named).
#if defined(__AVX512BF16__)
#define SHOAL_BF16_PAIRS 1  // bfloat16 pair dot products: prefill attention, dp_linear, q4_linear
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SHOAL_AMX 1  // AMX tiles: prefill attention, amx_linear
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && !defined(__AVX512F__))
#define SHOAL_INT8_GEMV 1  // int8.cpp
#endif
#if defined(__AVX2__) && (!defined(__AVX512F__) || defined(__AVX512VNNI__))
#define SHOAL_INT4_Q8 1  // int4_q8.cpp
#endif
#if defined(__AVX512VNNI__)
#define SHOAL_INT4_Q8_VNNI 1
#endif

inline void check_cpu_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Share i of `total` cut into `parts` near-equal shares (they add up to `total`).
inline int64_t share(int64_t total, int64_t parts, int64_t i) {
  return (i + 1) * total / parts - i * total / parts;
}

// One of `steps` steps of a prefetch spread over a loop, so that its requests keep pace with the
// compute rather than all leaving at once: asks for this step's share of `lines` 64-byte lines
// from `pf` on and moves `pf` past them; `due` carries the fractions (in 1 / steps lines) from
// step to step and starts at 0. Locality as __builtin_prefetch's: 3 into L1, 2 into L2.
template <int Locality>
inline void prefetch_step(const char*& pf, int64_t& due, int64_t lines, int64_t steps) {
  for (due += lines; due >= steps; due -= steps, pf += 64) __builtin_prefetch(pf, 0, Locality);
}

#ifdef SHOAL_BF16_PAIRS
// The bfloat16 pair (p[0], p[1]) in all 16 lanes: vdpbf16ps's operand against 16 pairs of the
// other side.
inline __m512bh broadcast_pair(const uint16_t* p) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[0] | (uint32_t(p[1]) << 16)));
}
#endif

#if defined(__AVX512F__)
// silu(a) = a / (1 + exp(-a)) in 16 float32 lanes: rcp14 and one Newton step, not vdivps (which
// made SwiGLU compute-bound: elementwise.cpp), relative error ~1e-7.
inline __m512 silu16(__m512 a) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(a, inv);
}
#endif

#ifdef SHOAL_AMX
// Linux hands out the AMX tile state only to processes that ask for it (arch_prctl).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &mask) == 0 && (mask & (1UL << kXtileData))) return true;
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes: tmm0-3 float32 accumulators, tmm4-5 A operands, tmm6-7 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};
#endif

// Items [0, items) handed out to `threads` threads as they come free: `fn(item, next)` runs each,
// `next` being the item the same thread takes after it (items or more: none), claimed first so
// that `fn` can prefetch its weights. Why items rather than a split into equal shares up front:
// on a machine whose cores the gateway, the scheduler and Redis also need, the thread another
// process preempts holds back only its current item, where with even shares the other thread
// waited at the end of every matmul for the preempted one's whole share (dp_linear_run in
// pairs.cpp and the lanes kernels' tiles in lanes.cpp give figures).
template <class Fn>
void run_items(int64_t items, int64_t threads, Fn&& fn) {
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t item = claimed.fetch_add(1); item < items;) {
      const int64_t next = claimed.fetch_add(1);
      fn(item, next);
      item = next;
    }
  }
}

// Calls `fn(std::integral_constant<int64_t, rows>)` for 1 <= rows <= M: a kernel's row count as a
// compile-time constant, so its tile's accumulators are arrays of fixed size.
template <int64_t M, typename Fn> inline void with_row_count(int64_t rows, Fn&& fn) {
  if constexpr (M > 1)
    if (rows < M) return with_row_count<M - 1>(rows, fn);
  fn(std::integral_constant<int64_t, M>{});
}

// x `[rows, K]` float32 or bfloat16 for a matmul against a weight of K inputs (a multiple of 32).
inline void check_lanes_input(const Tensor& x, const Tensor& w, int64_t k, const char* name) {
  check_cpu_contiguous(x, name);
  check_cpu_contiguous(w, name);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && k % 32 == 0,
              name, ": x [rows, K] with K a multiple of 32 matching the weight's");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              name, ": x float32 or bfloat16");
}

}  // namespace shoal
