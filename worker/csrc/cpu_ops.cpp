// CPU kernels of the worker's engine, registered as torch operators `shoal::*`.
//
// Built on first use by worker/cpu_ops.py (torch.utils.cpp_extension, against the torch that is
// installed, so the ABI always matches). Every kernel computes in float32 whatever the storage
// dtype (float32 or bfloat16), and parallelises with at::parallel_for, which honours
// torch.set_num_threads (its OpenMP pragmas are inline in ATen's headers: build with -fopenmp).
// Loops are written for the compiler to vectorise (-O3 -march=native, `omp simd` reductions), so the
// file builds on any CPU gcc targets; paged attention and SiLU x up have AVX-512 versions written
// out, the projections run on AVX512_BF16 / VNNI dot products where the CPU has them (dp_linear,
// vnni_linear), and where -march=native brings AMX, prefill attention and the projections of
// small iterations run on AMX tiles (SHOAL_AMX).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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

namespace {

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

void check_cpu_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// ---------------------------------------------------------------------------------------------
// The paged K/V cache (PagedAttention, Kwon et al., SOSP'23, §4.1). Layout per layer:
//   k_pool [Hkv, num_blocks, D, block_size]  keys transposed within a block,
//   v_pool [Hkv, num_blocks, block_size, D].
// With keys transposed, the scores of a whole block are `sum_e q[e] * K[e, :]`: FMAs across the
// block's tokens with no horizontal reduction per token (which made a row-major dot product
// kernel 4x slower here). Values are accumulated row by row, across D.
// ---------------------------------------------------------------------------------------------

// Writes the new tokens' K and V at their slots (slot = block * block_size + offset).
template <typename scalar_t>
void write_kv_impl(const Tensor& k, const Tensor& v, Tensor& k_pool, Tensor& v_pool,
                   const Tensor& slots) {
  const int64_t n = k.size(0), hkv = k.size(1), d = k.size(2);
  const int64_t nb = k_pool.size(1), bs = k_pool.size(3);
  const scalar_t* kp = ptr<scalar_t>(k);
  const scalar_t* vp = ptr<scalar_t>(v);
  scalar_t* kc = ptr<scalar_t>(k_pool);
  scalar_t* vc = ptr<scalar_t>(v_pool);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  // Grain 8: each token's keys land across a block's D rows (cache lines missed, not bytes
  // moved, set the cost), so even a decode iteration's few tokens split over the threads.
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t blk = sp[i] / bs, off = sp[i] % bs;
      TORCH_CHECK(blk >= 0 && blk < nb, "slot outside the K/V pool");
      for (int64_t h = 0; h < hkv; ++h) {
        const scalar_t* krow = kp + i * ks0 + h * ks1;
        scalar_t* kdst = kc + ((h * nb + blk) * d) * bs + off;
        for (int64_t e = 0; e < d; ++e) kdst[e * bs] = krow[e];
        std::memcpy(vc + ((h * nb + blk) * bs + off) * d, vp + i * vs0 + h * vs1, d * sizeof(scalar_t));
      }
    }
  });
}

void write_kv(const Tensor& k, const Tensor& v, Tensor k_pool, Tensor v_pool, const Tensor& slots) {
  check_cpu_contiguous(k_pool, "k_pool");
  check_cpu_contiguous(v_pool, "v_pool");
  check_cpu_contiguous(slots, "slot_mapping");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v [n, Hkv, D] with unit stride along D");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == k.size(1) && k_pool.size(2) == k.size(2),
              "k_pool [Hkv, num_blocks, D, block_size]");
  TORCH_CHECK(v_pool.size(0) == k_pool.size(0) && v_pool.size(1) == k_pool.size(1) &&
                  v_pool.size(2) == k_pool.size(3) && v_pool.size(3) == k_pool.size(2),
              "v_pool [Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == k.size(0), "one int64 slot per token");
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type() &&
                  k.scalar_type() == v.scalar_type(), "k, v and the pools must share a dtype");
  dispatch_storage(k.scalar_type(), "write_kv", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    write_kv_impl<scalar_t>(k, v, k_pool, v_pool, slots);
  });
}

// Paged attention of one iteration: every query row against its own request's blocks, read where
// they lie. A request contributes consecutive query rows (one for a decode, a chunk's tokens for a
// prefill); its last row attends `seq_len` tokens and each earlier row one fewer (causal), so a
// prefill chunk's own K/V, written before the call, serve as its keys and a cached prefix is read in
// place (chunked prefill). A work item is one (request, tile of up to kTile consecutive rows, K/V
// head): the G = Hq / Hkv query heads of the tile's rows sharing that K/V head are scored together,
// so every K and V element loaded serves G x rows queries.
//
// The accumulators of a block's scores ([R*G][BS]) and of the output ([R*G][DC]) are small arrays
// of compile-time size, which GCC keeps in vector registers: accumulating through memory instead
// made every FMA wait on the previous store (measured 3x slower). `attend` is instantiated for
// common (G, BS, D) and `attend_generic` serves any other shape, a row at a time.
constexpr int64_t kMaxGroup = 16, kMaxHeadDim = 256, kMaxBlockSize = 256;
// Query rows a prefill tile scores together: with SmolLM2's 3 query heads a K/V head, 4 rows'
// score accumulators fill 24 of 32 zmm registers; AVX2's 16 ymm hold those of 2 rows.
#if defined(__AVX512F__) || !defined(SHOAL_LANES)
constexpr int64_t kTile = 4;
#else
constexpr int64_t kTile = 2;
#endif

// Where one work item reads and writes. q is float32, already scaled, [rows][G][D]; scores has
// rows * G rows of `padded` floats.
template <typename scalar_t>
struct AttnItem {
  const float* q;
  const scalar_t* k_head;  // k_pool[h]: [num_blocks, D, BS]
  const scalar_t* v_head;  // v_pool[h]: [num_blocks, BS, D]
  const int64_t* table;
  int64_t rows;    // consecutive query rows
  int64_t len;     // tokens the last row attends; row i attends len - (rows - 1 - i)
  int64_t padded;  // len rounded up to the block size
  float* scores;
  scalar_t* out;   // the first row's [G, D] output
  int64_t out_row_stride;
};

// Asks for `n` elements from `p` on to be brought into cache, one request per 64-byte line.
// Blocks lie anywhere in the pool, so the hardware prefetcher cannot see the next one coming.
// Into L2, not L1 (prefetcht2): decode attention with the lines asked for 4 blocks ahead into
// L1 measured no faster than 1 block ahead, and with them into L2 15-23% faster (64 requests of
// 190 tokens, K/V out of cache, 2-core Zen 4: 630-690 -> 525-530 µs a layer).
template <typename T> inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
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

// Decode attention asks for a request's K blocks this many blocks before it scores them.
constexpr int64_t kPrefetchBlocks = 4;

// Softmax of each of the G score rows over its first `len` entries, in place, then zeros up to
// `upto` (so a tile's shorter rows add nothing past their length); returns 1 / sum per row in
// inv_sum (the output is scaled once at the end).
inline void softmax_rows(float* scores, int64_t g, int64_t len, int64_t upto, int64_t padded,
                         float* inv_sum) {
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * padded;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = fast_exp(s[t] - m);
      sum += s[t];
    }
    for (int64_t t = len; t < upto; ++t) s[t] = 0.f;
    inv_sum[j] = 1.f / sum;
  }
}

// R rows of G heads; the weighted sum of values runs over DC columns of D at a time, so that
// R * G * DC accumulators fit in registers (DC = D when R = 1: a decode reads its values once).
template <typename scalar_t, int64_t G, int64_t BS, int64_t D, int64_t R>
void attend(const AttnItem<scalar_t>& it) {
  constexpr int64_t Q = R * G, DC = R == 1 ? D : 32;
  const int64_t nblocks = (it.len + BS - 1) / BS;
  for (int64_t b = 1; b < std::min(kPrefetchBlocks, nblocks); ++b)
    prefetch(it.k_head + it.table[b] * D * BS, D * BS);
  for (int64_t b = 0; b < nblocks; ++b) {
    const scalar_t* kb = it.k_head + it.table[b] * D * BS;
    if (b + kPrefetchBlocks < nblocks)
      prefetch(it.k_head + it.table[b + kPrefetchBlocks] * D * BS, D * BS);
    prefetch(it.v_head + it.table[b] * BS * D, BS * D);  // for the weighted sum below
    float acc[Q][BS] = {};
    for (int64_t e = 0; e < D; ++e) {
      float kf[BS];
      for (int64_t t = 0; t < BS; ++t) kf[t] = to_float(kb[e * BS + t]);
      for (int64_t j = 0; j < Q; ++j) {
        const float qe = it.q[j * D + e];
        for (int64_t t = 0; t < BS; ++t) acc[j][t] += qe * kf[t];
      }
    }
    for (int64_t j = 0; j < Q; ++j)
      for (int64_t t = 0; t < BS; ++t) it.scores[j * it.padded + b * BS + t] = acc[j][t];
  }
  float inv_sum[Q];
  for (int64_t r = 0; r < R; ++r)
    softmax_rows(it.scores + r * G * it.padded, G, it.len - (R - 1 - r), it.len, it.padded,
                 inv_sum + r * G);
  for (int64_t c = 0; c < D; c += DC) {
    float o[Q][DC] = {};
    for (int64_t t = 0; t < it.len; ++t) {
      const scalar_t* vrow = it.v_head + (it.table[t / BS] * BS + t % BS) * D + c;
      float vf[DC];
      for (int64_t e = 0; e < DC; ++e) vf[e] = to_float(vrow[e]);
      for (int64_t j = 0; j < Q; ++j) {
        const float p = it.scores[j * it.padded + t];
        for (int64_t e = 0; e < DC; ++e) o[j][e] += p * vf[e];
      }
    }
    for (int64_t j = 0; j < Q; ++j) {
      scalar_t* dst = it.out + (j / G) * it.out_row_stride + (j % G) * D + c;
      for (int64_t e = 0; e < DC; ++e) dst[e] = from_float<scalar_t>(o[j][e] * inv_sum[j]);
    }
  }
}

#ifdef SHOAL_LANES
// The same for 16-token blocks with vectors written out (Lanes16: AVX-512 or AVX2): for R > 1,
// GCC vectorised the portable loops along D and spilled the accumulators (perf: a 4-row tile no
// faster than rows one by one). Here a block's scores are Q = R * G vectors, one FMA per (query,
// dimension), and the weighted sum of values keeps Q x DC / 16 vectors: DC is all of D for a
// decode row where 32 zmm registers hold them (its values are read once), else as many columns
// as keep the accumulators within 12 of the 16 ymm.
constexpr int64_t attend_columns(int64_t q, int64_t d, int64_t r) {
#if defined(__AVX512F__)
  return r == 1 ? d : 32;
#else
  int64_t dc = 16;
  while (dc * 2 <= d && d % (dc * 2) == 0 && q * dc * 2 / 8 <= 12) dc *= 2;
  return dc;
#endif
}

template <typename scalar_t, int64_t G, int64_t D, int64_t R>
void attend16(const AttnItem<scalar_t>& it) {
  constexpr int64_t BS = 16, Q = R * G, DC = attend_columns(Q, D, R), NV = DC / 16;
  static_assert(D % DC == 0 && DC % 16 == 0, "head_dim must be a multiple of 32");
  const int64_t nblocks = (it.len + BS - 1) / BS;
  for (int64_t b = 1; b < std::min(kPrefetchBlocks, nblocks); ++b)
    prefetch(it.k_head + it.table[b] * D * BS, D * BS);
  for (int64_t b = 0; b < nblocks; ++b) {
    const scalar_t* kb = it.k_head + it.table[b] * D * BS;
    if (b + kPrefetchBlocks < nblocks)
      prefetch(it.k_head + it.table[b + kPrefetchBlocks] * D * BS, D * BS);
    prefetch(it.v_head + it.table[b] * BS * D, BS * D);
    Lanes16 acc[Q];
    for (int64_t j = 0; j < Q; ++j) acc[j] = Lanes16::zero();
    for (int64_t e = 0; e < D; ++e) {
      const Lanes16 kf = Lanes16::load(kb + e * BS);
      for (int64_t j = 0; j < Q; ++j) acc[j] = fmadd(Lanes16::all(it.q[j * D + e]), kf, acc[j]);
    }
    for (int64_t j = 0; j < Q; ++j) acc[j].store(it.scores + j * it.padded + b * BS);
  }
  float inv_sum[Q];
  for (int64_t r = 0; r < R; ++r)
    softmax_rows(it.scores + r * G * it.padded, G, it.len - (R - 1 - r), it.len, it.padded,
                 inv_sum + r * G);
  for (int64_t c = 0; c < D; c += DC) {
    Lanes16 o[Q][NV];
    for (int64_t j = 0; j < Q; ++j)
      for (int64_t u = 0; u < NV; ++u) o[j][u] = Lanes16::zero();
    for (int64_t t = 0; t < it.len; ++t) {
      const scalar_t* vrow = it.v_head + (it.table[t / BS] * BS + t % BS) * D + c;
      Lanes16 vf[NV];
      for (int64_t u = 0; u < NV; ++u) vf[u] = Lanes16::load(vrow + 16 * u);
      for (int64_t j = 0; j < Q; ++j) {
        const Lanes16 p = Lanes16::all(it.scores[j * it.padded + t]);
        for (int64_t u = 0; u < NV; ++u) o[j][u] = fmadd(p, vf[u], o[j][u]);
      }
    }
    for (int64_t j = 0; j < Q; ++j) {
      alignas(64) float row[DC];
      const Lanes16 inv = Lanes16::all(inv_sum[j]);
      for (int64_t u = 0; u < NV; ++u) (o[j][u] * inv).store(row + 16 * u);
      scalar_t* dst = it.out + (j / G) * it.out_row_stride + (j % G) * D + c;
      for (int64_t e = 0; e < DC; ++e) dst[e] = from_float<scalar_t>(row[e]);
    }
  }
}
#endif

template <typename scalar_t>
void attend_generic(const AttnItem<scalar_t>& it, int64_t g, int64_t bs, int64_t d) {
  // One row (it.rows == 1): the scheduler below never tiles shapes without a fast kernel.
  for (int64_t b = 0; b * bs < it.len; ++b) {
    const scalar_t* kb = it.k_head + it.table[b] * d * bs;
    for (int64_t j = 0; j < g; ++j) {
      float* s = it.scores + j * it.padded + b * bs;
      std::fill(s, s + bs, 0.f);
      for (int64_t e = 0; e < d; ++e) {
        const float qe = it.q[j * d + e];
        for (int64_t t = 0; t < bs; ++t) s[t] += qe * to_float(kb[e * bs + t]);
      }
    }
  }
  float inv_sum[kMaxGroup];
  softmax_rows(it.scores, g, it.len, it.len, it.padded, inv_sum);
  for (int64_t j = 0; j < g; ++j) {
    float o[kMaxHeadDim] = {};
    for (int64_t t = 0; t < it.len; ++t) {
      const scalar_t* vrow = it.v_head + (it.table[t / bs] * bs + t % bs) * d;
      const float p = it.scores[j * it.padded + t];
      for (int64_t e = 0; e < d; ++e) o[e] += p * to_float(vrow[e]);
    }
    for (int64_t e = 0; e < d; ++e) it.out[j * d + e] = from_float<scalar_t>(o[e] * inv_sum[j]);
  }
}

