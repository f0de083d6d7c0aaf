// int4 weights (GGUF Q4_1) against int8 activations: int4_q8_linear (AVX2 and AVX-512 VNNI).

#include "common.h"
#include "ops.h"

namespace shoal {

#ifdef SHOAL_INT4_Q8
// ---------------------------------------------------------------------------------------------
// int4 weights (GGUF Q4_1's levels, scales and minimums) against int8 activations, for AVX2-only
// CPUs and those with AVX-512 VNNI (below). On AVX2 alone the lanes kernel (lanes.cpp) is bound by
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
// One block of 32 inputs of x to int8: d = max |x| / 127, x8 = x * (127 / max |x|) rounded half to
// even (the rounding std::nearbyint does; `vcvtps2dq` in the default mode), a block of zeros all
// zeros with d = 0; ds = {d, the block's float32 sum}. The scaling is a plain multiply, never
// contracted with anything: an FMA there resolved other near-ties, and the perplexity of 512
// tokens of GPL-3 measured 2.6-3.4% higher (19.17 / 20.47 against 18.65 / 19.93;
// docs/benchmarks.md, session 15).
inline void quantize_block_q8(const float* x, int8_t* x8, float* ds) {
  const __m256 v[4] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16),
                       _mm256_loadu_ps(x + 24)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  const auto abs = [&](__m256 e) { return _mm256_andnot_ps(sign, e); };
  __m256 a = _mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])),
                           _mm256_max_ps(abs(v[2]), abs(v[3])));
  __m256 t = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
  t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
  t4 = _mm_add_ss(t4, _mm_movehdup_ps(t4));
  const float amax = _mm_cvtss_f32(a4);
  ds[0] = amax / 127.f;
  ds[1] = _mm_cvtss_f32(t4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  // The packs work within 128-bit lanes: their dwords hold inputs 0-3, 8-11, 16-19, 24-27, 4-7,
  // 12-15, 20-23 and 28-31.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                            _mm256_packs_epi32(q[2], q[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8), _mm256_permutevar8x32_epi32(packed, order));
}

// Rows sharing the unpacked levels of a block (registers: 8 + 4). With VNNI this 8-channel
// AVX2 form still serves iterations of up to this many rows: at 1-4 rows it measured 2.9-3.9 ms
// for SmolLM2's 120 projections against 4.0-5.4 for the 16-channel form below (2-core Zen 4).
constexpr int64_t kQ8Rows = 4;

template <int64_t M>
void int4_q8_rows(const int8_t* x8, const float* ds, const uint8_t* w, const uint16_t* sm,
                  float* y, int64_t k, int64_t n, int64_t g) {
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
      const float* db = ds + 2 * (i * nb + b);
      acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scl, _mm256_set1_ps(db[0])), acc[i]);
      acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(db[1]), acc[i]);
    }
  }
  for (int64_t i = 0; i < M; ++i) _mm256_storeu_ps(y + i * n + 8 * g, acc[i]);
}

#ifdef SHOAL_INT4_Q8_VNNI
// With AVX-512 VNNI, `vpdpbusd` adds each channel's four byte products straight into its int32
// lane (AVX2 takes `vpmaddubsw`, an int16 add and a `vpmaddwd`), and a zmm register holds two
// 8-channel groups of the same layout side by side (g and g + 1: channels 8g..8g+15, stored as
// one vector), so each broadcast of four activation bytes feeds 16 channels. 32 registers let
// 8 rows share a block's unpacked levels. The arithmetic per channel is AVX2's, bit for bit.
constexpr int64_t kQ8VnniRows = 8;

template <int64_t M>
void int4_q8_rows_vnni(const int8_t* x8, const float* ds, const uint8_t* w, const uint16_t* sm,
                       float* y, int64_t k, int64_t n, int64_t g) {
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
    // The rows' chains of dot products interleaved (step t of every row, then step t + 1), each
    // in a register of its own (`__v16si`, as pairs.cpp's Uint8Quads): with a loop over the rows
    // GCC ran one chain at a time and kept every row's accumulator on the stack. SmolLM2's 120
    // projections (weights from DRAM), rows in chunks both ways, 2-core Zen 5, in turns: 16 /
    // 64 / 2,048 rows 6.46-6.76 / 17.5-18.1 / 483-521 -> 5.93-6.15 / 15.2-15.5 / 410-416 ms.
    // The same bits.
    __v16si s32[M];
#pragma GCC unroll 16
    for (int64_t i = 0; i < M; ++i) s32[i] = (__v16si)_mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t t = 0; t < 8; ++t) {
      const int64_t at = t < 4 ? 4 * t : 16 + 4 * (t - 4);
#pragma GCC unroll 16
      for (int64_t i = 0; i < M; ++i) {
        int32_t quad;
        std::memcpy(&quad, x8 + i * k + 32 * b + at, 4);
        s32[i] = __builtin_ia32_vpdpbusd_v16si(s32[i], (__v16si)lv[t],
                                               (__v16si)_mm512_set1_epi32(quad));
      }
    }
