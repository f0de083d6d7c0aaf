// Matmuls on weights 16 output channels to a vector ("lanes"), float32 activations: f32_linear,
// the weight-only int8 / int4 ones, and q4_lanes_linear from GGUF's 4-bit levels.

#include "common.h"
#include "ops.h"

#include <vector>

namespace shoal {

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
// The kernels are written once on Lanes16 (common.h); only the register budget differs between
// AVX-512 and AVX2 (kLaneRows, kLaneChains).
// ---------------------------------------------------------------------------------------------

// int8 weights (scaled per channel at the end) or float32 ones (`scale` null).
inline Lanes16 load_weights(const int8_t* p) { return Lanes16::load_int8(p); }
inline Lanes16 load_weights(const float* p) { return Lanes16::load(p); }

// Accumulators of lanes_rows: [input mod kLaneChains][row][group], as q4_lanes_tile's, so that the
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

// One 16-channel group's float32 weights `[K][16]` (f32_linear's lanes layout) rebuilt from its
// levels into `out`, with q4_lanes_tile's multiply-add (both builds'): the loader's float32
// weight, bit for bit.
inline void q4_lanes_unpack(const uint8_t* w, float* out, int64_t k) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* block = w + b * kQ4GroupBytes;
    const auto half = [](const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); };
    const Lanes16 d = Lanes16::load_half(half(block)), m = Lanes16::load_half(half(block + 32));
    for (int64_t s = 0; s < 16; ++s) {
      Lanes16 q[2];
      Lanes16::load_nibbles(block + 64 + 16 * s, q[0], q[1]);
      for (int64_t e = 0; e < 2; ++e) fmadd(q[e], d, m).store(out + (32 * b + 2 * s + e) * 16);
    }
  }
}

#if defined(__AVX512F__)
// float32 weights rebuilt from GGUF's 4-bit levels (see q4_linear in pairs.cpp for the scheme):
// M rows of x against G channel groups from g on, with lanes_rows' chains and order, so the result
// is f32_linear's to the bit (d q + m is exact in one FMA, as the loader's float32 weight is).
// `w` is q4_lanes_linear's layout: per 16-channel group and 32 inputs, d[16] and m[16] float16,
// then 16 vectors of 16 bytes, byte j of vector s holding channel j's levels at inputs 2 s (low
// nibble) and 2 s + 1 (high). `pf` (or null): the levels of G groups to ask for into L2, a share
// at each block (prefetch_step): the thread's next item's.
// Tiles of 2 groups take up to kLaneRows rows; of one group, up to kQ4GroupRows: each rebuilt
// weight vector then serves three times the rows, so an iteration of 5-16 rows rebuilds each
// weight once or twice rather than two to four times.
constexpr int64_t kQ4GroupRows = 12;  // 24 accumulators (none spilled)

template <int64_t M, int64_t G>
void q4_lanes_tile(const float* x, const uint8_t* w, float* y, int64_t k, int64_t n, int64_t g,
                   const char* pf) {
  const int64_t group_bytes = k / 32 * kQ4GroupBytes;
  Lanes16 acc[2][M][G];  // [input mod 2][row][group]
  for (auto& chain : acc)
    for (auto& row : chain)
      for (auto& a : row) a = Lanes16::zero();
  int64_t due = 0;
  for (int64_t b = 0; b < k / 32; ++b) {
    if (pf) prefetch_step<2>(pf, due, G * group_bytes / 64, k / 32);
    const uint8_t* blk[G];
    Lanes16 d[G], m[G];
    for (int64_t h = 0; h < G; ++h) {
      blk[h] = w + (g + h) * group_bytes + b * kQ4GroupBytes;
      d[h] = Lanes16::load_half(reinterpret_cast<const uint16_t*>(blk[h]));
      m[h] = Lanes16::load_half(reinterpret_cast<const uint16_t*>(blk[h] + 32));
    }
    for (int64_t s = 0; s < 16; ++s) {
      Lanes16 q[G][2];  // levels of inputs 2 s and 2 s + 1
      for (int64_t h = 0; h < G; ++h) Lanes16::load_nibbles(blk[h] + 64 + 16 * s, q[h][0], q[h][1]);
#pragma GCC unroll 2
      for (int64_t e = 0; e < 2; ++e) {  // input 32 b + 2 s + e, an even one first
        Lanes16 wv[G];
        for (int64_t h = 0; h < G; ++h) wv[h] = fmadd(q[h][e], d[h], m[h]);
        const float* xc = x + 32 * b + 2 * s + e;
#pragma GCC unroll 12
        for (int64_t i = 0; i < M; ++i) {
          const Lanes16 xv = Lanes16::all(xc[i * k]);
          for (int64_t h = 0; h < G; ++h) acc[e][i][h] = fmadd(wv[h], xv, acc[e][i][h]);
        }
      }
    }
  }
#pragma GCC unroll 12
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < G; ++h) (acc[0][i][h] + acc[1][i][h]).store(y + i * n + 16 * (g + h));
}