#if defined(__AVX512BF16__)
#define SHOAL_BF16_PAIRS 1
// Prefill attention on bfloat16 pairs. A request's prefill chunk is scored against one K/V head
// at a time, 16 query rows at a time; the keys and values of that head are first copied out of
// their blocks, once per (request, head) for all its rows, into layouts where pairs of
// consecutive elements along the reduced dimension are interleaved ("VNNI"): keys
// `[D / 2][T][2]` (pairs of dimensions), values `[T / 2][D][2]` (pairs of tokens). Then both
// products, `S = Q K^T` and `O = P V`, multiply bfloat16 pairs into float32: one AVX512_BF16
// `vdpbf16ps` does 32 multiply-adds where an fp32 FMA does 16 (attend_dpbf16), and an AMX tile
// product 16 x 16 x 32 (attend_amx). Softmax runs in float32 between them and rounds P to
// bfloat16, as flash attention does in bfloat16. Only head_dim 64 and 16-token blocks take these
// kernels; other shapes keep the ones above. Figures in docs/engine.md.

constexpr int64_t kVnniRows = 16, kVnniD = 64, kVnniBS = 16;

// Per-thread buffers of the prefill kernels.
struct VnniScratch {
  std::vector<uint16_t> k, v, p, q;  // keys [D/2][Tk][2], values [Tv/2][D][2], P [queries][Tv], Q
  std::vector<float> s;              // scores [queries][Tv]
  alignas(64) float o[kVnniRows * kVnniD];  // attend_amx's output tiles, stored
};

// One request's keys and values of one head, `len` tokens, into the VNNI layouts, zero past
// `len` up to tk (keys) and tv (values) tokens.
inline void gather_vnni(const uint16_t* k_head, const uint16_t* v_head, const int64_t* table,
                        int64_t len, int64_t tk, int64_t tv, VnniScratch& sc) {
  constexpr int64_t D = kVnniD, BS = kVnniBS;
  sc.k.assign(D * tk, 0);
  sc.v.resize(tv * D);
  // Interleaves a (lanes 0-15 of the index) with b (32-47): out[2i] = a[i], out[2i + 1] = b[i].
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  const int64_t nblocks = (len + BS - 1) / BS;
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint16_t* kb = k_head + table[b] * D * BS;  // [D][BS]
    const int64_t n = std::min(BS, len - b * BS);
    const __mmask32 keep = n == BS ? ~__mmask32(0) : static_cast<__mmask32>((1ULL << (2 * n)) - 1);
    for (int64_t pr = 0; pr < D / 2; ++pr) {
      const __m512i even = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + 2 * pr * BS)));
      const __m512i odd = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + (2 * pr + 1) * BS)));
      _mm512_mask_storeu_epi16(sc.k.data() + (pr * tk + b * BS) * 2, keep,
                               _mm512_permutex2var_epi16(even, lo, odd));
    }
    const uint16_t* vb = v_head + table[b] * BS * D;  // [BS][D]
    for (int64_t t = 0; t < BS; t += 2) {
      uint16_t* dst = sc.v.data() + (b * BS + t) / 2 * D * 2;
      if (t + 1 < n) {
        for (int64_t c = 0; c < D; c += 32) {
          const __m512i r0 = _mm512_loadu_si512(vb + t * D + c), r1 = _mm512_loadu_si512(vb + (t + 1) * D + c);
          _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(r0, lo, r1));
          _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(r0, hi, r1));
        }
      } else {  // the last token alone (its pair is past len), or nothing
        for (int64_t e = 0; e < D; ++e) {
          dst[2 * e] = t < n ? vb[t * D + e] : 0;
          dst[2 * e + 1] = 0;
        }
      }
    }
  }
  std::fill(sc.v.begin() + nblocks * BS * D, sc.v.end(), 0);
}

// One query's softmax: `s[0, n)` holds its unscaled scores `q . k`; writes
// `P = exp(scale * s - max)` as bfloat16 to `p[0, n)` and zeros on to `upto` (a multiple of 16),
// and returns 1 / sum(P) (0 when n is 0: a padding query).
inline float softmax_bf16(const float* s, uint16_t* p, int64_t n, int64_t upto, float scale) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16)
    mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1, s + t));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sc16 = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t < n; t += 16) {
    const __mmask16 valid = n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1;
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), sc16, shift)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (; t < upto; t += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), _mm256_setzero_si256());
  return n ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
}

// The bfloat16 pair (p[0], p[1]) in all 16 lanes: vdpbf16ps's operand against 16 pairs of the
// other side.
inline __m512bh broadcast_pair(const uint16_t* p) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[0] | (uint32_t(p[1]) << 16)));
}

constexpr int64_t kDpQueries = 4;  // queries per register block of attend_dpbf16

// Scores of kDpQueries queries (`q` [4][D]) against KB blocks of 16 keys from block c0 on:
// 4 x KB accumulators, each key vector loaded once for the 4 queries.
template <int64_t KB>
inline void scores_dpbf16(const uint16_t* q, const uint16_t* k, int64_t tk, int64_t c0, float* s,
                          int64_t tv) {
  constexpr int64_t D = kVnniD, QB = kDpQueries;
  __m512 acc[QB][KB];
  for (int64_t i = 0; i < QB; ++i)
    for (int64_t b = 0; b < KB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < D / 2; ++pr) {
    __m512bh kv[KB];
    for (int64_t b = 0; b < KB; ++b)
      kv[b] = (__m512bh)_mm512_loadu_si512(k + (pr * tk + (c0 + b) * 16) * 2);
    for (int64_t i = 0; i < QB; ++i) {
      const __m512bh qp = broadcast_pair(q + i * D + 2 * pr);
      for (int64_t b = 0; b < KB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], qp, kv[b]);
    }
  }
  for (int64_t i = 0; i < QB; ++i)
    for (int64_t b = 0; b < KB; ++b) _mm512_storeu_ps(s + i * tv + (c0 + b) * 16, acc[i][b]);
}

// `rows` consecutive query rows of one request (the last attends `len` tokens) against one K/V
// head, for its G query heads, with vdpbf16ps: q and out point at the first row's first of those
// heads. The G heads of 16 rows are one list of queries, taken kDpQueries at a time.
template <int64_t G>
void attend_dpbf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_head,
                   const uint16_t* v_head, const int64_t* table, int64_t rows, int64_t len,
                   float scale, uint16_t* out, int64_t out_row_stride, VnniScratch& sc) {
  constexpr int64_t D = kVnniD, R = kVnniRows, QB = kDpQueries;
  constexpr int64_t NQ = (R * G + QB - 1) / QB * QB;  // queries of a full group, padded
  const int64_t tk = (len + 15) / 16 * 16, tv = (len + 31) / 32 * 32;
  gather_vnni(k_head, v_head, table, len, tk, tv, sc);
  sc.s.resize(NQ * tv);
  sc.p.resize(NQ * tv);
  sc.q.resize(NQ * D);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t m = std::min(R, rows - r0), nq = m * G, nq_pad = (nq + QB - 1) / QB * QB;
    const int64_t last = len - (rows - (r0 + m));  // tokens the group's last row attends
    const int64_t nk = (last + 15) / 16, npairs = (last + 31) / 32 * 16;
    for (int64_t x = 0; x < nq_pad; ++x)  // query x: row x / G, head x % G
      if (x < nq)
        std::memcpy(sc.q.data() + x * D, q + (r0 + x / G) * q_row_stride + (x % G) * D, D * 2);
      else
        std::memset(sc.q.data() + x * D, 0, D * 2);
    float inv_sum[NQ];
    for (int64_t x0 = 0; x0 < nq_pad; x0 += QB) {
      const uint16_t* qb = sc.q.data() + x0 * D;
      float* s = sc.s.data() + x0 * tv;
      int64_t c = 0;
      for (; c + 4 <= nk; c += 4) scores_dpbf16<4>(qb, sc.k.data(), tk, c, s, tv);
      switch (nk - c) {
        case 3: scores_dpbf16<3>(qb, sc.k.data(), tk, c, s, tv); break;
        case 2: scores_dpbf16<2>(qb, sc.k.data(), tk, c, s, tv); break;
        case 1: scores_dpbf16<1>(qb, sc.k.data(), tk, c, s, tv); break;
        default: break;
      }
      for (int64_t x = x0; x < x0 + QB; ++x)
        inv_sum[x] = softmax_bf16(sc.s.data() + x * tv, sc.p.data() + x * tv,
                                  x < nq ? last - (m - 1 - x / G) : 0, npairs * 2, scale);
      __m512 o[QB][D / 16];
      for (int64_t i = 0; i < QB; ++i)
        for (int64_t c4 = 0; c4 < D / 16; ++c4) o[i][c4] = _mm512_setzero_ps();
      const uint16_t* p = sc.p.data() + x0 * tv;
      for (int64_t u = 0; u < npairs; ++u) {  // token pair u: values [D][2]
        __m512bh vv[D / 16];
        for (int64_t c4 = 0; c4 < D / 16; ++c4)
          vv[c4] = (__m512bh)_mm512_loadu_si512(sc.v.data() + (u * D + 16 * c4) * 2);
        for (int64_t i = 0; i < QB; ++i) {
          const __m512bh pp = broadcast_pair(p + i * tv + 2 * u);
          for (int64_t c4 = 0; c4 < D / 16; ++c4) o[i][c4] = _mm512_dpbf16_ps(o[i][c4], pp, vv[c4]);
        }
      }
      for (int64_t i = 0; i < QB && x0 + i < nq; ++i) {
        const int64_t x = x0 + i;
        uint16_t* dst = out + (r0 + x / G) * out_row_stride + (x % G) * D;
        const __m512 inv = _mm512_set1_ps(inv_sum[x]);
        for (int64_t c4 = 0; c4 < D / 16; ++c4) store16(dst + 16 * c4, _mm512_mul_ps(o[i][c4], inv));
      }
    }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SHOAL_AMX 1
// AMX tiles (Intel Sapphire Rapids and later): the prefill kernel above with tile products,
// 16 query rows by 16 keys (or 16 output columns) by 32 pairs per tdpbf16ps; and the projections
// of small iterations (amx_linear, below). Measured on a 2-core Xeon with AMX: docs/engine.md.

// Linux hands out the AMX tile state only to processes that ask for it (arch_prctl).
bool amx_permitted() {
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

// `rows` consecutive query rows of one request (the last attends `len` tokens) against one K/V
// head, for its G query heads: q and out point at the first row's first of those heads.
template <int64_t G>
void attend_amx(const uint16_t* q, int64_t q_row_stride, const uint16_t* k_head,
                const uint16_t* v_head, const int64_t* table, int64_t rows, int64_t len,
                float scale, uint16_t* out, int64_t out_row_stride, VnniScratch& sc) {
  constexpr int64_t D = kVnniD, R = kVnniRows;
  const int64_t tk = (len + 15) / 16 * 16, tv = (len + 31) / 32 * 32;
  gather_vnni(k_head, v_head, table, len, tk, tv, sc);
  sc.s.resize(R * tv);
  sc.p.resize(R * tv);
  sc.q.resize(R * D);
  static const TileConfig config;
  _tile_loadconfig(&config);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t m = std::min(R, rows - r0);
    const int64_t last = len - (rows - (r0 + m));  // tokens the tile's last row attends
    const int64_t nk = (last + 15) / 16, nv = (last + 31) / 32;
    for (int64_t j = 0; j < G; ++j) {
      for (int64_t i = 0; i < R; ++i)
        if (i < m)
          std::memcpy(sc.q.data() + i * D, q + (r0 + i) * q_row_stride + j * D, D * sizeof(uint16_t));
        else
          std::memset(sc.q.data() + i * D, 0, D * sizeof(uint16_t));
      _tile_loadd(4, sc.q.data(), D * 2);
      _tile_loadd(5, sc.q.data() + 32, D * 2);
      for (int64_t c = 0; c < nk; ++c) {  // S[:, 16c : 16c + 16]
        _tile_zero(0);
        _tile_loadd(6, sc.k.data() + c * 16 * 2, tk * 4);
        _tile_loadd(7, sc.k.data() + (16 * tk + c * 16) * 2, tk * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 7);
        _tile_stored(0, sc.s.data() + c * 16, tv * 4);
      }
      float inv_sum[R];
      for (int64_t i = 0; i < R; ++i)
        inv_sum[i] = softmax_bf16(sc.s.data() + i * tv, sc.p.data() + i * tv,
                                  i < m ? last - (m - 1 - i) : 0, nv * 32, scale);
      _tile_zero(0);  // tmm0-3: O[:, 0:16], ..., O[:, 48:64]
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < nv; ++c) {
        _tile_loadd(4, sc.p.data() + c * 32, tv * 2);
        const uint16_t* vb = sc.v.data() + c * 16 * D * 2;  // token pairs 16c ...
        _tile_loadd(6, vb, D * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vb + 32, D * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, vb + 64, D * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, vb + 96, D * 4);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, sc.o, D * 4);
      _tile_stored(1, sc.o + 16, D * 4);
      _tile_stored(2, sc.o + 32, D * 4);
      _tile_stored(3, sc.o + 48, D * 4);
      for (int64_t i = 0; i < m; ++i) {
        uint16_t* dst = out + (r0 + i) * out_row_stride + j * D;
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        for (int64_t e = 0; e < D; e += 16) store16(dst + e, _mm512_mul_ps(load16(sc.o + i * D + e), inv));
      }
    }
  }
  _tile_release();
}
#endif

struct VnniScratch;  // defined where the prefill kernels are built