#pragma GCC unroll 16
    for (int64_t i = 0; i < M; ++i) {
      const __m512 dot = _mm512_cvtepi32_ps((__m512i)s32[i]);
      const float* db = ds + 2 * (i * nb + b);
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scl, _mm512_set1_ps(db[0])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(db[1]), acc[i]);
    }
  }
  for (int64_t i = 0; i < M; ++i) _mm512_storeu_ps(y + i * n + 8 * g, acc[i]);
}
#endif

// Each 8-channel group's work first asks for the levels and the scales of the group this many
// ahead (into L2): the hardware prefetcher alone kept the stream at half the memory's pace. The
// int4 LM-head screen (SmolLM2's [49152, 576], out of cache, 2-core Xeon with AMX, in turns in one
// process): 1 row 1.29 ms without, 1.01 / 0.99 / 1.04 / 1.01 / 0.96 with 1 / 2 / 4 / 8 / 16 groups
// ahead (medians of 30); with 2, at 1 / 4 / 8 / 16 / 64 rows 1.46 / 1.65 / 2.12 / 3.33 / 11.6 ->
// 1.14 / 1.44 / 1.87 / 3.04 / 10.6 (medians of 20).
constexpr int64_t kQ8PrefetchGroups = 2;

// A thread runs its groups over this many rows at a time, so that their int8 inputs
// (36 KB at K = 576) stay near while its weights pass, instead of every group streaming all of a
// prompt's inputs from L3 (1.2 MB at 2,048 rows). A [3072, 576] weight at 2,048 rows on both
// cores of a Zen 3, in a standalone harness: 43.2-50.4 -> 37.8-38.9 ms (16 and 256 rows a chunk
// no better); SmolLM2's 120 projections at 2,048 rows in separate processes, in turns: 2,620-2,722
// -> 2,421-2,629 ms (docs/benchmarks.md, session 51).
constexpr int64_t kQ8ChunkRows = 64;

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
  // Each row's blocks of 32 inputs: int8 values, their scale and their exact sum (on both
  // threads: a prefill iteration's inputs are millions of elements).
  const Tensor x8_t = at::empty({m * k}, x.options().dtype(at::kChar));
  const Tensor d_t = at::empty({m * nb, 2}, x.options().dtype(at::kFloat));
  int8_t* x8 = x8_t.data_ptr<int8_t>();
  float* ds = d_t.data_ptr<float>();  // per block: scale, sum
  at::parallel_for(0, m * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk)
      quantize_block_q8(xp + blk * 32, x8 + blk * 32, ds + 2 * blk);
  });
  Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* smp = static_cast<const uint16_t*>(scale_min.data_ptr());
  float* yp = y.data_ptr<float>();
  // Group g's levels (nb * 128 bytes) and scales (nb * 32), asked for into L2, where g < end.
  const auto prefetch_group = [&](int64_t g, int64_t end) {
    if (g >= end) return;
    const char* levels = reinterpret_cast<const char*>(wp + g * nb * 128);
    for (int64_t l = 0; l < nb * 2; ++l) __builtin_prefetch(levels + 64 * l, 0, 2);
    const char* scales = reinterpret_cast<const char*>(smp + g * nb * 16);
    for (int64_t l = 0; l < (nb + 1) / 2; ++l) __builtin_prefetch(scales + 64 * l, 0, 2);
  };
#ifdef SHOAL_INT4_Q8_VNNI
  if (n % 16 == 0 && m > kQ8Rows) {  // pairs of 8-channel groups (fewer rows: see above)
    // Rows in chunks as on AVX2 (a [3072, 576] weight in cache, 2,048 rows, 2-core Zen 5:
    // 8.6-9.1 -> 7.7 ms); only the first chunk asks for the groups ahead, which later ones find
    // in L2.
    at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c0 = 0; c0 < m; c0 += kQ8ChunkRows) {
        const int64_t c1 = std::min(m, c0 + kQ8ChunkRows);
        for (int64_t pair = begin; pair < end; ++pair) {
          if (c0 == 0) {
            prefetch_group(2 * (pair + kQ8PrefetchGroups), 2 * end);
            prefetch_group(2 * (pair + kQ8PrefetchGroups) + 1, 2 * end);
          }
          for (int64_t i0 = c0; i0 < c1; i0 += kQ8VnniRows)
            with_row_count<kQ8VnniRows>(std::min<int64_t>(c1 - i0, kQ8VnniRows), [&](auto rows) {
              int4_q8_rows_vnni<decltype(rows)::value>(x8 + i0 * k, ds + 2 * i0 * nb, wp, smp,
                                                       yp + i0 * n, k, n, 2 * pair);
            });
        }
      }
    });
    return y.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, n / 8, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < m; c0 += kQ8ChunkRows) {
      const int64_t c1 = std::min(m, c0 + kQ8ChunkRows);
      for (int64_t g = begin; g < end; ++g) {
        prefetch_group(g + kQ8PrefetchGroups, end);
        for (int64_t i0 = c0; i0 < c1; i0 += kQ8Rows)
          with_row_count<kQ8Rows>(std::min<int64_t>(c1 - i0, kQ8Rows), [&](auto rows) {
            int4_q8_rows<decltype(rows)::value>(x8 + i0 * k, ds + 2 * i0 * nb, wp, smp,
                                                 yp + i0 * n, k, n, g);
          });
      }
    }
  });
  return y.to(x.scalar_type());
}
#endif

}  // namespace shoal