// Up to this many rows the weights are rebuilt in registers per tile (q4_lanes_tile: two groups to
// kLaneRows rows, one past it), past it once an iteration (q4_lanes_unpacked). SmolLM2's
// 120 projections on a 2-core Xeon without AMX (AVX-512), ms, medians of 11-15 in turns
// (docs/benchmarks.md, session 53): pair tiles of 4 rows / group tiles of 8 at 5 rows 9.6-9.7 /
// 8.2, 8 rows 11.5-11.6 / 9.8-9.9, 10 rows 15.0-15.1 / 13.4-13.7, 12 rows 15.9-16.2 / 14.7-15.0,
// and of 12, 10 rows 11.5-11.7, 12 rows 13.1; group tiles of 8 / rebuilt once an iteration at 13
// rows 15.8-16.1 / 17.1-17.7, 14 rows 16.6-16.9 / 17.7-18.0, 16 rows 18.1-18.7 / 18.5-18.8.
constexpr int64_t kQ4LanesDirectMaxRows = 16;

#else
// The AVX2 form of q4_lanes_tile. 16 ymm registers cannot hold its accumulators, the two
// groups' d and m and the levels being widened at once: GCC spilled accumulators to the stack,
// a store and a reload on every multiply-add chain. Here a block's d and m are widened once into
// a small buffer that the weight-rebuilding multiply-adds read as memory operands, so registers
// hold the accumulators -- M rows x G groups x 2 halves, at most 8, what two FMA pipes of 4
// cycles' latency need in flight -- and the levels being widened. Each channel's chain runs over
// its inputs in order from zero, as f32_linear's (kLaneChains = 1 on AVX2): the same bits.
// SmolLM2's 120 projections on a 2-core Zen 3, ms, against the Lanes16 tile it replaced there:
// 1 row 8.4 / 8.7, 2 rows 9.3 / 10.2, 4 rows 12.5 / 19.1, 8 rows 30 / 42 (docs/benchmarks.md,
// session 22).
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

// Runs `rows_fn<M>(row_offset, group)` over every group pair and every kLaneRows rows of x, a
// pair an item (run_items).
template <typename RowsFn>
void for_lane_tiles(int64_t m, int64_t n, RowsFn&& rows_fn) {
  run_items(n / 32, at::get_num_threads(), [&](int64_t pair, int64_t) {
    for (int64_t i0 = 0; i0 < m; i0 += kLaneRows)
      with_row_count<kLaneRows>(std::min<int64_t>(m - i0, kLaneRows),
                                [&](auto rows) { rows_fn(rows, i0, 2 * pair); });
  });
}

// The frame of the lanes matmuls: x `[M, K]` in float32, a float32 y `[M, N]` written by
// `fill(x_data, y_data)`, returned in x's dtype.
template <class Fill>
Tensor lanes_frame(const Tensor& x, int64_t n, Fill&& fill) {
  const Tensor xf = x.to(at::kFloat);
  Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  fill(xf.data_ptr<float>(), y.data_ptr<float>());
  return y.to(x.scalar_type());
}