template <typename scalar_t>
void paged_attention_impl(Tensor& out, const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                          const Tensor& block_tables, const Tensor& query_start_loc,
                          const Tensor& seq_lens, double scale) {
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_pool.size(0), nb = k_pool.size(1), bs = k_pool.size(3);
  const int64_t g = hq / hkv, max_blocks = block_tables.size(1), num_seqs = seq_lens.size(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const scalar_t* qp = ptr<scalar_t>(q);
  const scalar_t* kp = ptr<scalar_t>(k_pool);
  const scalar_t* vp = ptr<scalar_t>(v_pool);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* op = ptr<scalar_t>(out);
  const float fscale = static_cast<float>(scale);
  using Fn = void (*)(const AttnItem<scalar_t>&);
  Fn one = nullptr, tile = nullptr;
#ifdef SHOAL_LANES
#define SHOAL_ATTEND(G, BS, D)                                                 \
  if (g == G && bs == BS && d == D) {                                          \
    one = attend16<scalar_t, G, D, 1>;                                         \
    tile = attend16<scalar_t, G, D, kTile>;                                    \
  }
#else
#define SHOAL_ATTEND(G, BS, D)                                                 \
  if (g == G && bs == BS && d == D) {                                          \
    one = attend<scalar_t, G, BS, D, 1>;                                       \
    tile = attend<scalar_t, G, BS, D, kTile>;                                  \
  }
#endif
  SHOAL_ATTEND(1, 16, 64)
  SHOAL_ATTEND(3, 16, 64)
  SHOAL_ATTEND(4, 16, 64)
  SHOAL_ATTEND(1, 16, 128)
  SHOAL_ATTEND(4, 16, 128)
#undef SHOAL_ATTEND

  // Work items (sequence, first row, rows): full tiles where a tile kernel exists, then rows one
  // by one. Costs vary with the tokens attended, so items are handed out dynamically, longest
  // first: with static halves, a thread that the OS preempts holds the other one at the end.
  // A request with more than kTile query rows (a prefill chunk) is one item per head for the
  // bfloat16-pair kernels, where they serve this shape: on AMX tiles where the CPU has them.
  using PrefillFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*,
                             const int64_t*, int64_t, int64_t, float, uint16_t*, int64_t,
                             VnniScratch&);
  PrefillFn prefill = nullptr;
  int64_t prefill_speedup = 1;  // against the kernels above, per token scored (measured)
#ifdef SHOAL_BF16_PAIRS
  if constexpr (std::is_same_v<scalar_t, uint16_t>) {
    if (d == kVnniD && bs == kVnniBS && qs1 == d) {
      if (g == 1) prefill = attend_dpbf16<1>;
      if (g == 3) prefill = attend_dpbf16<3>;
      if (g == 4) prefill = attend_dpbf16<4>;
      prefill_speedup = 2;
#ifdef SHOAL_AMX
      if (amx_permitted()) {
        if (g == 1) prefill = attend_amx<1>;
        if (g == 3) prefill = attend_amx<3>;
        if (g == 4) prefill = attend_amx<4>;
        prefill_speedup = 4;
      }
#endif
    }
  }
#endif
  struct Work { int64_t seq, row, rows, len, cost; bool vnni; };
  std::vector<Work> work;
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = starts[s], last = starts[s + 1];
    TORCH_CHECK(last > first && last - first <= lens[s], "sequence ", s, ": bad query rows");
    max_len = std::max(max_len, lens[s]);
    if (prefill && last - first > kTile) {
      work.push_back({s, first, last - first, lens[s], (last - first) * lens[s] / prefill_speedup, true});
      continue;
    }
    for (int64_t r = first; r < last;) {
      const int64_t rows = (tile && last - r >= kTile) ? kTile : 1;
      const int64_t len = lens[s] - (last - (r + rows));
      work.push_back({s, r, rows, len, rows * len, false});
      r += rows;
    }
  }
  std::sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(work.size()) * hkv;
  TORCH_CHECK((max_len + bs - 1) / bs <= max_blocks,
              "a sequence attends more tokens than its block table holds");
#pragma omp parallel num_threads(at::get_num_threads())
  {
    alignas(64) float qf[kTile * kMaxGroup * kMaxHeadDim];
    std::vector<float> scores;
#ifdef SHOAL_BF16_PAIRS
    VnniScratch vnni_scratch;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const Work& w = work[item / hkv];
      const int64_t h = item % hkv, padded = (w.len + bs - 1) / bs * bs;
#ifdef SHOAL_BF16_PAIRS
      if (w.vnni) {
        if constexpr (std::is_same_v<scalar_t, uint16_t>)
          prefill(qp + w.row * qs0 + h * g * qs1, qs0, kp + h * nb * d * bs, vp + h * nb * bs * d,
                  tables + w.seq * max_blocks, w.rows, w.len, fscale,
                  op + (w.row * hq + h * g) * d, hq * d, vnni_scratch);
        continue;
      }
#endif
      for (int64_t r = 0; r < w.rows; ++r)
        for (int64_t j = 0; j < g; ++j)
          for (int64_t e = 0; e < d; ++e)
            qf[(r * g + j) * d + e] = to_float(qp[(w.row + r) * qs0 + (h * g + j) * qs1 + e]) * fscale;
      scores.resize(w.rows * g * padded);
      const AttnItem<scalar_t> it{qf, kp + h * nb * d * bs, vp + h * nb * bs * d,
                                  tables + w.seq * max_blocks, w.rows, w.len, padded, scores.data(),
                                  op + (w.row * hq + h * g) * d, hq * d};
      if (w.rows > 1)
        tile(it);
      else if (one)
        one(it);
      else
        attend_generic(it, g, bs, d);
    }
  }
}

Tensor paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                       const Tensor& block_tables, const Tensor& query_start_loc,
                       const Tensor& seq_lens, double scale) {
  for (auto* p : {&k_pool, &v_pool, &block_tables, &query_start_loc, &seq_lens})
    check_cpu_contiguous(*p, "paged_attention argument");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q [num_tokens, Hq, D] with unit stride along D");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.size(2) == q.size(2) &&
                  v_pool.size(3) == q.size(2) && v_pool.size(2) == k_pool.size(3),
              "k_pool [Hkv, num_blocks, D, block_size], v_pool [Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(q.size(1) % k_pool.size(0) == 0 && q.size(1) / k_pool.size(0) <= kMaxGroup,
              "Hq must be a multiple of Hkv, at most ", kMaxGroup, " times");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim && k_pool.size(3) <= kMaxBlockSize,
              "head_dim and block_size must be at most ", kMaxHeadDim, " and ", kMaxBlockSize);
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q and the pools must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start_loc.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "block_tables, query_start_loc and seq_lens must be int64");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1,
              "one block table and one length per sequence, num_seqs + 1 query starts");
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0),
              "query_start_loc must run from 0 to the number of query rows");
  Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  dispatch_storage(q.scalar_type(), "paged_attention", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    paged_attention_impl<scalar_t>(out, q, k_pool, v_pool, block_tables, query_start_loc,
                                   seq_lens, scale);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Fused elementwise ops of the non-attention chain. Eager torch runs each as 3-6 passes over the
// rows (casts, reductions, products); these make one.
// ---------------------------------------------------------------------------------------------

// x += delta (when given), then out = x / rms(x) * weight, cast to out's dtype. x is float32.
template <typename scalar_t, typename delta_t>
void add_rms_norm_impl(Tensor& out, Tensor& x, const Tensor* delta, const Tensor& weight, double eps) {
  const int64_t n = x.size(0), hsz = x.size(1);
  float* xp = x.data_ptr<float>();
  const delta_t* dp = delta ? ptr<delta_t>(*delta) : nullptr;
  const float* wp = weight.data_ptr<float>();
  scalar_t* op = ptr<scalar_t>(out);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + i * hsz;
      if (dp) {
        const delta_t* drow = dp + i * hsz;
#pragma omp simd
        for (int64_t e = 0; e < hsz; ++e) row[e] += to_float(drow[e]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = 0; e < hsz; ++e) ss += row[e] * row[e];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hsz) + feps);
      scalar_t* orow = op + i * hsz;
#pragma omp simd
      for (int64_t e = 0; e < hsz; ++e) orow[e] = from_float<scalar_t>(row[e] * inv * wp[e]);
    }
  });
}

Tensor add_rms_norm(Tensor x, const c10::optional<Tensor>& delta, const Tensor& weight, double eps,
                    at::ScalarType out_dtype) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "x (the residual stream) and weight must be float32");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x [n, H], weight [H]");
  if (delta) {
    check_cpu_contiguous(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
  }
  Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const Tensor* dptr = delta ? &*delta : nullptr;
  const auto ddt = delta ? delta->scalar_type() : out_dtype;
  TORCH_CHECK(ddt == out_dtype || ddt == at::kFloat, "delta must be float32 or the output dtype");
  dispatch_storage(out_dtype, "add_rms_norm", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    if (ddt == at::kFloat)
      add_rms_norm_impl<scalar_t, float>(out, x, dptr, weight, eps);
    else
      add_rms_norm_impl<scalar_t, scalar_t>(out, x, dptr, weight, eps);
  });
  return out;
}

// SwiGLU: out = silu(gate) * up, with gate_up = [gate | up] along the last dim.
// The vectorised loop divided by 1 + exp(-a) with vdivps, which made the op compute-bound (4.6x
// a copy of its bytes at 2,048 rows); the AVX-512 loop takes rcp14 and one Newton step instead
// (relative error ~1e-7 against the division, far below bfloat16's rounding).
#if defined(__AVX512F__)
inline __m512 silu16(__m512 a) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(a, inv);
}
#endif

template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* __restrict gate, const scalar_t* __restrict up,
                             scalar_t* __restrict out, int64_t n) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) store16(out + e, _mm512_mul_ps(silu16(load16(gate + e)), load16(up + e)));
#endif
  for (; e < n; ++e) {  // the tail (the whole row without AVX-512; GCC vectorises it)
    const float a = to_float(gate[e]);
    out[e] = from_float<scalar_t>(a / (1.f + fast_exp(-a)) * to_float(up[e]));
  }
}

template <typename scalar_t>
void silu_and_mul_impl(Tensor& out, const Tensor& gate_up) {
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  const scalar_t* gp = ptr<scalar_t>(gate_up);
  scalar_t* op = ptr<scalar_t>(out);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      silu_and_mul_row(gp + i * 2 * inter, gp + i * 2 * inter + inter, op + i * inter, inter);
  });
}

Tensor silu_and_mul(const Tensor& gate_up) {
  check_cpu_contiguous(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [n, 2 * intermediate]");
  Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_storage(gate_up.scalar_type(), "silu_and_mul", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_impl<scalar_t>(out, gate_up);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// W8A8: dynamic per-row int8 quantization of activations for int8 x int8 -> int32 matmuls
// (torch._int_mm, AVX-512 VNNI: twice bfloat16's multiply-adds per instruction), with weights
// quantized per output channel. The row scales are float32; results come back through
// `acc[i, j] * row_scale[i] * col_scale[j]`.
// ---------------------------------------------------------------------------------------------

// One row of k values to int8, q = round(x / scale) with scale = max |x| / 127 (1 for a zero
// row), plus `offset` (128 makes the levels unsigned, as vpdpbusd takes them); returns scale.
template <typename scalar_t, typename out_t>
inline float quantize_row(const scalar_t* row, int64_t k, out_t* out, int32_t offset) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t e = 0; e < k; ++e) {
    const float a = to_float(row[e]);
    const float mag = a < 0.f ? -a : a;
    m = mag > m ? mag : m;
  }
  const float s = m > 0.f ? m / 127.f : 1.f;
  const float inv = 1.f / s;
  // Round half to even by the 1.5 * 2^23 trick (|v| <= 127 here): std::nearbyint did not
  // vectorise.
#pragma omp simd
  for (int64_t e = 0; e < k; ++e) {
    const float v = to_float(row[e]) * inv;
    out[e] = static_cast<out_t>(static_cast<int32_t>((v + 12582912.f) - 12582912.f) + offset);
  }
  return s;
}

template <typename scalar_t>
void quantize_rows_impl(const Tensor& x, Tensor& q, Tensor& scale) {
  const int64_t n = x.size(0), k = x.size(1);
  const scalar_t* xp = ptr<scalar_t>(x);
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) sp[i] = quantize_row(xp + i * k, k, qp + i * k, 0);
  });
}

std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2, "x [rows, width]");
  Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  Tensor scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_storage(x.scalar_type(), "quantize_rows", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    quantize_rows_impl<scalar_t>(x, q, scale);
  });
  return {q, scale};
}

// out = acc * row_scale[:, None] * col_scale[None, :]; with `silu`, acc holds gate and up halves
// and out = silu(gate) * up, both dequantized first (the SwiGLU product of silu_and_mul).
template <typename scalar_t>
void dequantize_rows_impl(Tensor& out, const Tensor& acc, const Tensor& row_scale,
                          const Tensor& col_scale, bool silu) {
  const int64_t n = acc.size(0), width = acc.size(1), w = out.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  scalar_t* op = ptr<scalar_t>(out);
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* a = ap + i * width;
      scalar_t* o = op + i * w;
      const float r = rs[i];
      if (silu) {
#pragma omp simd
        for (int64_t e = 0; e < w; ++e) {
          const float g = static_cast<float>(a[e]) * (r * cs[e]);
          const float u = static_cast<float>(a[w + e]) * (r * cs[w + e]);
          o[e] = from_float<scalar_t>(g / (1.f + fast_exp(-g)) * u);
        }
      } else {
#pragma omp simd
        for (int64_t e = 0; e < w; ++e) o[e] = from_float<scalar_t>(static_cast<float>(a[e]) * (r * cs[e]));
      }
    }
  });
}

Tensor dequantize_rows(const Tensor& acc, const Tensor& row_scale, const Tensor& col_scale,
                       bool silu_and_mul, at::ScalarType out_dtype) {
  for (auto* p : {&acc, &row_scale, &col_scale}) check_cpu_contiguous(*p, "dequantize_rows argument");
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt, "acc [rows, width] int32");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && col_scale.scalar_type() == at::kFloat &&
                  row_scale.numel() == acc.size(0) && col_scale.numel() == acc.size(1),
              "float32 scales, one per row and one per column");
  TORCH_CHECK(!silu_and_mul || acc.size(1) % 2 == 0, "silu_and_mul needs [rows, 2 * intermediate]");
  Tensor out = at::empty({acc.size(0), silu_and_mul ? acc.size(1) / 2 : acc.size(1)},
                         acc.options().dtype(out_dtype));
  dispatch_storage(out_dtype, "dequantize_rows", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    dequantize_rows_impl<scalar_t>(out, acc, row_scale, col_scale, silu_and_mul);
  });
  return out;
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && !defined(__AVX512F__))
#define SHOAL_INT8_GEMV 1
// Weight-only int8 matmul for iterations of a few rows, where a step is bound by reading weights:
// the rows of x are quantized to int8 on the fly (per row, as llama.cpp's Q8 activations) and
// multiplied by the int8 weight with VNNI (vpdpbusd: 64 multiply-adds of unsigned x signed bytes
// per instruction), each weight byte loaded once for all rows. vpdpbusd takes the activations
// unsigned: they are stored as q + 128, and 128 * sum(w[n, :]) (w_sum) is taken off again.
//   y[i, n] = x_scale[i] * w_scale[n] * (sum_k (q[i, k] + 128) * w[n, k] - 128 * w_sum[n])
// AVX2 has no vpdpbusd, and vpmaddubsw's int16 pair sums would saturate on (q + 128) * w; there
// the sign goes onto the weight instead (llama.cpp's trick): |q| * (w * sign(q)) = q * w, a pair
// of them within 2 * 127 * 127, then vpmaddwd into int32, so the offset and w_sum are not used.
#if defined(__AVX512VNNI__)
template <int64_t M, typename scalar_t>
void int8_gemv_rows(const uint8_t* xu, const float* x_scale, const int8_t* w, const float* w_scale,
                    const int32_t* w_sum, scalar_t* y, int64_t k, int64_t n, int64_t begin,
                    int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int8_t* wr = w + r * k;
    __m512i acc[M];
    for (int64_t i = 0; i < M; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t c = 0; c < k; c += 64) {
      const __m512i wv = _mm512_loadu_si512(wr + c);
      for (int64_t i = 0; i < M; ++i)
        acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512(xu + i * k + c), wv);
    }
    for (int64_t i = 0; i < M; ++i)
      y[i * n + r] = from_float<scalar_t>(
          x_scale[i] * w_scale[r] *
          static_cast<float>(_mm512_reduce_add_epi32(acc[i]) - 128 * w_sum[r]));
  }
}

#else
template <int64_t M, typename scalar_t>
void int8_gemv_rows(const uint8_t* xu, const float* x_scale, const int8_t* w, const float* w_scale,
                    const int32_t*, scalar_t* y, int64_t k, int64_t n, int64_t begin,
                    int64_t end) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t r = begin; r < end; ++r) {
    const int8_t* wr = w + r * k;
    __m256i acc[M];
    for (int64_t i = 0; i < M; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t c = 0; c < k; c += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + c));
      for (int64_t i = 0; i < M; ++i) {
        const __m256i q = _mm256_xor_si256(  // the signed activations back from q + 128
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + i * k + c)), flip);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(wv, q));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
      }
    }
    for (int64_t i = 0; i < M; ++i) {
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[i]), _mm256_extracti128_si256(acc[i], 1));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
      y[i * n + r] = from_float<scalar_t>(x_scale[i] * w_scale[r] *
                                          static_cast<float>(_mm_cvtsi128_si32(h)));
    }
  }
}
#endif

template <typename scalar_t>
void int8_gemv_impl(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& w_scale,
                    const Tensor& w_sum) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const scalar_t* xp = ptr<scalar_t>(x);
  std::vector<uint8_t> xu(m * k);
  std::vector<float> xs(m);
  for (int64_t i = 0; i < m; ++i) xs[i] = quantize_row(xp + i * k, k, xu.data() + i * k, 128);
  scalar_t* yp = ptr<scalar_t>(y);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* wsp = w_scale.data_ptr<float>();
  const int32_t* sump = w_sum.data_ptr<int32_t>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = 0; i0 < m; i0 += 4) {  // weights are read once per 4 rows of x
      const uint8_t* xi = xu.data() + i0 * k;
      const float* si = xs.data() + i0;
      scalar_t* yi = yp + i0 * n;
      switch (std::min<int64_t>(m - i0, 4)) {
        case 1: int8_gemv_rows<1>(xi, si, wp, wsp, sump, yi, k, n, begin, end); break;
        case 2: int8_gemv_rows<2>(xi, si, wp, wsp, sump, yi, k, n, begin, end); break;
        case 3: int8_gemv_rows<3>(xi, si, wp, wsp, sump, yi, k, n, begin, end); break;
        default: int8_gemv_rows<4>(xi, si, wp, wsp, sump, yi, k, n, begin, end); break;
      }
    }
  });
}

Tensor int8_gemv(const Tensor& x, const Tensor& w, const Tensor& w_scale, const Tensor& w_sum) {
  for (auto* p : {&x, &w, &w_scale, &w_sum}) check_cpu_contiguous(*p, "int8_gemv argument");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % 64 == 0,
              "x [rows, K] and w [N, K] with K a multiple of 64");
  TORCH_CHECK(w.scalar_type() == at::kChar && w_scale.scalar_type() == at::kFloat &&
                  w_sum.scalar_type() == at::kInt && w_scale.numel() == w.size(0) &&
                  w_sum.numel() == w.size(0),
              "int8 w, float32 w_scale and int32 w_sum, one per output channel");
  Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  dispatch_storage(x.scalar_type(), "int8_gemv", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    int8_gemv_impl<scalar_t>(y, x, w, w_scale, w_sum);
  });
  return y;
}
#endif

#ifdef SHOAL_LANES
// ---------------------------------------------------------------------------------------------
// Weight-only int8 and int4 matmuls for iterations of a few rows, activations kept in float32:
// the few-row path of `--quantization int8 / int4` where the engine serves float32 (CPUs without
// bfloat16 instructions). There a decode step is bound by reading weights, and torch's
// `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` took 50 and 126 ms a single-stream step
// against 27 ms unquantized (2-core Xeon, docs/benchmarks.md session 7).
//
// The weights hold 16 output channels in the 16 lanes of a vector ("lanes" layout): a weight
// vector is widened to float32 and multiplied by one broadcast activation, so no horizontal sums
// are needed and scales apply lane by lane.
//   int8: w [N/16][K][16] int8 (lane c of group g at input k: channel 16g + c);
//         y[i, n] = scale[n] * sum_k w[n, k] x[i, k]
//   int4: w [N/16][K/32][16][16] uint8: byte j of lane c in block b holds the levels of inputs
//         32b + j (low nibble) and 32b + 16 + j (high nibble); scale_min [N/16][K/32][2][16]
//         float16, each block's 16 scales then 16 minimums (GGUF Q4_1's scheme):
//         y[i, n] = sum_b scale[n, b] * sum_{k in b} q[n, k] x[i, k] + min[n, b] * sum_{k in b} x[i, k]
// Two groups (32 channels) go together and up to kLaneRows rows share each widened weight vector;
// more rows go kLaneRows at a time over the same group pair, whose weights are then in cache.
// The kernels are written once on Lanes16 (above); only the register budget differs between
// AVX-512 and AVX2 (kLaneRows, kLaneChains).
// ---------------------------------------------------------------------------------------------

// int8 weights (scaled per channel at the end) or float32 ones (`scale` null).
inline Lanes16 load_weights(const int8_t* p) { return Lanes16::load_int8(p); }
inline Lanes16 load_weights(const float* p) { return Lanes16::load(p); }

// Accumulators of lanes_rows and q4_lanes_rows: [input mod kLaneChains][row][group], so that the
// two sum in the same order.
template <int64_t M> using LaneAcc = Lanes16[kLaneChains][M][2];

// One input's weights of the two groups (a, b) times each row's x at that input (`x` points at
// row 0's; rows are k apart), into one chain's accumulators (`chain`: acc[input mod kLaneChains]).
template <int64_t M>
inline void lanes_step(Lanes16 (&chain)[M][2], const float* x, int64_t k, Lanes16 a, Lanes16 b) {
  for (int64_t i = 0; i < M; ++i) {
    const Lanes16 xv = Lanes16::all(x[i * k]);
    chain[i][0] = fmadd(a, xv, chain[i][0]);
    chain[i][1] = fmadd(b, xv, chain[i][1]);
  }
}

// The chains summed, times each channel's scale (if any), into y's groups g and g + 1.
template <int64_t M>
inline void lanes_store(const LaneAcc<M>& acc, const float* scale, float* y, int64_t n, int64_t g) {
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < M; ++i) {
      Lanes16 sum = acc[0][i][h];
      for (int64_t p = 1; p < kLaneChains; ++p) sum = sum + acc[p][i][h];
      if (scale) sum = sum * Lanes16::load(scale + (g + h) * 16);
      sum.store(y + i * n + (g + h) * 16);
    }
  }
}

template <int64_t M, typename W>
void lanes_rows(const float* x, const W* w, const float* scale, float* y, int64_t k, int64_t n,
                int64_t g) {
  const W* w0 = w + g * k * 16;
  const W* w1 = w0 + k * 16;
  LaneAcc<M> acc;
  for (auto& a : acc)
    for (auto& r : a) r[0] = r[1] = Lanes16::zero();
  for (int64_t c = 0; c < k; c += kLaneChains)
    for (int64_t p = 0; p < kLaneChains; ++p)
      lanes_step<M>(acc[p], x + c + p, k, load_weights(w0 + (c + p) * 16),
                    load_weights(w1 + (c + p) * 16));
  lanes_store<M>(acc, scale, y, n, g);
}

#if defined(__AVX512F__)
// float32 weights rebuilt from GGUF's 4-bit levels (see q4_linear below for the scheme): rows of
// x against channel groups g and g + 1, with lanes_rows' chains and order, so the result is
// f32_linear's to the bit (d q + m is exact in one FMA, as the loader's float32 weight is).
// `w` is q4_lanes_linear's layout: per 16-channel group and 32 inputs, d[16] and m[16] float16,
// then 16 vectors of 16 bytes, byte j of vector s holding channel j's levels at inputs 2 s (low
// nibble) and 2 s + 1 (high).
template <int64_t M>
void q4_lanes_rows(const float* x, const uint8_t* w, float* y, int64_t k, int64_t n, int64_t g) {
  const int64_t block_bytes = k / 32 * kQ4GroupBytes;
  const uint8_t* w0 = w + g * block_bytes;
  const uint8_t* w1 = w0 + block_bytes;
  LaneAcc<M> acc;
  for (auto& a : acc)
    for (auto& r : a) r[0] = r[1] = Lanes16::zero();
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* b0 = w0 + b * kQ4GroupBytes;
    const uint8_t* b1 = w1 + b * kQ4GroupBytes;
    const auto half = [](const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); };
    const Lanes16 d0 = Lanes16::load_half(half(b0)), m0 = Lanes16::load_half(half(b0 + 32));
    const Lanes16 d1 = Lanes16::load_half(half(b1)), m1 = Lanes16::load_half(half(b1 + 32));
    for (int64_t s = 0; s < 16; ++s) {
      Lanes16 q0[2], q1[2];  // levels of inputs 2 s and 2 s + 1
      Lanes16::load_nibbles(b0 + 64 + 16 * s, q0[0], q0[1]);
      Lanes16::load_nibbles(b1 + 64 + 16 * s, q1[0], q1[1]);
      for (int64_t e = 0; e < 2; ++e)  // input 32 b + 2 s + e, an even one first
        lanes_step<M>(acc[e % kLaneChains], x + 32 * b + 2 * s + e, k, fmadd(q0[e], d0, m0),
                      fmadd(q1[e], d1, m1));
    }
  }
  lanes_store<M>(acc, nullptr, y, n, g);
}

#else
// The AVX2 form of q4_lanes_rows. 16 ymm registers cannot hold its accumulators, the two
// groups' d and m and the levels being widened at once: GCC spilled accumulators to the stack,
// a store and a reload on every multiply-add chain. Here a block's d and m are widened once into
// a small buffer that the weight-rebuilding multiply-adds read as memory operands, so registers
// hold the accumulators -- M rows x G groups x 2 halves, at most 8, what two FMA pipes of 4
// cycles' latency need in flight -- and the levels being widened. Each channel's chain runs over
// its inputs in order from zero, as f32_linear's (kLaneChains = 1 on AVX2): the same bits.
// SmolLM2's 120 projections on a 2-core Zen 3, ms, against q4_lanes_rows: 1 row 8.4 / 8.7,
// 2 rows 9.3 / 10.2, 4 rows 12.5 / 19.1, 8 rows 30 / 42 (docs/benchmarks.md, session 22).
template <int64_t M, int64_t G>
void q4_lanes_tile(const float* x, const uint8_t* w, float* y, int64_t k, int64_t n, int64_t g) {
  static_assert(M * G * 2 <= 8, "accumulators beyond 8 ymm registers spill");
  const int64_t nb = k / 32, group_bytes = nb * kQ4GroupBytes;
  const __m256i low = _mm256_set1_epi32(15);
  alignas(32) float dm[G][2][16];  // [group][d, m][channel]: the block's, widened
  // The loops over rows, groups and halves are unrolled outright (pragmas), so that acc is
  // indexed by constants only and lives in registers rather than in a stack array.
  __m256 acc[M][G][2];
#pragma GCC unroll 8
  for (auto& r : acc)
    for (auto& h : r) h[0] = h[1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[G];
#pragma GCC unroll 8
    for (int64_t h = 0; h < G; ++h) {
      blk[h] = w + (g + h) * group_bytes + b * kQ4GroupBytes;
#pragma GCC unroll 4
      for (int64_t t = 0; t < 4; ++t)
        _mm256_store_ps(&dm[h][t / 2][8 * (t % 2)],
                        _mm256_cvtph_ps(_mm_loadu_si128(
                            reinterpret_cast<const __m128i*>(blk[h] + 16 * t))));
    }
    const float* xb = x + 32 * b;
#pragma GCC unroll 1
    for (int64_t s = 0; s < 16; ++s) {
      // d and m are read from memory at every step: GCC would otherwise hoist them into
      // registers, pushing the accumulators out. The empty asm hides that the pointer is fixed.
      const float* dmp = &dm[0][0][0];
      asm("" : "+r"(dmp));
#pragma GCC unroll 8
      for (int64_t h = 0; h < G; ++h) {
        const uint8_t* p = blk[h] + 64 + 16 * s;
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
        // [input 2 s + e][channels 0-7, 8-15]: low nibbles, then high
        const __m256i q[2][2] = {{_mm256_and_si256(a, low), _mm256_and_si256(c, low)},
                                 {_mm256_srli_epi32(a, 4), _mm256_srli_epi32(c, 4)}};
#pragma GCC unroll 2
        for (int64_t e = 0; e < 2; ++e)
#pragma GCC unroll 2
          for (int64_t half = 0; half < 2; ++half) {
            const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[e][half]),
                                              _mm256_load_ps(dmp + 32 * h + 8 * half),
                                              _mm256_load_ps(dmp + 32 * h + 16 + 8 * half));
#pragma GCC unroll 8
            for (int64_t i = 0; i < M; ++i)
              acc[i][h][half] = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(xb + i * k + 2 * s + e),
                                                acc[i][h][half]);
          }
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int64_t h = 0; h < G; ++h)
#pragma GCC unroll 2
      for (int64_t half = 0; half < 2; ++half)
        _mm256_storeu_ps(y + i * n + (g + h) * 16 + 8 * half, acc[i][h][half]);
}
#endif

template <int64_t M>
void int4_lanes_rows(const float* x, const float* x_sum, const uint8_t* w, const uint16_t* sm,
                     float* y, int64_t k, int64_t n, int64_t g) {
  const int64_t nb = k / 32;
  Lanes16 acc[M][2];
  for (auto& r : acc) r[0] = r[1] = Lanes16::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[2] = {w + (g * nb + b) * 256, w + ((g + 1) * nb + b) * 256};
    Lanes16 t[M][2][2];  // [row][group][low / high nibbles]: a block's sums before its scale
    for (auto& r : t)
      for (auto& h : r) h[0] = h[1] = Lanes16::zero();
    for (int64_t j = 0; j < 16; ++j) {
      Lanes16 lo[2], hi[2];
      for (int64_t h = 0; h < 2; ++h) Lanes16::load_nibbles(wb[h] + j * 16, lo[h], hi[h]);
      for (int64_t i = 0; i < M; ++i) {
        const Lanes16 xl = Lanes16::all(x[i * k + b * 32 + j]);
        const Lanes16 xh = Lanes16::all(x[i * k + b * 32 + 16 + j]);
        for (int64_t h = 0; h < 2; ++h) {
          t[i][h][0] = fmadd(lo[h], xl, t[i][h][0]);
          t[i][h][1] = fmadd(hi[h], xh, t[i][h][1]);
        }
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      const uint16_t* s = sm + ((g + h) * nb + b) * 32;
      const Lanes16 scl = Lanes16::load_half(s), mn = Lanes16::load_half(s + 16);
      for (int64_t i = 0; i < M; ++i) {
        acc[i][h] = fmadd(scl, t[i][h][0] + t[i][h][1], acc[i][h]);
        acc[i][h] = fmadd(mn, Lanes16::all(x_sum[i * nb + b]), acc[i][h]);
      }
    }
  }
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < M; ++i) acc[i][h].store(y + i * n + (g + h) * 16);
}

// Each row's sums over blocks of 32 inputs: x [rows, K] float32 -> [rows, K/32].
std::vector<float> block_sums(const float* x, int64_t m, int64_t k) {
  std::vector<float> sums(m * (k / 32));
  for (int64_t b = 0; b < m * (k / 32); ++b) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < 32; ++e) s += x[b * 32 + e];
    sums[b] = s;
  }
  return sums;
}

// Calls `fn(std::integral_constant<int64_t, rows>)` for 1 <= rows <= M.
template <int64_t M = kLaneRows, typename Fn> void with_row_count(int64_t rows, Fn&& fn) {
  if constexpr (M > 1)
    if (rows < M) return with_row_count<M - 1>(rows, fn);
  fn(std::integral_constant<int64_t, M>{});
}