// lanes_frame with y filled by `rows_fn(rows, x_rows, y_rows, g)` for each tile of rows and
// pair of channel groups (see for_lane_tiles).
template <class RowsFn>
Tensor lanes_matmul(const Tensor& x, int64_t n, RowsFn&& rows_fn) {
  const int64_t k = x.size(1), m = x.size(0);
  return lanes_frame(x, n, [&](const float* xp, float* yp) {
    for_lane_tiles(m, n, [&](auto rows, int64_t i0, int64_t g) {
      rows_fn(rows, xp + i0 * k, yp + i0 * n, g);
    });
  });
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

#if !defined(__AVX512F__)
// f32_linear on AVX2. lanes_rows' tile there (2 rows x 32 channels) read its channel pair's
// weights (73 KB at K = 576, more than L1) from L2 again for every 2 rows: 128 bytes per 8 FMAs.
// Here a thread keeps kF32BlockK inputs of one group's weights (16 KB) in L1 while every tile
// of up to kF32TileRows rows of x passes over them, each accumulator saved to y between blocks.
// Every (row, channel) still sums its inputs in order from zero in one chain, as lanes_rows does
// with kLaneChains = 1 (and q4_lanes_tile): the same bits. 120 SmolLM2 projections on a 2-core
// Zen 3, ms, in turns (docs/benchmarks.md, session 31): 32 / 64 / 128 rows 71.8 / 132.4 / 265.2
// -> 63.0 / 122.4 / 222.9.
constexpr int64_t kF32TileRows = 6;  // 12 accumulators, 2 weight vectors and a broadcast x
constexpr int64_t kF32BlockK = 256;

// Rows [0, M) of the tile at x (rows k apart) times inputs [c0, c1) of one group's weights
// `w` [K][16], into y's 16 channels at `y` (rows n apart), which hold the sums of [0, c0).
template <int64_t M>
inline void f32_tile(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t c0,
                     int64_t c1) {
  __m256 acc[M][2];
  for (int64_t i = 0; i < M; ++i) {
    acc[i][0] = c0 ? _mm256_loadu_ps(y + i * n) : _mm256_setzero_ps();
    acc[i][1] = c0 ? _mm256_loadu_ps(y + i * n + 8) : _mm256_setzero_ps();
  }
  // Unrolled 4 inputs deep, fewer loop instructions beside the 12 FMAs and 8 loads of each:
  // the 120 projections at 64 rows 115 -> 101 and 113 -> 93 ms in two A/B runs (2 or 8: less).
#pragma GCC unroll 4
  for (int64_t c = c0; c < c1; ++c) {
    const __m256 a = _mm256_loadu_ps(w + c * 16), b = _mm256_loadu_ps(w + c * 16 + 8);
    for (int64_t i = 0; i < M; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * k + c);
      acc[i][0] = _mm256_fmadd_ps(a, xv, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(b, xv, acc[i][1]);
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    _mm256_storeu_ps(y + i * n, acc[i][0]);
    _mm256_storeu_ps(y + i * n + 8, acc[i][1]);
  }
}

// Rows [0, m) of x `[m, k]` times one group's weights `w` `[k][16]`, into y's 16 channels at
// `y` (rows n apart): each thread's item of f32_linear and q4_lanes_unpacked.
constexpr int64_t kF32ItemGroups = 1;
inline void f32_item(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n) {
  for (int64_t c0 = 0; c0 < k; c0 += kF32BlockK)
    for (int64_t i0 = 0; i0 < m; i0 += kF32TileRows)
      with_row_count<kF32TileRows>(std::min<int64_t>(m - i0, kF32TileRows), [&](auto rows) {
        f32_tile<decltype(rows)::value>(x + i0 * k, w, y + i0 * n, k, n, c0,
                                        std::min<int64_t>(c0 + kF32BlockK, k));
      });
}
#else
// As above on AVX-512, over a pair of groups (`w` `[2][k][16]`, y's 32 channels): lanes_rows' two
// chains a (row, group), inputs alternating between them, in tiles of kF32TileRows rows.
// lanes_rows itself read the pair's weights (73 KB at K = 576, past a 48 KB L1) from L2 for every
// 4 rows: 128 bytes per 8 FMAs. Here a thread keeps kF32BlockK inputs of the pair (32 KB) in L1
// while every tile of rows passes over them, each tile's chains saved in the thread's buffer
// between blocks: the same sums in the same order, so the same bits as lanes_rows.
constexpr int64_t kF32TileRows = 6;  // 24 accumulators, 2 weight vectors and a broadcast x
constexpr int64_t kF32BlockK = 256;

// Rows [0, M) of the tile at x (rows k apart) times inputs [c0, c1) of the pair `w`, from the
// chains saved at `part` ([M][2 chains][2 groups][16]; none when c0 is 0), which it saves again,
// or (c1 = k) sums into y's 32 channels at `y` (rows n apart).
template <int64_t M>
inline void f32_tile(const float* x, const float* w, float* part, float* y, int64_t k, int64_t n,
                     int64_t c0, int64_t c1) {
  const float* w1 = w + k * 16;
  __m512 acc[M][2][2];  // [row][chain][group]
#pragma GCC unroll 8
  for (int64_t i = 0; i < M; ++i)
    for (int64_t p = 0; p < 2; ++p)
      for (int64_t h = 0; h < 2; ++h)
        acc[i][p][h] =
            c0 ? _mm512_loadu_ps(part + ((i * 2 + p) * 2 + h) * 16) : _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t c = c0; c < c1; c += 2) {
#pragma GCC unroll 2
    for (int64_t p = 0; p < 2; ++p) {
      const __m512 a = _mm512_loadu_ps(w + (c + p) * 16), b = _mm512_loadu_ps(w1 + (c + p) * 16);
#pragma GCC unroll 8
      for (int64_t i = 0; i < M; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * k + c + p]);
        acc[i][p][0] = _mm512_fmadd_ps(a, xv, acc[i][p][0]);
        acc[i][p][1] = _mm512_fmadd_ps(b, xv, acc[i][p][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < M; ++i)
    for (int64_t h = 0; h < 2; ++h) {
      if (c1 == k)
        _mm512_storeu_ps(y + i * n + 16 * h, _mm512_add_ps(acc[i][0][h], acc[i][1][h]));
      else
        for (int64_t p = 0; p < 2; ++p)
          _mm512_storeu_ps(part + ((i * 2 + p) * 2 + h) * 16, acc[i][p][h]);
    }
}

constexpr int64_t kF32ItemGroups = 2;
inline void f32_item(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n) {
  thread_local std::vector<float> parts;
  parts.resize(m * 64);
  for (int64_t c0 = 0; c0 < k; c0 += kF32BlockK)
    for (int64_t i0 = 0; i0 < m; i0 += kF32TileRows)
      with_row_count<kF32TileRows>(std::min<int64_t>(m - i0, kF32TileRows), [&](auto rows) {
        f32_tile<decltype(rows)::value>(x + i0 * k, w, parts.data() + i0 * 64, y + i0 * n, k, n,
                                        c0, std::min<int64_t>(c0 + kF32BlockK, k));
      });
}
#endif

// y `[m, n]` = x `[m, k]` times the lanes weight `w` `[n / 16, k, 16]`, all float32; an item of
// kF32ItemGroups groups at a time (run_items).
void f32_items(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n) {
  constexpr int64_t c = 16 * kF32ItemGroups;
  run_items(n / c, at::get_num_threads(), [&](int64_t item, int64_t) {
    f32_item(x, w + item * c * k, y + item * c, m, k, n);
  });
}

// q4_lanes_linear past kQ4LanesDirectMaxRows rows: each item's float32 weights are rebuilt from
// the levels once, into a thread's buffer (37 KB a group at K = 576: L2), and f32_linear's
// f32_item runs every row over them: f32_linear's bits from a sixth of its bytes, so that no
// float32 lanes copy of the weights need be kept beside the levels (worker/linear.py,
// Q4_LANES_MAX_ROWS).
void q4_lanes_unpacked(const float* x, const uint8_t* w, float* y, int64_t m, int64_t k,
                       int64_t n) {
  constexpr int64_t c = 16 * kF32ItemGroups;
  const int64_t group_bytes = k / 32 * kQ4GroupBytes;
  run_items(n / c, at::get_num_threads(), [&](int64_t item, int64_t) {
    thread_local std::vector<float> weights;
    weights.resize(c * k);
    for (int64_t h = 0; h < kF32ItemGroups; ++h)
      q4_lanes_unpack(w + (item * kF32ItemGroups + h) * group_bytes, weights.data() + h * 16 * k,
                      k);
    f32_item(x, weights.data(), y + item * c, m, k, n);
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
  return lanes_frame(x, n, [&](const float* xp, float* yp) {
    f32_items(xp, wp, yp, x.size(0), k, n);
  });
}

#if !defined(__AVX512F__)
// q4_lanes_tiles rebuilds each weight once per 4 rows of x; past this many rows q4_lanes_unpacked
// rebuilds it once an iteration. SmolLM2's 120 projections on a 2-core Zen 3 (AVX2), ms, medians
// of 7 in turns, q4_lanes_tiles / q4_lanes_unpacked: 8 rows 18.8 / 22.4, 10 rows 23.5 / 22.8, 12
// rows 25.2 / 25.8, 14 rows 31.4 / 28.9, 16 rows 33.4 / 29.3, 32 rows 59.1 / 49.0, 64 rows
// 116.2 / 87.6 (docs/benchmarks.md, session 50).
constexpr int64_t kQ4LanesDirectMaxRows = 12;

// Groups a q4_lanes_tile of M rows takes (as many as keep 8 accumulators).
template <int64_t M> constexpr int64_t kQ4TileGroups = M == 1 ? 4 : M == 2 ? 2 : 1;

// q4_lanes_linear's work on AVX2 as items (run_items) of 4 channel groups (64 channels), the
// last 2 x threads items of 2 groups, so that the threads finish together: an item walks every
// chunk of up to 4 rows in tiles of kQ4TileGroups<rows> groups, so a chunk after the first finds
// its levels in cache. Items rather than a contiguous half per thread (as this kernel, f32_linear
// and for_lane_tiles had): SmolLM2 float32 decode tokens/s on a 2-core Zen 3, halves -> items,
// two rounds each in turns (docs/benchmarks.md, session 45): beside a process busy 1 ms in
// every 5, batch 1 54.6 / 53.1 -> 61.2 / 56.4 and batch 64 216.4 / 232.5 -> 254.6 / 257.7;
// alone 86.0 / 76.2 -> 89.5 / 81.5 and 316.6 / 307.9 -> 310.1 / 331.3; a single stream through
// `shoal up`, medians of 6, four fleets each: 61.7-68.4 -> 63.2-75.6.
void q4_lanes_tiles(const float* x, const uint8_t* w, float* y, int64_t m, int64_t k, int64_t n) {
  const int64_t threads = at::get_num_threads(), pairs = n / 32;
  const int64_t quads = std::max<int64_t>(0, (pairs - 2 * threads) / 2);
  run_items(quads + (pairs - 2 * quads), threads, [&](int64_t item, int64_t) {
    const int64_t g0 = item < quads ? 4 * item : 4 * quads + 2 * (item - quads);
    const int64_t g1 = g0 + (item < quads ? 4 : 2);
    for (int64_t i0 = 0; i0 < m; i0 += 4)
      with_row_count<4>(std::min<int64_t>(m - i0, 4), [&](auto rows) {
        constexpr int64_t M = decltype(rows)::value, G = kQ4TileGroups<M>;
        const float* xr = x + i0 * k;
        float* yr = y + i0 * n;
        for (int64_t g = g0; g < g1; g += G) {
          if constexpr (G == 4)
            if (g1 - g < 4) {  // an item of 2 groups
              q4_lanes_tile<M, 2>(xr, w, yr, k, n, g);
              break;
            }
          q4_lanes_tile<M, G>(xr, w, yr, k, n, g);
        }
      });
  });
}
#endif

// y = x W^T for x `[M, K]` float32 or bfloat16 against W's 4-bit levels `packed`
// `[N / 16, K / 32, kQ4GroupBytes]` uint8 (q4_lanes_tile's layout); returns `[M, N]` in x's dtype:
// f32_linear's result over the float32 weight the levels stand for, bit for bit.
Tensor q4_lanes_linear(const Tensor& x, const Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kQ4GroupBytes &&
              packed.scalar_type() == at::kByte,
              "q4_lanes_linear: packed weight [N/16, K/32, ", kQ4GroupBytes, "] uint8");
  const int64_t k = packed.size(1) * 32, n = packed.size(0) * 16;
  check_lanes_input(x, packed, k, "q4_lanes_linear");
  TORCH_CHECK(n % 32 == 0, "q4_lanes_linear: N a multiple of 32");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t m = x.size(0);
  if (m > kQ4LanesDirectMaxRows)
    return lanes_frame(x, n, [&](const float* xp, float* yp) {
      q4_lanes_unpacked(xp, wp, yp, m, k, n);
    });
#if defined(__AVX512F__)
  // An item is a pair of groups; its tiles ask for the levels of the item the thread claims next
  // (`next`) into L2 as they go.
  const int64_t pairs = n / 32, group_bytes = k / 32 * kQ4GroupBytes;
  const auto levels = [&](int64_t g) {
    return reinterpret_cast<const char*>(wp + g * group_bytes);
  };
  return lanes_frame(x, n, [&](const float* xp, float* yp) {
    run_items(pairs, at::get_num_threads(), [&](int64_t pair, int64_t next) {
      if (m <= kLaneRows) {
        if (m > 0)
          with_row_count<kLaneRows>(m, [&](auto rows) {
            q4_lanes_tile<decltype(rows)::value, 2>(xp, wp, yp, k, n, 2 * pair,
                                                    next < pairs ? levels(2 * next) : nullptr);
          });
        return;
      }
      for (int64_t h = 0; h < 2; ++h)  // the first tile of each group asks for the next pair's
        for (int64_t i0 = 0; i0 < m; i0 += kQ4GroupRows)
          with_row_count<kQ4GroupRows>(std::min(m - i0, kQ4GroupRows), [&](auto rows) {
            q4_lanes_tile<decltype(rows)::value, 1>(
                xp + i0 * k, wp, yp + i0 * n, k, n, 2 * pair + h,
                i0 == 0 && next < pairs ? levels(2 * next + h) : nullptr);
          });
    });
  });
#else
  return lanes_frame(x, n, [&](const float* xp, float* yp) {
    q4_lanes_tiles(xp, wp, yp, x.size(0), k, n);
  });
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
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* smp = static_cast<const uint16_t*>(scale_min.data_ptr());
  return lanes_frame(x, n, [&](const float* xp, float* yp) {
    const std::vector<float> x_sum = block_sums(xp, m, k);
    const float* xs = x_sum.data();
    for_lane_tiles(m, n, [&](auto rows, int64_t i0, int64_t g) {
      int4_lanes_rows<decltype(rows)::value>(xp + i0 * k, xs + i0 * (k / 32), wp, smp,
                                             yp + i0 * n, k, n, g);
    });
  });
}
#endif

}  // namespace shoal