// Runs `rows_fn<M>(row_offset, group)` over every group pair and every kLaneRows rows of x.
template <typename RowsFn>
void for_lane_tiles(int64_t m, int64_t n, RowsFn&& rows_fn) {
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair)
      for (int64_t i0 = 0; i0 < m; i0 += kLaneRows)
        with_row_count(std::min<int64_t>(m - i0, kLaneRows),
                       [&](auto rows) { rows_fn(rows, i0, 2 * pair); });
  });
}

void check_lanes_input(const Tensor& x, const Tensor& w, int64_t k, const char* name) {
  check_cpu_contiguous(x, name);
  check_cpu_contiguous(w, name);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && k % 32 == 0,
              name, ": x [rows, K] with K a multiple of 32 matching the weight's");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              name, ": x float32 or bfloat16");
}

// The shared frame of the lanes matmuls: x in float32, y `[M, N]` float32 filled by
// `rows_fn(rows, x_rows, y_rows, g)` for each tile of rows and pair of channel groups (see
// for_lane_tiles), returned in x's dtype.
template <class RowsFn>
Tensor lanes_matmul(const Tensor& x, int64_t n, RowsFn&& rows_fn) {
  const int64_t k = x.size(1), m = x.size(0);
  const Tensor xf = x.to(at::kFloat);
  Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_lane_tiles(m, n, [&](auto rows, int64_t i0, int64_t g) {
    rows_fn(rows, xp + i0 * k, yp + i0 * n, g);
  });
  return y.to(x.scalar_type());
}

Tensor int8_linear(const Tensor& x, const Tensor& w, const Tensor& scale) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kChar,
              "int8_linear: w [N/16, K, 16] int8");
  const int64_t k = w.size(1), n = w.size(0) * 16;
  check_lanes_input(x, w, k, "int8_linear");
  check_cpu_contiguous(scale, "int8_linear scale");
  TORCH_CHECK(n % 32 == 0 && scale.scalar_type() == at::kFloat && scale.numel() == n,
              "int8_linear: N a multiple of 32 and float32 scale [N]");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return lanes_matmul(x, n, [&](auto rows, const float* xr, float* yr, int64_t g) {
    lanes_rows<decltype(rows)::value>(xr, wp, sp, yr, k, n, g);
  });
}

// float32 weights in the lanes layout: where the engine serves float32, oneDNN's prepacked
// matmul reads a decode step's weights at about 13 GB/s on a 2-core Zen 3, half what the cores
// can stream.
Tensor f32_linear(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.scalar_type() == at::kFloat,
              "f32_linear: w [N/16, K, 16] float32");
  const int64_t k = w.size(1), n = w.size(0) * 16;
  check_lanes_input(x, w, k, "f32_linear");
  TORCH_CHECK(n % 32 == 0, "f32_linear: N a multiple of 32");
  const float* wp = w.data_ptr<float>();
  return lanes_matmul(x, n, [&](auto rows, const float* xr, float* yr, int64_t g) {
    lanes_rows<decltype(rows)::value>(xr, wp, static_cast<const float*>(nullptr), yr, k, n, g);
  });
}

#if !defined(__AVX512F__)
// Groups a q4_lanes_tile of M rows takes (as many as keep 8 accumulators).
template <int64_t M> constexpr int64_t kQ4TileGroups = M == 1 ? 4 : M == 2 ? 2 : 1;

// q4_lanes_linear's work on AVX2: each thread takes a contiguous run of channel-group pairs,
// walks it 4 groups (64 channels) at a time and, within those, every chunk of up to 4 rows in
// tiles of kQ4TileGroups<rows> groups, so a chunk after the first finds the levels in cache.
void q4_lanes_tiles(const float* x, const uint8_t* w, float* y, int64_t m, int64_t k, int64_t n) {
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g0 = 2 * begin; g0 < 2 * end; g0 += 4) {
      const int64_t g1 = std::min<int64_t>(g0 + 4, 2 * end);
      for (int64_t i0 = 0; i0 < m; i0 += 4)
        with_row_count<4>(std::min<int64_t>(m - i0, 4), [&](auto rows) {
          constexpr int64_t M = decltype(rows)::value, G = kQ4TileGroups<M>;
          const float* xr = x + i0 * k;
          float* yr = y + i0 * n;
          for (int64_t g = g0; g < g1; g += G) {
            if constexpr (G == 4)
              if (g1 - g < 4) {  // a run's last pair
                q4_lanes_tile<M, 2>(xr, w, yr, k, n, g);
                break;
              }
            q4_lanes_tile<M, G>(xr, w, yr, k, n, g);
          }
        });
    }
  });
}
#endif

// y = x W^T for x `[M, K]` float32 or bfloat16 against W's 4-bit levels `packed`
// `[N / 16, K / 32, kQ4GroupBytes]` uint8 (q4_lanes_rows' layout); returns `[M, N]` in x's dtype:
// f32_linear's result over the float32 weight the levels stand for, bit for bit.
Tensor q4_lanes_linear(const Tensor& x, const Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kQ4GroupBytes &&
              packed.scalar_type() == at::kByte,
              "q4_lanes_linear: packed weight [N/16, K/32, ", kQ4GroupBytes, "] uint8");
  const int64_t k = packed.size(1) * 32, n = packed.size(0) * 16;
  check_lanes_input(x, packed, k, "q4_lanes_linear");
  TORCH_CHECK(n % 32 == 0, "q4_lanes_linear: N a multiple of 32");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
#if defined(__AVX512F__)
  return lanes_matmul(x, n, [&](auto rows, const float* xr, float* yr, int64_t g) {
    q4_lanes_rows<decltype(rows)::value>(xr, wp, yr, k, n, g);
  });
#else
  const Tensor xf = x.to(at::kFloat);
  Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  q4_lanes_tiles(xf.data_ptr<float>(), wp, y.data_ptr<float>(), x.size(0), k, n);
  return y.to(x.scalar_type());
#endif
}

Tensor int4_linear(const Tensor& x, const Tensor& w, const Tensor& scale_min) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 16 && w.scalar_type() == at::kByte,
              "int4_linear: w [N/16, K/32, 16, 16] uint8");
  const int64_t k = w.size(1) * 32, n = w.size(0) * 16, m = x.size(0);
  check_lanes_input(x, w, k, "int4_linear");
  check_cpu_contiguous(scale_min, "int4_linear scale_min");
  TORCH_CHECK(n % 32 == 0 && scale_min.scalar_type() == at::kHalf &&
                  scale_min.numel() == n / 16 * (k / 32) * 32,
              "int4_linear: N a multiple of 32 and float16 scale_min [N/16, K/32, 2, 16]");
  const Tensor xf = x.to(at::kFloat);
  Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const std::vector<float> x_sum = block_sums(xp, m, k);
  const float* xs = x_sum.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* smp = static_cast<const uint16_t*>(scale_min.data_ptr());
  float* yp = y.data_ptr<float>();
  for_lane_tiles(m, n, [&](auto rows, int64_t i0, int64_t g) {
    int4_lanes_rows<decltype(rows)::value>(xp + i0 * k, xs + i0 * (k / 32), wp, smp,
                                           yp + i0 * n, k, n, g);
  });
  return y.to(x.scalar_type());
}
#endif

#if defined(__AVX2__) && (!defined(__AVX512F__) || defined(__AVX512VNNI__))
#define SHOAL_INT4_Q8 1
// ---------------------------------------------------------------------------------------------
// int4 weights (GGUF Q4_1's levels, scales and minimums) against int8 activations, for AVX2-only
// CPUs and those with AVX-512 VNNI (below). On AVX2 alone the lanes kernel above is bound by
// widening every weight to float32 (two conversions and two bit operations per 8 weights, for
// each FMA of 8 multiply-adds: 5.4 ms for SmolLM2's 120 projections at 1 row, 10 GB/s, on a
// 2-core Zen 3), while `vpmaddubsw`
// multiplies 32 unsigned levels by 32 signed activation bytes at once. Each row of x is
// quantized per block of 32 inputs, as llama.cpp's Q8 activations for its Q4 dot products:
//   x[i, k] ≈ d[i, b] * x8[i, k], |x8| <= 127, d = max |x| / 127 over the block;
//   y[i, n] = sum_b scale[n, b] * d[i, b] * sum_{k in b} q[n, k] x8[i, k] + min[n, b] * X[i, b]
// with X[i, b] the block's exact float32 sum. A level (<= 15) times a byte (|x8| <= 127) paired
// by vpmaddubsw stays within 3,810, so a block's 8 of them add up in int16 without saturating.
// Layout (pack_int4_quads, worker/linear.py): w [N/8][K/32][4][8][4] uint8: 32-byte vector t of
// block b holds, for each of 8 output channels c, 4 bytes: inputs 32b + 4t + i (low nibble) and
// 32b + 16 + 4t + i (high nibble), i = 0..3; scale_min [N/8][K/32][2][8] float16.
// ---------------------------------------------------------------------------------------------
// Rows sharing the unpacked levels of a block (registers: 8 + 4). With VNNI this 8-channel
// AVX2 form still serves iterations of up to this many rows: at 1-4 rows it measured 2.9-3.9 ms
// for SmolLM2's 120 projections against 4.0-5.4 for the 16-channel form below (2-core Zen 4).
constexpr int64_t kQ8Rows = 4;

template <int64_t M>
void int4_q8_rows(const int8_t* x8, const float* d, const float* x_sum, const uint8_t* w,
                  const uint16_t* sm, float* y, int64_t k, int64_t n, int64_t g) {
  const int64_t nb = k / 32;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + (g * nb + b) * 128;
    __m256i lv[8];  // levels of quad-steps 0-3 (low nibbles) and 4-7 (high nibbles)
    for (int64_t t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * t));
      lv[t] = _mm256_and_si256(v, low);
      lv[4 + t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const uint16_t* smb = sm + (g * nb + b) * 16;
    const __m256 scl = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smb)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(smb + 8)));
    for (int64_t i = 0; i < M; ++i) {
      const int8_t* xb = x8 + i * k + 32 * b;
      __m256i s16 = _mm256_setzero_si256();
      for (int64_t t = 0; t < 8; ++t) {
        int32_t quad;
        std::memcpy(&quad, xb + (t < 4 ? 4 * t : 16 + 4 * (t - 4)), 4);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lv[t], _mm256_set1_epi32(quad)));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scl, _mm256_set1_ps(d[i * nb + b])), acc[i]);
      acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x_sum[i * nb + b]), acc[i]);
    }
  }
  for (int64_t i = 0; i < M; ++i) _mm256_storeu_ps(y + i * n + 8 * g, acc[i]);
}

#if defined(__AVX512VNNI__)
#define SHOAL_INT4_Q8_VNNI 1
// With AVX-512 VNNI, `vpdpbusd` adds each channel's four byte products straight into its int32
// lane (AVX2 takes `vpmaddubsw`, an int16 add and a `vpmaddwd`), and a zmm register holds two
// 8-channel groups of the same layout side by side (g and g + 1: channels 8g..8g+15, stored as
// one vector), so each broadcast of four activation bytes feeds 16 channels. 32 registers let
// 8 rows share a block's unpacked levels. The arithmetic per channel is AVX2's, bit for bit.
constexpr int64_t kQ8VnniRows = 8;

template <int64_t M>
void int4_q8_rows_vnni(const int8_t* x8, const float* d, const float* x_sum, const uint8_t* w,
                       const uint16_t* sm, float* y, int64_t k, int64_t n, int64_t g) {
  const int64_t nb = k / 32;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[M];
  for (auto& a : acc) a = _mm512_setzero_ps();
  auto pair256 = [](const void* a, const void* b) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(static_cast<const __m256i*>(a))),
        _mm256_loadu_si256(static_cast<const __m256i*>(b)), 1);
  };
  auto pair_half = [](const uint16_t* a, const uint16_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w0 = w + (g * nb + b) * 128;
    const uint8_t* w1 = w + ((g + 1) * nb + b) * 128;
    __m512i lv[8];
    for (int64_t t = 0; t < 4; ++t) {
      const __m512i v = pair256(w0 + 32 * t, w1 + 32 * t);
      lv[t] = _mm512_and_si512(v, low);
      lv[4 + t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const uint16_t* s0 = sm + (g * nb + b) * 16;
    const uint16_t* s1 = sm + ((g + 1) * nb + b) * 16;
    const __m512 scl = pair_half(s0, s1), mn = pair_half(s0 + 8, s1 + 8);
    for (int64_t i = 0; i < M; ++i) {
      const int8_t* xb = x8 + i * k + 32 * b;
      __m512i s32 = _mm512_setzero_si512();
      for (int64_t t = 0; t < 8; ++t) {
        int32_t quad;
        std::memcpy(&quad, xb + (t < 4 ? 4 * t : 16 + 4 * (t - 4)), 4);
        s32 = _mm512_dpbusd_epi32(s32, lv[t], _mm512_set1_epi32(quad));
      }
      const __m512 dot = _mm512_cvtepi32_ps(s32);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scl, _mm512_set1_ps(d[i * nb + b])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x_sum[i * nb + b]), acc[i]);
    }
  }
  for (int64_t i = 0; i < M; ++i) _mm512_storeu_ps(y + i * n + 8 * g, acc[i]);
}
#endif

Tensor int4_q8_linear(const Tensor& x, const Tensor& w, const Tensor& scale_min) {
  TORCH_CHECK(w.dim() == 5 && w.size(2) == 4 && w.size(3) == 8 && w.size(4) == 4 &&
                  w.scalar_type() == at::kByte,
              "int4_q8_linear: w [N/8, K/32, 4, 8, 4] uint8");
  const int64_t k = w.size(1) * 32, n = w.size(0) * 8, m = x.size(0), nb = k / 32;
  check_lanes_input(x, w, k, "int4_q8_linear");
  check_cpu_contiguous(scale_min, "int4_q8_linear scale_min");
  TORCH_CHECK(scale_min.scalar_type() == at::kHalf && scale_min.numel() == n / 8 * nb * 16,
              "int4_q8_linear: float16 scale_min [N/8, K/32, 2, 8]");
  const Tensor xf = x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  // Each row's blocks of 32 inputs: int8 values, their scale and their exact sum. (Not through
  // quantize_row: its rounding, which GCC contracts into an FMA with the scaling, resolved other
  // near-ties, and with it the perplexity of 512 tokens of GPL-3 measured 2.6-3.4% higher here,
  // 19.17 / 20.47 against 18.65 / 19.93; docs/benchmarks.md, session 15.)
  std::vector<int8_t> x8(m * k);
  std::vector<float> d(m * nb), x_sum(m * nb);
  // (On both threads: a prefill iteration's inputs are millions of elements.)
  at::parallel_for(0, m * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const float* src = xp + blk * 32;
      float amax = 0.f, sum = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
      for (int64_t e = 0; e < 32; ++e) {
        amax = std::max(amax, std::fabs(src[e]));
        sum += src[e];
      }
      d[blk] = amax / 127.f;
      x_sum[blk] = sum;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t e = 0; e < 32; ++e)
        x8[blk * 32 + e] = static_cast<int8_t>(std::nearbyint(src[e] * inv));
    }
  });
  Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* smp = static_cast<const uint16_t*>(scale_min.data_ptr());
  float* yp = y.data_ptr<float>();
#ifdef SHOAL_INT4_Q8_VNNI
  if (n % 16 == 0 && m > kQ8Rows) {  // pairs of 8-channel groups (fewer rows: see above)
    at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair)
        for (int64_t i0 = 0; i0 < m; i0 += kQ8VnniRows)
          with_row_count<kQ8VnniRows>(std::min<int64_t>(m - i0, kQ8VnniRows), [&](auto rows) {
            int4_q8_rows_vnni<decltype(rows)::value>(x8.data() + i0 * k, d.data() + i0 * nb,
                                                     x_sum.data() + i0 * nb, wp, smp,
                                                     yp + i0 * n, k, n, 2 * pair);
          });
    });
    return y.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, n / 8, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t i0 = 0; i0 < m; i0 += kQ8Rows)
        with_row_count<kQ8Rows>(std::min<int64_t>(m - i0, kQ8Rows), [&](auto rows) {
          int4_q8_rows<decltype(rows)::value>(x8.data() + i0 * k, d.data() + i0 * nb,
                                               x_sum.data() + i0 * nb, wp, smp, yp + i0 * n, k, n, g);
        });
  });
  return y.to(x.scalar_type());
}
#endif

// RoPE (Su et al., 2021) in the "rotate half" layout, in place on the query and key heads of the
// fused QKV output: for each head, x1 = x[:D/2], x2 = x[D/2:];
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. cos_sin is [max_positions, D] float32 holding
// cos in its first half and sin in its second.
template <typename scalar_t>
void rope_impl(Tensor& qkv, const Tensor& positions, const Tensor& cos_sin, int64_t num_heads,
               int64_t head_dim) {
  const int64_t n = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  scalar_t* xp = ptr<scalar_t>(qkv);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cs + pos[i] * head_dim;
      const float* s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x1 = xp + i * width + h * head_dim;
        scalar_t* x2 = x1 + half;
#pragma omp simd
        for (int64_t e = 0; e < half; ++e) {
          const float a = to_float(x1[e]), b = to_float(x2[e]);
          x1[e] = from_float<scalar_t>(a * c[e] - b * s[e]);
          x2[e] = from_float<scalar_t>(b * c[e] + a * s[e]);
        }
      }
    }
  });
}

void rope_(Tensor qkv, const Tensor& positions, const Tensor& cos_sin, int64_t num_heads,
           int64_t head_dim) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(positions, "positions");
  check_cpu_contiguous(cos_sin, "cos_sin");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= num_heads * head_dim, "qkv [n, >= heads * D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == qkv.size(0),
              "one int64 position per row");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.size(1) == head_dim,
              "cos_sin [max_positions, D] float32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_sin.size(0), "position ", pos[i], " outside the RoPE table");
  dispatch_storage(qkv.scalar_type(), "rope", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    rope_impl<scalar_t>(qkv, positions, cos_sin, num_heads, head_dim);
  });
}

// A layer's attention from its fused QKV projection `[n, (Hq + 2 Hkv) D]`: RoPE on the query
// and key heads in place, the keys and values into the pools at `slot_mapping`, then
// paged_attention of the queries; returns `[n, Hq D]`. The same work as rope_, write_kv and
// paged_attention called in turn, in one call from Python: with the split and views between
// them, a single-stream decode step made seven calls a layer (about 15 us), 210 a step.
Tensor attend_qkv(Tensor qkv, const Tensor& positions, const Tensor& cos_sin, Tensor k_pool,
                  Tensor v_pool, const Tensor& slot_mapping, const Tensor& block_tables,
                  const Tensor& query_start_loc, const Tensor& seq_lens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv [n, (heads + 2 kv_heads) * head_dim]");
  rope_(qkv, positions, cos_sin, num_heads + num_kv_heads, head_dim);
  const int64_t n = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  const Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
  const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  write_kv(k, v, k_pool, v_pool, slot_mapping);
  return paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, scale);
}

// ---------------------------------------------------------------------------------------------
// The k largest entries of each row (k small), for the LM head's output. torch's topk and argmax
// along a 49,152-wide row took 2-3 ms for 32 rows here; this scans each row once, skipping any
// 64-entry chunk whose maximum cannot enter the current best k.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t>
void topk_rows_impl(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const int64_t rows = x.size(0), width = x.size(1);
  constexpr int64_t kChunk = 64;
  const scalar_t* xp = ptr<scalar_t>(x);
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = xp + r * width;
      float* best = vp + r * k;  // descending
      int64_t* where = ip + r * k;
      std::fill(best, best + k, -std::numeric_limits<float>::infinity());
      std::fill(where, where + k, 0);
      for (int64_t c0 = 0; c0 < width; c0 += kChunk) {
        const int64_t c1 = std::min(width, c0 + kChunk);
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t i = c0; i < c1; ++i) {
          const float v = to_float(row[i]);
          m = v > m ? v : m;
        }
        if (!(m > best[k - 1])) continue;
        for (int64_t i = c0; i < c1; ++i) {
          const float v = to_float(row[i]);
          if (!(v > best[k - 1])) continue;
          int64_t pos = k - 1;  // insertion into the sorted best list; ties keep the lower index
          while (pos > 0 && v > best[pos - 1]) {
            best[pos] = best[pos - 1];
            where[pos] = where[pos - 1];
            --pos;
          }
          best[pos] = v;
          where[pos] = i;
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> topk_rows(const Tensor& x, int64_t k) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && k >= 1 && k <= x.size(1), "x [rows, width] and 1 <= k <= width");
  Tensor values = at::empty({x.size(0), k}, x.options().dtype(at::kFloat));
  Tensor indices = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
  dispatch_storage(x.scalar_type(), "topk_rows", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    topk_rows_impl<scalar_t>(x, k, values, indices);
  });
  return {values, indices};
}

#ifdef SHOAL_BF16_PAIRS
// ---------------------------------------------------------------------------------------------
// bfloat16 projections `y = x W^T` against weights packed in pairs of input channels, the layout
// both AMX tiles (amx_linear) and AVX512_BF16 dot products (dp_linear), below, consume:
// `[N / 16][K / 32][16 pairs of K][16 columns][2]` (N and K multiples of 32), that is, for each
// block of 16 output channels its K / 2 pairs in order, each pair of the 16 channels one 64-byte
// vector (the B operand of tdpbf16ps and of vdpbf16ps).
// ---------------------------------------------------------------------------------------------
Tensor pack_weight_pairs(const Tensor& w) {
  check_cpu_contiguous(w, "weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "weight [N, K] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 32 == 0 && k % 32 == 0, "packed weights need N and K multiples of 32, got ",
              n, " x ", k);
  Tensor out = at::empty({n / 16, k / 32, 16, 16, 2}, w.options());
  const uint16_t* src = ptr<uint16_t>(w);
  uint16_t* dst = ptr<uint16_t>(out);
  at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < k / 32; ++kb) {
        uint16_t* tile = dst + (nb * (k / 32) + kb) * 512;
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t c = 0; c < 16; ++c)
            for (int64_t e = 0; e < 2; ++e)
              tile[(r * 16 + c) * 2 + e] = src[(nb * 16 + c) * k + kb * 32 + 2 * r + e];
      }
  });
  return out;
}

// x `[M, K]` bfloat16, contiguous, checked against a weight packed by pack_weight_pairs; N.
std::tuple<Tensor, int64_t> pair_linear_input(const Tensor& x_in, const Tensor& packed) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be on the CPU");
  Tensor x = x_in.contiguous();
  check_cpu_contiguous(packed, "packed weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "x and the weight must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 5 && packed.size(1) * 32 == x.size(1),
              "x [M, K] against a weight packed by pack_weight_pairs for K = ", packed.size(1) * 32);
  return {x, packed.size(0) * 16};
}
#endif

#ifdef SHOAL_AMX
// ---------------------------------------------------------------------------------------------
// bfloat16 projections on AMX tiles, `y = x W^T`, for iterations of up to about a thousand rows
// (worker/linear.py decides; oneDNN keeps larger ones). A decode iteration is bound by reading
// the weights (SmolLM2: 269 MB a step): oneDNN's kernels read them at about 22 GB/s at 1 row and
// take 40% longer at 64 rows. Here the weights lie in the order the tiles consume them, each
// thread streams its own contiguous share once, and every 1 KB weight tile serves up to 32 rows
// straight from memory (then the rest of the rows from cache), so a step stays near the memory's
// pace up to 64 rows. Weights packed by pack_weight_pairs (above).
// ---------------------------------------------------------------------------------------------

// A stored accumulator tile c (16 x 16 float32) into rows [16 i, 16 i + 16) (up to row m) and
// output channels [16 nb, 16 nb + 16) of y.
inline void store_rows(const float* c, uint16_t* y, int64_t m, int64_t n, int64_t i, int64_t nb) {
  const int64_t rows = std::min<int64_t>(16, m - 16 * i);
  for (int64_t r = 0; r < rows; ++r) store16(y + (16 * i + r) * n + nb * 16, load16(c + r * 16));
}
// (Tile numbers must be literals: _tile_stored is a macro naming the register.)
#define SHOAL_STORE_TILE(T, i, nb) \
  _tile_stored(T, c, 64);          \
  store_rows(c, y, m, n, i, nb)

// One pair of output blocks (weights w0, w1: K / 32 tiles each) for MB (1 or 2) blocks of 16
// rows of x: every tile of x loaded serves both weight tiles. Accumulators tmm0-3 are
// (rows 0-15, w0), (rows 16-31, w0), (rows 0-15, w1), (rows 16-31, w1). Meanwhile `pf_lines`
// 64-byte lines from `pf` (a slice of the next pair's weights) are asked for into L2, spread
// over the K / 32 steps.
template <int MB>
inline void amx_pair(const uint16_t* x, const uint16_t* w0, const uint16_t* w1, uint16_t* y,
                     int64_t m, int64_t k, int64_t n, int64_t nb, float* c, const char* pf,
                     int64_t pf_lines) {
  _tile_zero(0);
  _tile_zero(2);
  if (MB > 1) { _tile_zero(1); _tile_zero(3); }
  const int64_t kt = k / 32;
  int64_t due = 0;
  for (int64_t j = 0; j < kt; ++j) {
    _tile_loadd(6, w0 + j * 512, 64);
    _tile_loadd(7, w1 + j * 512, 64);
    _tile_loadd(4, x + j * 32, k * 2);
    prefetch_step<2>(pf, due, pf_lines, kt);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (MB > 1) {
      _tile_loadd(5, x + 16 * k + j * 32, k * 2);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  SHOAL_STORE_TILE(0, 0, nb);
  SHOAL_STORE_TILE(2, 0, nb + 1);
  if (MB > 1) {
    SHOAL_STORE_TILE(1, 1, nb);
    SHOAL_STORE_TILE(3, 1, nb + 1);
  }
}

// Rows of x per pass over the weights: they stay in L2 while every output block of the thread's
// range is computed for them.
constexpr int64_t kAmxRowBlock = 256;

// Output blocks [begin, end) (an even range) for all m rows of x (padded to 16-row tiles), 32
// rows at a time: past the first 32 the pair's weight tiles come from cache, not memory.
//
// Past 16 rows each pair also asks for the next pair's weights into L2, spread over its row
// tiles: the tile loads wait on the tile products before them (there are 8 tile registers and no
// renaming), so with more than one row tile the hardware prefetcher's stream fell behind. All of
// SmolLM2's 120 projections from DRAM, medians of interleaved runs (2-core Xeon with AMX): 32 rows
// 11.7 -> 10.9 ms, 48 rows 13.6 -> 12.7, 64 rows 14.7 -> 14.2, 128 rows 21.6 -> 20.9; W64
// in-process 2.88-2.95 -> 2.76-2.82 s. At 1-16 rows (one row tile, the stream already at the
// memory's pace) it cost 1-6%, so it is left out there.
void amx_linear_blocks(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t k,
                       int64_t n, int64_t begin, int64_t end) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t kt = k / 32;
  const int64_t pair = 2 * kt * 512;            // elements of a pair's weights
  const int64_t pair_lines = pair * 2 / 64;     // ... in 64-byte lines
  alignas(64) float c[16 * 16];
  for (int64_t m0 = 0; m0 < m; m0 += kAmxRowBlock) {  // these rows of x stay in cache
    const int64_t m1 = std::min(m, m0 + kAmxRowBlock);
    const int64_t tiles = (m1 - m0 + 31) / 32;
    for (int64_t nb = begin; nb < end; nb += 2) {
      const uint16_t* w0 = w + nb * kt * 512;
      const char* pf = m > 16 && nb + 2 < end ? reinterpret_cast<const char*>(w0 + pair) : nullptr;
      int64_t t = 0;
      for (int64_t r = m0; r < m1; r += 32, ++t) {
        const int64_t lines = pf ? share(pair_lines, tiles, t) : 0;
        if (m - r > 16)
          amx_pair<2>(x + r * k, w0, w0 + kt * 512, y + r * n, m - r, k, n, nb, c, pf, lines);
        else
          amx_pair<1>(x + r * k, w0, w0 + kt * 512, y + r * n, m - r, k, n, nb, c, pf, lines);
        if (pf) pf += 64 * lines;
      }
    }
  }
  _tile_release();
}
#undef SHOAL_STORE_TILE

// y = x W^T for x `[M, K]` bfloat16 (any M >= 1) against W packed by pack_weight_pairs; returns
// `[M, N]` bfloat16 (float32 accumulation).
Tensor amx_linear(const Tensor& x_in, const Tensor& packed) {
  const auto [x, n] = pair_linear_input(x_in, packed);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "amx_linear needs at least one row");
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  const int mb = static_cast<int>((m + 15) / 16);
  // Rows padded to whole tiles with zeros (their products are never stored).
  Tensor xp = x;
  if (m % 16) {
    xp = at::zeros({16 * mb, k}, x.options());
    xp.narrow(0, 0, m).copy_(x);
  }
  Tensor y = at::empty({m, n}, x.options());
  const uint16_t* xq = ptr<uint16_t>(xp);
  const uint16_t* wq = ptr<uint16_t>(packed);
  uint16_t* yq = ptr<uint16_t>(y);
  // One contiguous run of output blocks per thread: each streams its share of the weights once.
  const int64_t pairs = n / 32, threads = at::get_num_threads();
  at::parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    amx_linear_blocks(xq, wq, yq, m, k, n, 2 * begin, 2 * end);
  });
  return y;
}
#endif

#ifdef SHOAL_BF16_PAIRS

// y = x W^T with dot products on 4-byte groups of the reduced dimension, for CPUs without AMX:
// `vdpbf16ps` on pairs of bfloat16 (dp_linear) and `vpdpbusd` on quads of int8 (vnni_linear,
// W8A8). The weights are packed `[N / 16][K / group][16][group]`, so one 64-byte vector holds a
// group of input channels for 16 output channels; a 4-byte group of x broadcast to all lanes
// against it adds 32 (bfloat16) or 64 (int8) products. A tile is MR rows x NR blocks of
// accumulators; each weight vector loaded serves MR rows, and the weights stream from memory
// about once per pass of rows, as in a GEMV. Pointers are bytes and a "step" is one 4-byte group
// of every row (K / 2 for bfloat16, K / 4 for int8), so the loop, the prefetch and the work split
// below serve both.
constexpr int64_t kDpRows = 8, kDpBlocks = 3;
constexpr int64_t kDpSiluRows = 6, kDpSiluBlocks = 4;

// The arithmetic of a tile (`Op` below): its accumulator and operand vector types, and one
// multiply-add of a broadcast 4-byte group of x against a vector of weights. Here bfloat16
// pairs into float32 accumulators.
struct Bf16Pairs {
  using Acc = __m512;
  using Vec = __m512bh;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Vec load(const char* w) { return (Vec)_mm512_loadu_si512(w); }
  static Vec group(const char* x) { return broadcast_pair(reinterpret_cast<const uint16_t*>(x)); }
  static Acc add(Acc acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};

#if defined(__AVX512VNNI__)
// Quads of unsigned x bytes against signed weight bytes into int32 accumulators (vpdpbusd).
// W8A8's activations are signed; vnni_linear takes them offset by 128 (their top bit flipped),
// and its store subtracts 128 times each output channel's weight sum: exact in int32. The types
// are the builtin's own `__v16si`: with `__m512i` accumulators cast at each use GCC 12 kept the
// 24 of a tile in memory (a loop from L1 on a Zen 4: 176 GOP/s, against 438; the peak is 459).
struct Uint8Quads {
  using Acc = __v16si;
  using Vec = __v16si;
  static Acc zero() { return (Acc)_mm512_setzero_si512(); }
  static Vec load(const char* w) { return (Vec)_mm512_loadu_si512(w); }
  static Vec group(const char* x) { return (Vec)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }
  static Acc add(Acc acc, Vec x, Vec w) { return __builtin_ia32_vpdpbusd_v16si(acc, x, w); }
};
#endif

// The output of a tile: MR rows x NR blocks of float32 accumulators, rows from r and blocks from
// nb. DpStore rounds them to bfloat16 in y `[M, N]`.
struct DpStore {
  uint16_t* y;
  int64_t n;  // width of y
  template <int64_t MR, int64_t NR>
  void operator()(const __m512 (&acc)[MR][NR], int64_t r, int64_t nb) const {
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r + i) * n + (nb + j) * 16),
                            (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
  }
};

// SwiGLU's product straight from the accumulators of a fused gate/up projection whose blocks
// alternate gate and up (pack_weight_pairs of swiglu_interleave's order): block 2c holds gate
// channels 16c..16c+15 and block 2c + 1 the same up channels, so y `[M, N / 2]` gets
// silu(gate) * up computed in float32 and rounded once. The `[M, N]` gate/up product is never
// written: at 2,048 rows that is 12 MB out and back per layer, which the separate
// silu_and_mul pass spent 0.75 ms a layer on.
struct DpSiluStore {
  uint16_t* y;
  int64_t n;  // width of y: N / 2
  template <int64_t MR, int64_t NR>
  void operator()(const __m512 (&acc)[MR][NR], int64_t r, int64_t nb) const {
    static_assert(NR % 2 == 0, "gate and up blocks come in pairs");
    for (int64_t i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; j += 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r + i) * n + (nb + j) / 2 * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu16(acc[i][j]), acc[i][j + 1])));
  }
};

// int32 accumulators of vnni_linear back to float32 for `Inner` (DpStore or DpSiluStore):
// (acc - 128 * col_sum) * (row_scale * col_scale), in the order dequantize_rows multiplies, so
// the two W8A8 paths give the same values.
template <class Inner>
struct DequantStore {
  const float* row_scale;  // [M]
  const float* col_scale;  // [N]
  const int32_t* col_sum;  // [N]
  Inner inner;
  template <int64_t MR, int64_t NR>
  void operator()(const __v16si (&acc)[MR][NR], int64_t r, int64_t nb) const {
    __m512 f[MR][NR];
    for (int64_t j = 0; j < NR; ++j) {
      const __m512 cs = _mm512_loadu_ps(col_scale + (nb + j) * 16);
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(col_sum + (nb + j) * 16), 7);
      for (int64_t i = 0; i < MR; ++i)
        f[i][j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)acc[i][j], offset)),
                                _mm512_mul_ps(_mm512_set1_ps(row_scale[r + i]), cs));
    }
    inner(f, r, nb);
  }
};

// MR rows from r of x against blocks [nb, nb + NR) of the weights. While the step loop runs it
// also asks for `pf_lines` 64-byte lines from `pf` (a slice of the next tile's weights) into L1,
// one every steps / pf_lines steps, so the requests spread over the tile's compute.
template <class Op, int64_t MR, int64_t NR, class Store>
inline void dp_linear_tile(const char* x, const char* w, int64_t row_bytes, int64_t r, int64_t nb,
                           const char* pf, int64_t pf_lines, const Store& store) {
  typename Op::Acc acc[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = Op::zero();
  const int64_t steps = row_bytes / 4;
  const char* xr = x + r * row_bytes;
  int64_t due = 0;
  for (int64_t p = 0; p < steps; ++p) {
    typename Op::Vec wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = Op::load(w + ((nb + j) * steps + p) * 64);
    prefetch_step<3>(pf, due, pf_lines, steps);
    for (int64_t i = 0; i < MR; ++i) {
      const typename Op::Vec xg = Op::group(xr + i * row_bytes + 4 * p);
      for (int64_t j = 0; j < NR; ++j) acc[i][j] = Op::add(acc[i][j], xg, wv[j]);
    }
  }
  store(acc, r, nb);
}

// The last `rem` (< MR) rows of a pass: a tile of exactly that many rows.
template <class Op, int64_t MR, int64_t NR, class Store>
inline void dp_linear_tail(int64_t rem, const char* x, const char* w, int64_t row_bytes, int64_t r,
                           int64_t nb, const char* pf, int64_t pf_lines, const Store& store) {
  if constexpr (MR > 0) {
    if (rem == MR) dp_linear_tile<Op, MR, NR>(x, w, row_bytes, r, nb, pf, pf_lines, store);
    else dp_linear_tail<Op, MR - 1, NR>(rem, x, w, row_bytes, r, nb, pf, pf_lines, store);
  }
}

// Row tiles over which the next weight tile's prefetch is spread. All of it in the first row
// tile, as before, asked for 55 KB at once from DRAM at the compute's pace; spread over up to 8
// (A/B in one process, SmolLM2's 120 projections from DRAM, 2-core Zen 5): 16 rows 7.32 -> 6.37
// ms, 32 rows 10.86 -> 10.05, 64 rows 17.73 -> 16.40, 128 rows 31.7 -> 30.6, 1-8 rows within
// noise; into L1 (prefetcht0) 2-5% ahead of L2.
constexpr int64_t kDpPrefetchSpread = 8;

// Rows [r0, r1) of x against blocks [nb, nb + NR): MR rows at a time, the weights (NR x 16 x
// row_bytes, 55 KB for bfloat16, K = 576 and NR = 3) staying in L1/L2 while the rows pass.
// Meanwhile the next tile's weights (`next`, or none) are prefetched, spread over the first
// kDpPrefetchSpread row tiles (the hardware prefetcher alone left 64-row iterations 10% slower).
template <class Op, int64_t MR, int64_t NR, class Store>
void dp_linear_rows(const char* x, const char* w, int64_t row_bytes, int64_t r0, int64_t r1,
                    int64_t nb, const char* next, const Store& store) {
  const int64_t tiles = (r1 - r0 + MR - 1) / MR;
  const int64_t spread = std::min(tiles, kDpPrefetchSpread);
  const int64_t lines = next != nullptr ? NR * row_bytes / 4 : 0;  // 64 bytes per step of a block
  const char* pf = next;
  // Row tile t asks for lines [t * lines / spread, (t + 1) * lines / spread).
  auto slice = [&](int64_t t) { return t < spread ? share(lines, spread, t) : 0; };
  int64_t r = r0, t = 0;
  for (; r + MR <= r1; r += MR, ++t) {
    dp_linear_tile<Op, MR, NR>(x, w, row_bytes, r, nb, pf, slice(t), store);
    pf += 64 * slice(t);
  }
  dp_linear_tail<Op, MR - 1, NR>(r1 - r, x, w, row_bytes, r, nb, pf, slice(t), store);
}

// Items [0, items) handed out to `threads` threads as they come free: `fn(item, next)` runs each,
// `next` being the item the same thread takes after it (items or more: none), claimed first so
// that `fn` can prefetch its weights (dp_linear_run below says why items, not halves).
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

// Bytes of x per pass over the weights: those rows stay in L2 (1 MB on Zen 5) while the
// weights pass; more rows are taken in several passes, each streaming the weights again.
constexpr int64_t kDpRowBytes = 256 << 10;
// Work items per thread in each pass (see dp_linear_run).
constexpr int64_t kDpItemsPerThread = 4;

// y = x W^T over `blocks` 16-channel output blocks, NR blocks to a tile, written by `store`;
// x is `m` rows of `row_bytes`, and a block of the weights 16 x row_bytes.
// The work is cut into items (a pass of rows x a group of tiles) that the threads take one at a
// time: on a machine whose cores the gateway, the scheduler and Redis also need, the thread that
// another process preempts holds back only its current items, where an even split up front made
// the other thread wait at the end of every matmul for the preempted one's whole half. Each
// thread claims its next item before it runs the current one, so the current item's last tile
// prefetches the next item's first weights: with items of 1-2 tiles (decode's projections) most
// tiles otherwise began with a cold read from DRAM (A/B in one process, SmolLM2's 120
// projections, 2-core Zen 5: 16 rows 5.87 -> 4.97 ms, 32 rows 8.98 -> 7.72, 64 rows 15.4 -> 14.2,
// 128 rows 29.1 -> 27.9; as fast as contiguous halves per thread).
template <class Op, int64_t MR, int64_t NR, class Store>
void dp_linear_run(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t blocks,
                   const Store& store) {
  const int64_t threads = at::get_num_threads();
  const int64_t block_bytes = 16 * row_bytes;
  const int64_t rows = std::max<int64_t>(MR, kDpRowBytes / row_bytes / MR * MR);
  const int64_t passes = (m + rows - 1) / rows;
  const int64_t tiles = (blocks + NR - 1) / NR;
  const int64_t per_group = std::max<int64_t>(1, tiles / (threads * kDpItemsPerThread));
  const int64_t groups = (tiles + per_group - 1) / per_group;
  const int64_t items = passes * groups;
  auto first_block = [&](int64_t item) { return item % groups * per_group * NR; };
  // Item `item`; `after` is the weights of the item this thread runs next (or null).
  auto run = [&](int64_t item, const char* after) {
    const int64_t r0 = item / groups * rows, r1 = std::min(m, r0 + rows);
    const int64_t b0 = first_block(item), b1 = std::min(blocks, b0 + per_group * NR);
    int64_t nb = b0;
    for (; nb + NR <= b1; nb += NR)
      dp_linear_rows<Op, MR, NR>(x, w, row_bytes, r0, r1, nb,
                                 nb + NR < b1 ? w + (nb + NR) * block_bytes : after, store);
    // The last blocks when NR does not divide them. N is a multiple of 32, so the blocks are
    // even: with an even NR (gate/up pairs) the rest is 2 blocks, never 1.
    if constexpr (NR > 2) {
      if (b1 - nb == 2) dp_linear_rows<Op, MR, 2>(x, w, row_bytes, r0, r1, nb, nullptr, store);
    }
    if constexpr (NR % 2 == 1) {
      if (b1 - nb == 1) dp_linear_rows<Op, MR, 1>(x, w, row_bytes, r0, r1, nb, nullptr, store);
    }
  };
  run_items(items, threads, [&](int64_t item, int64_t next) {
    run(item, next < items ? w + first_block(next) * block_bytes : nullptr);
  });
}

inline const char* bytes(const Tensor& t) { return static_cast<const char*>(t.data_ptr()); }

// y = x W^T for x `[M, K]` bfloat16 (any M) against W packed by pack_weight_pairs; returns
// `[M, N]` bfloat16 (float32 accumulation, rounded once).
Tensor dp_linear(const Tensor& x_in, const Tensor& packed) {
  const auto [x, n] = pair_linear_input(x_in, packed);
  const int64_t m = x.size(0), k = x.size(1);
  Tensor y = at::empty({m, n}, x.options());
  dp_linear_run<Bf16Pairs, kDpRows, kDpBlocks>(bytes(x), bytes(packed), m, 2 * k, n / 16,
                                               DpStore{ptr<uint16_t>(y), n});
  return y;
}

// silu(x G^T) * (x U^T) for x `[M, K]` bfloat16 against a fused gate/up weight `[2I, K]` whose
// 16-row blocks were interleaved (gate block c, then up block c) before pack_weight_pairs;
// returns `[M, I]` bfloat16 (float32 accumulation and SwiGLU, rounded once). 6 rows x 4 blocks
// of accumulators: two gate blocks, each beside its up block.
Tensor dp_linear_silu(const Tensor& x_in, const Tensor& packed) {
  const auto [x, n] = pair_linear_input(x_in, packed);
  const int64_t m = x.size(0), k = x.size(1);
  Tensor y = at::empty({m, n / 2}, x.options());
  dp_linear_run<Bf16Pairs, kDpSiluRows, kDpSiluBlocks>(bytes(x), bytes(packed), m, 2 * k, n / 16,
                                                       DpSiluStore{ptr<uint16_t>(y), n / 2});
  return y;
}

// ---------------------------------------------------------------------------------------------
// bfloat16 projections of a few rows from GGUF's 4-bit weights (Q4_0, Q4_1), with dp_linear's
// result to the bit. The file holds levels q (0-15) in groups of 32 input channels, each group
// with a scale d and a minimum m (float16; Q4_0: m = -8 d), and the engine's bfloat16 weight is
// bfloat16(float32(d) q + float32(m)): gguf's dequantization, then torch's rounding to nearest
// even. q4_linear rebuilds each 64-byte vector of pack_weight_pairs' layout from the levels in
// registers (d q is exact in float32, so one FMA rounds as the multiply-then-add did, and
// vcvtne2ps2bf16 rounds to nearest even as torch does) and runs dp_linear's vdpbf16ps steps in
// dp_linear's order: the same bits from 5 bits a weight instead of 16, for iterations bound by
// reading the weights (a decode step streams SmolLM2's 213 MB of projections, 67 MB this way).
//
// Layout (worker/linear.py `pack_q4_pairs`): for each block of 16 output channels, K / 32
// groups of kQ4GroupBytes: d[16] and m[16] float16, then 16 steps of 16 bytes. Step s's byte j
// holds in its low nibble the level of channel j / 2 at input 32 g + 2 s + j % 2 and in its high
// nibble that of channel 8 + j / 2: widened to 32-bit lanes and split, the two halves are the
// low and the high 16 words vcvtne2ps2bf16 writes, which then lie in dp_linear's pair order.
// ---------------------------------------------------------------------------------------------
// Tiles (rows x 16-channel blocks). Decoding the levels costs more than the dot products, so a
// tile holds every row (up to 8) and each step is decoded once. A block's steps are a chain of
// vdpbf16ps (dp_linear's order, which must be kept), so 1-2 rows take several blocks at a time:
// six, which also splits SmolLM2's 36, 60 and 192 blocks evenly between two threads. Its 120
// projections, 2-core Zen 4: 1 row in tiles of 2 blocks 6.0 ms, of 4 to 12 blocks 4.3-4.7 (the
// decoding bounds it), 6 blocks against 4 in turns 4.64-4.95 against 5.13-5.47; 5 / 6 / 8 rows
// in tiles of 4 rows (then 1-4) 10.6 / 11.0 / 11.9 ms, of 8 rows 7.6 / 8.1 / 9.0.
constexpr int64_t kQ4FewRows = 2, kQ4FewBlocks = 6;
constexpr int64_t kQ4Rows = 8, kQ4Blocks = 2;

// A group's d and m in the lanes of its steps' two halves: lanes 2c and 2c + 1 hold channel c
// (low half) or 8 + c (high half).
struct Q4Scales {
  __m512 d_lo, m_lo, d_hi, m_hi;
};

inline Q4Scales q4_scales(const char* group) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32)));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  return {_mm512_permutexvar_ps(lo, d), _mm512_permutexvar_ps(lo, m),
          _mm512_permutexvar_ps(hi, d), _mm512_permutexvar_ps(hi, m)};
}

// The 32 bfloat16 weights of one step (16 channels x a pair of inputs) from its 16 bytes.
inline __m512bh q4_step(const char* step, const Q4Scales& g) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
  const __m512i q_lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
  const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_lo), g.d_lo, g.m_lo);
  const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), g.d_hi, g.m_hi);
  return _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi
}

// MR rows from r of x (`row_bytes` = 2 K bytes each) against blocks [nb, nb + NR).
template <int64_t MR, int64_t NR, class Store>
inline void q4_linear_tile(const char* x, const char* w, int64_t row_bytes, int64_t r, int64_t nb,
                           const Store& store) {
  const int64_t groups = row_bytes / 64, block_bytes = groups * kQ4GroupBytes;
  __m512 acc[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* xr = x + r * row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    const char* wg[NR];
    Q4Scales sc[NR];
    for (int64_t j = 0; j < NR; ++j) {
      wg[j] = w + (nb + j) * block_bytes + g * kQ4GroupBytes;
      sc[j] = q4_scales(wg[j]);
    }
    for (int64_t s = 0; s < 16; ++s) {
      __m512bh wv[NR];
      for (int64_t j = 0; j < NR; ++j) wv[j] = q4_step(wg[j] + 64 + 16 * s, sc[j]);
      const int64_t p = 16 * g + s;  // the pair of inputs, as in dp_linear_tile
      for (int64_t i = 0; i < MR; ++i) {
        const __m512bh xg = broadcast_pair(reinterpret_cast<const uint16_t*>(xr + i * row_bytes + 4 * p));
        for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xg, wv[j]);
      }
    }
  }
  store(acc, r, nb);
}

// The last `rem` (< MR) rows: a tile of exactly that many rows.
template <int64_t MR, int64_t NR, class Store>
inline void q4_linear_tail(int64_t rem, const char* x, const char* w, int64_t row_bytes, int64_t r,
                           int64_t nb, const Store& store) {
  if constexpr (MR > 0) {
    if (rem == MR) q4_linear_tile<MR, NR>(x, w, row_bytes, r, nb, store);
    else q4_linear_tail<MR - 1, NR>(rem, x, w, row_bytes, r, nb, store);
  }
}

// All m rows of x against blocks [nb, nb + NR), MR rows at a time (one tile where m <= MR, as
// worker/linear.py's Q4_MAX_ROWS keeps it).
template <int64_t MR, int64_t NR, class Store>
inline void q4_linear_rows(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t nb,
                           const Store& store) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) q4_linear_tile<MR, NR>(x, w, row_bytes, r, nb, store);
  q4_linear_tail<MR - 1, NR>(m - r, x, w, row_bytes, r, nb, store);
}

// y = x W^T over `blocks` (even) 16-channel blocks, in tiles of NR blocks (the last blocks in
// tiles of 2 where NR does not divide them), handed out to the threads in items as
// dp_linear_run does.
template <int64_t MR, int64_t NR, class Store>
void q4_linear_run(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t blocks,
                   const Store& store) {
  const int64_t threads = at::get_num_threads();
  const int64_t tiles = blocks / NR, rest = (blocks - tiles * NR) / 2;
  const int64_t per_item = std::max<int64_t>(1, tiles / (threads * kDpItemsPerThread));
  const int64_t items = (tiles + per_item - 1) / per_item;
  run_items(items + rest, threads, [&](int64_t item, int64_t) {
    if (item >= items) {  // a tile of the last 2 blocks
      q4_linear_rows<MR, 2>(x, w, m, row_bytes, tiles * NR + 2 * (item - items), store);
      return;
    }
    for (int64_t t = item * per_item, end = std::min(tiles, t + per_item); t < end; ++t)
      q4_linear_rows<MR, NR>(x, w, m, row_bytes, t * NR, store);
  });
}

// y = x W^T for x `[M, K]` bfloat16 against `packed` `[N / 16, K / 32, kQ4GroupBytes]` uint8
// (pack_q4_pairs); returns `[M, N]` bfloat16, or with `silu_and_mul` (gate and up blocks
// interleaved, as for dp_linear_silu) `[M, N / 2]` silu(gate) * up: what dp_linear and
// dp_linear_silu return for the bfloat16 weight the levels stand for, bit for bit.
Tensor q4_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be on the CPU");
  const Tensor x = x_in.contiguous();
  check_cpu_contiguous(packed, "packed weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
              packed.size(2) == kQ4GroupBytes && packed.size(1) * 32 == x.size(1),
              "packed weight [N / 16, K / 32, ", kQ4GroupBytes, "] uint8 for K = ", x.size(1));
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * 16;
  TORCH_CHECK(n % 32 == 0, "N must be a multiple of 32");
  Tensor y = at::empty({m, silu_and_mul ? n / 2 : n}, x.options());
  auto run = [&](const auto& store) {
    if (m <= kQ4FewRows)
      q4_linear_run<kQ4FewRows, kQ4FewBlocks>(bytes(x), bytes(packed), m, 2 * k, n / 16, store);
    else q4_linear_run<kQ4Rows, kQ4Blocks>(bytes(x), bytes(packed), m, 2 * k, n / 16, store);
  };
  if (silu_and_mul) run(DpSiluStore{ptr<uint16_t>(y), n / 2});
  else run(DpStore{ptr<uint16_t>(y), n});
  return y;
}

#if defined(__AVX512VNNI__)
// W8A8's matmul with its dequantization: x `[M, K]` uint8, the int8 activations of quantize_rows
// plus 128 (top bit flipped), with row_scale `[M]` float32, against `packed`
// `[N / 16, K / 4, 16, 4]` int8 (a weight `[N, K]` quantized per output channel, each block of 16
// channels' quads of K in order) with col_scale and col_sum `[N]` (float32 scales, int32 sums of
// each channel's int8 weights). Returns `[M, N]` bfloat16
// `acc * row_scale * col_scale`, or with `silu_and_mul` (blocks interleaved gate / up, as for
// dp_linear_silu) `[M, N / 2]` silu(gate) * up: the values `torch._int_mm` and dequantize_rows
// give, without their `[M, N]` int32 product in memory.
Tensor vnni_linear(const Tensor& x_in, const Tensor& row_scale, const Tensor& packed,
                   const Tensor& col_scale, const Tensor& col_sum, bool silu_and_mul) {
  const Tensor x = x_in.contiguous();
  for (const Tensor* t : {&row_scale, &packed, &col_scale, &col_sum})
    check_cpu_contiguous(*t, "vnni_linear argument");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kByte && x.dim() == 2,
              "x must be uint8 [M, K] on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 16 &&
              packed.size(3) == 4 && packed.size(1) * 4 == x.size(1),
              "packed weight [N / 16, K / 4, 16, 4] int8 for K = ", x.size(1));
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * 16;
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == m &&
              col_scale.scalar_type() == at::kFloat && col_scale.numel() == n &&
              col_sum.scalar_type() == at::kInt && col_sum.numel() == n,
              "row_scale [M] and col_scale [N] float32, col_sum [N] int32");
  TORCH_CHECK(!silu_and_mul || n % 32 == 0, "silu_and_mul needs gate and up blocks in pairs");
  Tensor y = at::empty({m, silu_and_mul ? n / 2 : n}, x.options().dtype(at::kBFloat16));
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  const int32_t* sums = col_sum.data_ptr<int32_t>();
  if (silu_and_mul)
    dp_linear_run<Uint8Quads, kDpSiluRows, kDpSiluBlocks>(
        bytes(x), bytes(packed), m, k, n / 16,
        DequantStore<DpSiluStore>{rs, cs, sums, DpSiluStore{ptr<uint16_t>(y), n / 2}});
  else
    dp_linear_run<Uint8Quads, kDpRows, kDpBlocks>(
        bytes(x), bytes(packed), m, k, n / 16,
        DequantStore<DpStore>{rs, cs, sums, DpStore{ptr<uint16_t>(y), n}});
  return y;
}
#endif
#endif

#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
// ---------------------------------------------------------------------------------------------
// Every layer of an iteration of a few rows in one call: the loop of worker/model.py's
// `LlamaModel.forward`, the same kernels in the same order on the same rows (the same bits). A
// decode step of SmolLM2 otherwise makes about 240 op calls from Python, each paying the
// interpreter and the dispatcher.
//   x            [n, hidden] float32, the embeddings (not modified).
//   weights      per layer: attention RMSNorm weight, packed QKV, packed O, MLP RMSNorm weight,
//                packed gate/up, packed down. Each projection runs the kernel its packed weight
//                is for: uint8 GGUF 4-bit levels through q4_lanes_linear (float32) or, with
//                `pairs`, q4_linear (bfloat16); float32 lanes through f32_linear; bfloat16
//                pairs through dp_linear. With `pairs` gate and up blocks are interleaved
//                (dp_linear_silu's and q4_linear's SwiGLU order).
//   output_rows  the rows whose output is wanted (the last layer's O and MLP run on them
//                alone), or none for all.
// Returns the last layer's output [rows, hidden] float32, before the final RMSNorm.
Tensor decode_stack(const Tensor& embedded, at::TensorList weights, at::TensorList k_pools,
                    at::TensorList v_pools, const Tensor& positions, const Tensor& cos_sin,
                    const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& query_start_loc, const Tensor& seq_lens,
                    const c10::optional<Tensor>& output_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool pairs) {
  constexpr size_t kPerLayer = 6;
  const size_t layers = k_pools.size();
  TORCH_CHECK(weights.size() == kPerLayer * layers && v_pools.size() == layers,
              "decode_stack: 6 weights and a K and V pool per layer");
#ifndef SHOAL_BF16_PAIRS
  TORCH_CHECK(!pairs, "decode_stack: the bfloat16 kernels are not built on this CPU");
#endif
#ifndef SHOAL_LANES
  TORCH_CHECK(pairs, "decode_stack: the float32 lanes kernels are not built on this CPU");
#endif
  const at::ScalarType dtype = pairs ? at::kBFloat16 : at::kFloat;
  const auto linear = [&](const Tensor& in, const Tensor& packed, bool silu) -> Tensor {
    const bool levels = packed.scalar_type() == at::kByte;
#ifdef SHOAL_BF16_PAIRS
    if (pairs) {
      if (levels) return q4_linear(in, packed, silu);
      return silu ? dp_linear_silu(in, packed) : dp_linear(in, packed);
    }
#endif
#ifdef SHOAL_LANES
    if (!pairs) {
      Tensor y = levels ? q4_lanes_linear(in, packed) : f32_linear(in, packed);
      return silu ? silu_and_mul(y) : y;
    }
#endif
    TORCH_CHECK(false, "unreachable");
  };
  Tensor x = embedded.clone();  // the residual stream, updated in place layer by layer
  c10::optional<Tensor> delta;
  for (size_t l = 0; l < layers; ++l) {
    const Tensor* w = weights.data() + kPerLayer * l;
    Tensor h = add_rms_norm(x, delta, w[0], eps, dtype);
    Tensor a = attend_qkv(linear(h, w[1], false), positions, cos_sin, k_pools[l], v_pools[l],
                          slot_mapping, block_tables, query_start_loc, seq_lens, num_heads,
                          num_kv_heads, head_dim, scale);
    if (l + 1 == layers && output_rows) {
      a = a.index_select(0, *output_rows);
      x = x.index_select(0, *output_rows);
      if (a.size(0) == 0) return x;
    }
    h = add_rms_norm(x, linear(a, w[2], false), w[3], eps, dtype);
    delta = linear(linear(h, w[4], true), w[5], false);
  }
  if (delta) x.add_(*delta);
  return x;
}
#endif

}  // namespace

TORCH_LIBRARY(shoal, m) {
#ifdef SHOAL_AMX
  m.def("amx_available() -> bool", [] { return amx_permitted(); });
#endif
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
#ifdef SHOAL_INT8_GEMV
  m.def("int8_gemv(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum) -> Tensor");
#endif
#ifdef SHOAL_LANES
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_lanes_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale_min) -> Tensor");
#endif
#ifdef SHOAL_INT4_Q8
  m.def("int4_q8_linear(Tensor x, Tensor w, Tensor scale_min) -> Tensor");
#endif
  m.def("dequantize_rows(Tensor acc, Tensor row_scale, Tensor col_scale, bool silu_and_mul, "
        "ScalarType out_dtype) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int num_heads, int head_dim) -> ()");
  m.def("attend_qkv(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) k_pool, "
        "Tensor(c!) v_pool, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float scale) -> Tensor");
#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
  m.def("decode_stack(Tensor x, Tensor[] weights, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
        "Tensor positions, Tensor cos_sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor? output_rows, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale, bool pairs) -> Tensor");
#endif
#ifdef SHOAL_BF16_PAIRS
  m.def("pack_weight_pairs(Tensor weight) -> Tensor");
  m.def("dp_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("dp_linear_silu(Tensor x, Tensor packed) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor packed, bool silu_and_mul) -> Tensor");
#if defined(__AVX512VNNI__)
  m.def("vnni_linear(Tensor x, Tensor row_scale, Tensor packed, Tensor col_scale, Tensor col_sum, "
        "bool silu_and_mul) -> Tensor");
#endif
#endif
#ifdef SHOAL_AMX
  m.def("amx_linear(Tensor x, Tensor packed) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(shoal, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("quantize_rows", &quantize_rows);
#ifdef SHOAL_INT8_GEMV
  m.impl("int8_gemv", &int8_gemv);
#endif
#ifdef SHOAL_LANES
  m.impl("int8_linear", &int8_linear);
  m.impl("f32_linear", &f32_linear);
  m.impl("q4_lanes_linear", &q4_lanes_linear);
  m.impl("int4_linear", &int4_linear);
#endif
#ifdef SHOAL_INT4_Q8
  m.impl("int4_q8_linear", &int4_q8_linear);
#endif
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("topk_rows", &topk_rows);
  m.impl("rope_", &rope_);
  m.impl("attend_qkv", &attend_qkv);
#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
  m.impl("decode_stack", &decode_stack);
#endif
#ifdef SHOAL_BF16_PAIRS
  m.impl("pack_weight_pairs", &pack_weight_pairs);
  m.impl("dp_linear", &dp_linear);
  m.impl("dp_linear_silu", &dp_linear_silu);
  m.impl("q4_linear", &q4_linear);
#if defined(__AVX512VNNI__)
  m.impl("vnni_linear", &vnni_linear);
#endif
#endif
#ifdef SHOAL_AMX
  m.impl("amx_linear", &amx_linear);
#endif
}
