// bfloat16 projections on weights packed in pairs of input channels: the packing, amx_linear
// (AMX tiles), dp_linear and q4_linear (AVX512_BF16 dot products; q4_linear from GGUF's 4-bit
// levels), and vnni_linear (W8A8's int8 dot products in dp_linear's tiles).

#include "common.h"
#include "ops.h"

#include <cstdlib>
#include <memory>
#include <vector>

namespace shoal {

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

// A pair's accumulators, stored (c: tiles 0 and 2, rows 0-15, then 1 and 3, rows 16-31), into
// y (`rows` rows from the pair's first, `n` wide): blocks nb and nb + 1, or with Silu (gate
// block nb, up block nb + 1) SwiGLU's product silu(g) * u in float32, rounded once (as
// dp_linear_silu's store), at channel block nb / 2, a slice of rows in each step of the next
// pair's tile products (`step`, from amx_pair), the rest after the last pair.
template <bool Silu>
struct PairStore {
  const float* c = nullptr;
  uint16_t* y = nullptr;
  int64_t rows = 0, n = 0, nb = 0;
  void rows_between(int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < std::min(r1, rows); ++r) {
      const float* g = c + (r / 16) * 512 + (r % 16) * 16;
      if constexpr (Silu) {
        store16(y + r * n + nb / 2 * 16, _mm512_mul_ps(silu16(load16(g)), load16(g + 256)));
      } else {
        store16(y + r * n + nb * 16, load16(g));
        store16(y + r * n + nb * 16 + 16, load16(g + 256));
      }
    }
  }
  void step(int64_t j, int64_t steps) const {
    if (c) rows_between(j * 32 / steps, (j + 1) * 32 / steps);
  }
};

// One pair of output blocks (weights w0, w1: K / 32 tiles each) for MB (1 or 2) blocks of 16
// rows of x (x0 and x1, each 16 rows of K): every tile of x loaded serves both weight tiles.
// Accumulators tmm0-3 are (rows 0-15, w0), (rows 16-31, w0), (rows 0-15, w1), (rows 16-31,
// w1), stored to c at the end (PairStore's layout). Meanwhile `pf_lines` 64-byte lines from `pf`
// (a slice of the next pair's weights) are asked for into L2, spread over the K / 32 steps, and
// the previous pair's stores (`pending`: its rounding, SwiGLU's exp) run a slice of rows a step,
// so that the vector units work while the tiles multiply. `ready(j)` runs before the weight
// tiles of step j are loaded (a source that writes them there, as q4_amx_linear's does, writes
// them then).
//
// With StreamW the weight tiles load with tileloaddt1 (`_tile_stream_loadd`, a hint that they
// will not be reused soon): they then stay out of L1, which keeps x's 32 rows there instead.
template <int MB, bool Silu, bool StreamW = false, class Ready>
inline void amx_pair(const uint16_t* x0, const uint16_t* x1, const uint16_t* w0,
                     const uint16_t* w1, int64_t k, float* c, const char* pf, int64_t pf_lines,
                     const Ready& ready, const PairStore<Silu>& pending) {
  _tile_zero(0);
  _tile_zero(2);
  if (MB > 1) { _tile_zero(1); _tile_zero(3); }
  const int64_t kt = k / 32;
  int64_t due = 0;
  for (int64_t j = 0; j < kt; ++j) {
    ready(j);
    if constexpr (StreamW) {
      _tile_stream_loadd(6, w0 + j * 512, 64);
      _tile_stream_loadd(7, w1 + j * 512, 64);
    } else {
      _tile_loadd(6, w0 + j * 512, 64);
      _tile_loadd(7, w1 + j * 512, 64);
    }
    _tile_loadd(4, x0 + j * 32, k * 2);
    prefetch_step<2>(pf, due, pf_lines, kt);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (MB > 1) {
      _tile_loadd(5, x1 + j * 32, k * 2);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.step(j, kt);
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 256, 64);
  if (MB > 1) { _tile_stored(1, c + 512, 64); _tile_stored(3, c + 768, 64); }
}

// Rows of x per pass over the weights: they stay in L2 while every output block of the thread's
// range is computed for them.
constexpr int64_t kAmxRowBlock = 256;

// Past this many rows, when 32 rows of x fit in L1 beside the tiles' traffic (K <= 640: 40 KB of
// L1's 48), the order turns over: 32 rows at a time against a group of the thread's pairs (at
// most kAmxGroupBytes of weights, which stay in L2), the weights streamed past L1 (tileloaddt1)
// so that the rows stay there (in the order above each pair's 36 KB of weights and 36 KB of row
// tiles cycle through L1's 48 KB together). Why the old order loses is not pinned down: in a
// standalone loop of the 2 x 2 step, 64-byte aligned weight tiles cycling through 256 KB-1 MB
// (L2) fed it at 2.4-2.6 TFLOP/s a core, as from L1; rows outer, weights through tileloaddt1
// rather than tileloadd ran at 1.40 against 1.10 (the old order 1.00-1.06). SmolLM2's 30 layers
// at 2,048 rows, ms, in turns (medians of 8; old order / turned over / oneDNN): gate/up
// with SwiGLU 134 / 104-113 / -, QKV 32.7 / 26.5 / 31.3, O 21.2 / 16.6 / 18.8. Down (K = 1,536)
// keeps the order above. At 64 rows the turned order lost (gate/up 12.3 / 19.9: a step's
// weights come from DRAM, twice). Its stores wait for the next pair (PairStore::step): 30 gate/up
// projections at 2,048 rows with SwiGLU 121.7 -> 110.5 ms (medians of 20 in turns; fastest
// 100.9 -> 85.8), QKV 27.0 -> 26.4 (fastest).
constexpr int64_t kAmxRowsOuterAbove = 64;
constexpr int64_t kAmxRowsOuterMaxK = 640;
constexpr int64_t kAmxGroupBytes = 512 << 10;

// Output blocks [begin, end) (an even range) for all m rows of x, 32 rows at a time: past the
// first 32 the pair's weight tiles come from cache, not memory. A tile loads 16 rows: those of
// a last partial tile come from `tail` (16 rows of K, zero-padded). `src` gives each pair's
// weights (PackedPairs, Q4Pairs). y's rows are n wide: with Silu (pairs of gate and up blocks,
// as swiglu_interleave orders them) SwiGLU's product, half the blocks' channels.
//
// Past Source::kPrefetchAbove rows (packed weights: 16) each pair also asks for the next pair's
// weights into L2, spread over its row tiles: the tile loads wait on the tile products before
// them (there are 8 tile registers and no renaming), so with more than one row tile the
// hardware prefetcher's stream fell behind. All of
// SmolLM2's 120 projections from DRAM, medians of interleaved runs (2-core Xeon with AMX): 32 rows
// 11.7 -> 10.9 ms, 48 rows 13.6 -> 12.7, 64 rows 14.7 -> 14.2, 128 rows 21.6 -> 20.9; W64
// in-process 2.88-2.95 -> 2.76-2.82 s. At 1-16 rows (one row tile, the stream already at the
// memory's pace) it cost 1-6%, so it is left out there.
//
// In both orders each pair's stores run during the next pair's tile products (PairStore). All
// 120 projections of SmolLM2, ms, medians of 10 in turns, stores at once / during the next pair:
// bfloat16 pairs at 16 / 48 / 64 rows 14.6-16.1 / 16.7-17.6 / 18.0-18.8 against 13.7-15.0 /
// 15.4-15.8 / 15.9-18.8 (32 rows 12.7-18.0 against 13.9-17.2: within the noise); the levels at
// 1 / 4 / 16 rows 10.74 / 10.34 / 12.11 against 10.30 / 10.18 / 11.83 (32 rows 15.6 / 16.1).
template <bool Silu, class Source>
void amx_linear_blocks(const uint16_t* x, const uint16_t* tail, const Source& src, uint16_t* y,
                       int64_t m, int64_t k, int64_t n, int64_t begin, int64_t end) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t kt = k / 32;
  const auto rows = [&](int64_t r) { return r + 16 <= m ? x + r * k : tail; };
  alignas(64) float stored[2][4 * 16 * 16];  // the pending pair's accumulators, and the next's
  if (m > kAmxRowsOuterAbove && k <= kAmxRowsOuterMaxK) {  // the turned-over order (above)
    const int64_t group = std::max<int64_t>(2, kAmxGroupBytes / (kt * 2048) * 2);  // blocks
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t r = 0; r < m; r += 32) {
        PairStore<Silu> pending;
        for (int64_t nb = g0; nb < g1; nb += 2) {
          const uint16_t* w0 = src.pair(nb);
          const auto ready = [&](int64_t j) { src.ready(nb, j); };
          float* cs = stored[(nb - g0) / 2 % 2];
          if (m - r > 16)
            amx_pair<2, Silu, true>(rows(r), rows(r + 16), w0, w0 + kt * 512, k, cs, nullptr,
                                    0, ready, pending);
          else
            amx_pair<1, Silu, true>(rows(r), nullptr, w0, w0 + kt * 512, k, cs, nullptr, 0,
                                    ready, pending);
          pending = {cs, y + r * n, std::min<int64_t>(32, m - r), n, nb};
        }
        pending.rows_between(0, 32);
      }
    }
    _tile_release();
    return;
  }
  PairStore<Silu> pending;
  int64_t calls = 0;
  for (int64_t m0 = 0; m0 < m; m0 += kAmxRowBlock) {  // these rows of x stay in cache
    const int64_t m1 = std::min(m, m0 + kAmxRowBlock);
    const int64_t tiles = (m1 - m0 + 31) / 32;
    for (int64_t nb = begin; nb < end; nb += 2) {
      const uint16_t* w0 = src.pair(nb);
      const char* pf = m > Source::kPrefetchAbove && nb + 2 < end ? src.next(nb) : nullptr;
      int64_t t = 0;
      for (int64_t r = m0; r < m1; r += 32, ++t) {
        const int64_t lines = pf ? share(src.next_lines(), tiles, t) : 0;
        // The pair's weight tiles are made ready for the first row tile; the others reuse them.
        const auto ready = [&, first = r == m0](int64_t j) { if (first) src.ready(nb, j); };
        float* cs = stored[calls++ % 2];
        if (m - r > 16)
          amx_pair<2, Silu>(rows(r), rows(r + 16), w0, w0 + kt * 512, k, cs, pf, lines, ready,
                            pending);
        else
          amx_pair<1, Silu>(rows(r), nullptr, w0, w0 + kt * 512, k, cs, pf, lines, ready,
                            pending);
        pending = {cs, y + r * n, std::min<int64_t>(32, m - r), n, nb};
        if (pf) pf += 64 * lines;
      }
    }
  }
  pending.rows_between(0, 32);
  _tile_release();
}

// amx_linear_blocks' source of weights that lie packed by pack_weight_pairs.
struct PackedPairs {
  const uint16_t* w;
  int64_t kt;  // K / 32
  // Blocks nb and nb + 1, [2][K / 32][512] bfloat16.
  const uint16_t* pair(int64_t nb) const { return w + nb * kt * 512; }
  void ready(int64_t, int64_t) const {}
  // The next pair, asked for into L2 while this one runs in iterations of more than
  // kPrefetchAbove rows (see amx_linear_blocks), and its 64-byte lines.
  static constexpr int64_t kPrefetchAbove = 16;
  const char* next(int64_t nb) const { return reinterpret_cast<const char*>(pair(nb + 2)); }
  int64_t next_lines() const { return 2 * kt * 512 * 2 / 64; }
};

// y `[M, N]` bfloat16 = x W^T over AMX tiles (with `silu_and_mul`, `[M, N / 2]` SwiGLU's
// product of pairs of gate and up blocks), the weights' pairs of output blocks from the source
// `make_source(scratch)` gives each thread (`scratch_elems` bfloat16 of its own, 64-byte
// aligned, or none). One contiguous run of pairs per thread: each streams its share once.
template <class MakeSource>
Tensor amx_linear_run(const Tensor& x, int64_t n, bool silu_and_mul, int64_t scratch_elems,
                      const MakeSource& make_source) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1, "an AMX projection needs at least one row");
  TORCH_CHECK(amx_permitted(), "AMX is not available to this process");
  // The rows of a last partial tile, padded with zeros (their products are never stored); the
  // others are read in place.
  const uint16_t* xq = ptr<uint16_t>(x);
  const int64_t full = m / 16 * 16;
  std::vector<uint16_t> tail(m > full ? 16 * k : 0);
  if (m > full) std::memcpy(tail.data(), xq + full * k, (m - full) * k * sizeof(uint16_t));
  const int64_t ny = silu_and_mul ? n / 2 : n;
  Tensor y = at::empty({m, ny}, x.options());
  uint16_t* yq = ptr<uint16_t>(y);
  const int64_t pairs = n / 32, threads = at::get_num_threads();
  at::parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint16_t[], decltype(&std::free)> scratch(
        scratch_elems ? static_cast<uint16_t*>(std::aligned_alloc(64, 2 * scratch_elems))
                      : nullptr,
        &std::free);
    if (silu_and_mul)
      amx_linear_blocks<true>(xq, tail.data(), make_source(scratch.get()), yq, m, k, ny,
                              2 * begin, 2 * end);
    else
      amx_linear_blocks<false>(xq, tail.data(), make_source(scratch.get()), yq, m, k, ny,
                               2 * begin, 2 * end);
  });
  return y;
}

// y = x W^T for x `[M, K]` bfloat16 (any M >= 1) against W packed by pack_weight_pairs; returns
// `[M, N]` bfloat16 (float32 accumulation), or with `silu_and_mul` (W a fused gate/up weight
// with its 16-row blocks interleaved, as for dp_linear_silu) `[M, N / 2]` silu(gate) * up from
// the float32 accumulators, rounded once: the `[M, N]` product is never written.
Tensor amx_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul) {
  const auto [x, n] = pair_linear_input(x_in, packed);
  const PackedPairs source{ptr<uint16_t>(packed), x.size(1) / 32};
  return amx_linear_run(x, n, silu_and_mul, 0, [&](uint16_t*) { return source; });
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

// MR rows from r of x against blocks [nb, nb + NR) of the weights, which lie from `w` on (block
// nb's first vector). While the step loop runs it also asks for `pf_lines` 64-byte lines from
// `pf` (a slice of the next tile's weights) into L1, one every steps / pf_lines steps, so the
// requests spread over the tile's compute.
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
    for (int64_t j = 0; j < NR; ++j) wv[j] = Op::load(w + (j * steps + p) * 64);
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

// Rows [r0, r1) of x against blocks [nb, nb + NR) (their weights from `w` on): MR rows at a
// time, the weights (NR x 16 x row_bytes, 55 KB for bfloat16, K = 576 and NR = 3) staying in
// L1/L2 while the rows pass. Meanwhile the `next_lines` 64-byte lines of the next tile's
// weights from `next` (none where null) are prefetched, spread over the first
// kDpPrefetchSpread row tiles (the hardware prefetcher alone left 64-row iterations 10% slower).
template <class Op, int64_t MR, int64_t NR, class Store>
void dp_linear_rows(const char* x, const char* w, int64_t row_bytes, int64_t r0, int64_t r1,
                    int64_t nb, const char* next, int64_t next_lines, const Store& store) {
  const int64_t tiles = (r1 - r0 + MR - 1) / MR;
  const int64_t spread = std::min(tiles, kDpPrefetchSpread);
  const int64_t lines = next != nullptr ? next_lines : 0;
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

// Bytes of x per pass over the weights: those rows stay in L2 (1 MB on Zen 5) while the
// weights pass; more rows are taken in several passes, each streaming the weights again.
constexpr int64_t kDpRowBytes = 256 << 10;
// Work items per thread in each pass (see dp_linear_run).
constexpr int64_t kDpItemsPerThread = 4;

// Where dp_linear's tiles find their weights. PackedTiles: packed in memory, each 16-channel
// block `block_bytes` long (its steps' 64-byte vectors in order). `tile(nb, nr)` is the first
// vector of blocks [nb, nb + nr) made ready for a pass of rows; `source(nb)` and `lines(nr)` what
// to ask for ahead of such a tile (its bytes in memory from block nb on, in 64-byte lines).
struct PackedTiles {
  const char* w;
  int64_t block_bytes;
  const char* tile(int64_t nb, int64_t) const { return source(nb); }
  const char* source(int64_t nb) const { return w + nb * block_bytes; }
  int64_t lines(int64_t nr) const { return nr * block_bytes / 64; }
};

// y = x W^T over `blocks` 16-channel output blocks, NR blocks to a tile, written by `store`;
// x is `m` rows of `row_bytes`, a block of the weights 16 x row_bytes, its tiles from `tiles`
// (PackedTiles, Q4Tiles).
// The work is cut into items (a pass of rows x a group of tiles) that the threads take one at a
// time: on a machine whose cores the gateway, the scheduler and Redis also need, the thread that
// another process preempts holds back only its current items, where an even split up front made
// the other thread wait at the end of every matmul for the preempted one's whole half. Each
// thread claims its next item before it runs the current one, so the current item's last tile
// prefetches the next item's first weights: with items of 1-2 tiles (decode's projections) most
// tiles otherwise began with a cold read from DRAM (A/B in one process, SmolLM2's 120
// projections, 2-core Zen 5: 16 rows 5.87 -> 4.97 ms, 32 rows 8.98 -> 7.72, 64 rows 15.4 -> 14.2,
// 128 rows 29.1 -> 27.9; as fast as contiguous halves per thread).
template <class Op, int64_t MR, int64_t NR, class Store, class Tiles>
void dp_linear_tiles_run(const char* x, const Tiles& tiles, int64_t m, int64_t row_bytes,
                         int64_t blocks, const Store& store) {
  const int64_t threads = at::get_num_threads();
  const int64_t rows = std::max<int64_t>(MR, kDpRowBytes / row_bytes / MR * MR);
  const int64_t passes = (m + rows - 1) / rows;
  const int64_t ntiles = (blocks + NR - 1) / NR;
  const int64_t per_group = std::max<int64_t>(1, ntiles / (threads * kDpItemsPerThread));
  const int64_t groups = (ntiles + per_group - 1) / per_group;
  const int64_t items = passes * groups;
  auto first_block = [&](int64_t item) { return item % groups * per_group * NR; };
  // Item `item`; `after` is the weights of the item this thread runs next (or null).
  auto run = [&](int64_t item, const char* after) {
    const int64_t r0 = item / groups * rows, r1 = std::min(m, r0 + rows);
    const int64_t b0 = first_block(item), b1 = std::min(blocks, b0 + per_group * NR);
    int64_t nb = b0;
    for (; nb + NR <= b1; nb += NR)
      dp_linear_rows<Op, MR, NR>(x, tiles.tile(nb, NR), row_bytes, r0, r1, nb,
                                 nb + NR < b1 ? tiles.source(nb + NR) : after, tiles.lines(NR),
                                 store);
    // The last blocks when NR does not divide them. N is a multiple of 32, so the blocks are
    // even: with an even NR (gate/up pairs) the rest is 2 blocks, never 1.
    if constexpr (NR > 2) {
      if (b1 - nb == 2)
        dp_linear_rows<Op, MR, 2>(x, tiles.tile(nb, 2), row_bytes, r0, r1, nb, nullptr, 0,
                                  store);
    }
    if constexpr (NR % 2 == 1) {
      if (b1 - nb == 1)
        dp_linear_rows<Op, MR, 1>(x, tiles.tile(nb, 1), row_bytes, r0, r1, nb, nullptr, 0,
                                  store);
    }
  };
  run_items(items, threads, [&](int64_t item, int64_t next) {
    run(item, next < items ? tiles.source(first_block(next)) : nullptr);
  });
}

// dp_linear_tiles_run over weights packed in memory at `w`.
template <class Op, int64_t MR, int64_t NR, class Store>
void dp_linear_run(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t blocks,
                   const Store& store) {
  dp_linear_tiles_run<Op, MR, NR>(x, PackedTiles{w, 16 * row_bytes}, m, row_bytes, blocks, store);
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
// The next tile's levels go into L2 (2) rather than L1 (3): at one row a tile's levels (6 blocks,
// K = 576: 34.5 KB) and the next one's would not both fit in L1.
constexpr int kQ4PrefetchLocality = 2;

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

// The 32 bfloat16 weights of one step (16 channels x a pair of inputs) from its 16 bytes. With
// Table, each level's float is read from a register holding 0-15 (vpermps takes an index's low 4
// bits, so the low nibble needs no mask) instead of converted: the same floats in one vector
// operation fewer (two permutes for a mask and two conversions). q4_amx_linear, where the
// rebuild bounds the kernel: SmolLM2's 120 projections out of cache at 1 / 4 / 16 / 32 rows, 2-core
// Xeon with AMX, in turns in one process (medians of 16, two rounds): 8.02 / 8.28 / 8.24 / 9.80
// -> 7.47 / 7.70 / 7.60 / 8.83 ms and 9.80 / 9.76 / 9.11 / 14.69 -> 9.55 / 9.42 / 8.78 / 14.56.
// q4_linear's own tiles (up to kQ4Rows rows) keep the conversions (not measured there); its
// rebuild past that (Q4Tiles) takes the table.
template <bool Table = false>
inline __m512bh q4_step(const char* step, const Q4Scales& g) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
  __m512 q_lo, q_hi;
  if constexpr (Table) {
    const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    q_lo = _mm512_permutexvar_ps(v, levels);
    q_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), levels);
  } else {
    q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  const __m512 lo = _mm512_fmadd_ps(q_lo, g.d_lo, g.m_lo);
  const __m512 hi = _mm512_fmadd_ps(q_hi, g.d_hi, g.m_hi);
  return _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi
}

// Past kQ4Rows rows q4_linear runs dp_linear's tiles, their weights rebuilt from the levels:
// each tile's blocks (q4_step: the vectors pack_weight_pairs holds) into the thread's scratch
// once for each pass of rows, which the pass's row tiles then read from L1/L2. dp_linear's bits
// from the levels alone, each weight decoded once a pass instead of once a row tile (two 8-row
// tiles decoding their own: 16 rows 7.27 ms against dp_linear's 5.35, session 27). SmolLM2's
// 120 projections on a 2-core Zen 5, in turns: 9 / 12 / 16 rows 4.7 / 4.6 / 5.4-5.6 ms against
// dp_linear's 5.9-6.4 / 5.7-5.9 / 5.5-5.9, 2,048 rows 450 against 431-442 (Q4_MAX_ROWS in
// worker/linear.py keeps it to 16 rows). The levels' float lookup (Table) measured 2,048 rows
// 470 -> 450 ms against the conversions.
struct Q4Tiles {
  const char* levels;         // packed by pack_q4_pairs
  int64_t level_block_bytes;  // a 16-channel block's levels: K / 32 groups of kQ4GroupBytes
  int64_t steps;              // K / 2: the 64-byte vectors of a block
  const char* tile(int64_t nb, int64_t nr) const {
    thread_local std::unique_ptr<char, decltype(&std::free)> scratch{nullptr, &std::free};
    thread_local int64_t capacity = 0;
    if (nr * steps * 64 > capacity) {
      capacity = nr * steps * 64;
      scratch.reset(static_cast<char*>(std::aligned_alloc(64, capacity)));
    }
    char* out = scratch.get();
    for (int64_t j = 0; j < nr; ++j) {
      const char* block = source(nb + j);
      for (int64_t g = 0; g < steps / 16; ++g) {
        const char* group = block + g * kQ4GroupBytes;
        const Q4Scales sc = q4_scales(group);
        for (int64_t s = 0; s < 16; ++s)
          _mm512_store_si512(out + (j * steps + 16 * g + s) * 64,
                             (__m512i)q4_step<true>(group + 64 + 16 * s, sc));
      }
    }
    return out;
  }
  const char* source(int64_t nb) const { return levels + nb * level_block_bytes; }
  int64_t lines(int64_t nr) const { return nr * level_block_bytes / 64; }
};

// MR rows from r of x (`row_bytes` = 2 K bytes each) against blocks [nb, nb + NR). Meanwhile
// `pf_lines` 64-byte lines from `pf` (the levels of the thread's next tile) are asked for into
// L2, spread over the groups.
template <int64_t MR, int64_t NR, class Store>
inline void q4_linear_tile(const char* x, const char* w, int64_t row_bytes, int64_t r, int64_t nb,
                           const char* pf, int64_t pf_lines, const Store& store) {
  const int64_t groups = row_bytes / 64, block_bytes = groups * kQ4GroupBytes;
  __m512 acc[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* xr = x + r * row_bytes;
  int64_t due = 0;
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_step<kQ4PrefetchLocality>(pf, due, pf_lines, groups);
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
                           int64_t nb, const char* pf, int64_t pf_lines, const Store& store) {
  if constexpr (MR > 0) {
    if (rem == MR) q4_linear_tile<MR, NR>(x, w, row_bytes, r, nb, pf, pf_lines, store);
    else q4_linear_tail<MR - 1, NR>(rem, x, w, row_bytes, r, nb, pf, pf_lines, store);
  }
}

// All m rows of x against blocks [nb, nb + NR), MR rows at a time (one tile where m <= MR, as
// worker/linear.py's Q4_MAX_ROWS keeps it); the first row tile asks for `next_lines` lines of
// the levels at `next` (none where null).
template <int64_t MR, int64_t NR, class Store>
inline void q4_linear_rows(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t nb,
                           const char* next, int64_t next_lines, const Store& store) {
  const int64_t lines = next != nullptr ? next_lines : 0;
  int64_t r = 0;
  for (; r + MR <= m; r += MR)
    q4_linear_tile<MR, NR>(x, w, row_bytes, r, nb, next, r == 0 ? lines : 0, store);
  q4_linear_tail<MR - 1, NR>(m - r, x, w, row_bytes, r, nb, next, r == 0 ? lines : 0, store);
}

// y = x W^T over `blocks` (even) 16-channel blocks, in tiles of NR blocks (the last blocks in
// tiles of 2 where NR does not divide them), handed out to the threads in items as
// dp_linear_run does, each tile asking for the levels of the thread's next one ahead: the
// hardware prefetcher alone left the levels' stream at a third of the memory's pace (SmolLM2's
// 120 projections, 2-core Zen 5: 1 row 3.42 ms against 1.96 with one layer's levels in cache).
template <int64_t MR, int64_t NR, class Store>
void q4_linear_run(const char* x, const char* w, int64_t m, int64_t row_bytes, int64_t blocks,
                   const Store& store) {
  const int64_t threads = at::get_num_threads();
  const int64_t block_bytes = row_bytes / 64 * kQ4GroupBytes;
  const int64_t tiles = blocks / NR, rest = (blocks - tiles * NR) / 2;
  const int64_t per_item = std::max<int64_t>(1, tiles / (threads * kDpItemsPerThread));
  const int64_t items = (tiles + per_item - 1) / per_item;
  // Item `item` (of `items + rest`) starts at this block with a tile of this many blocks.
  auto first_block = [&](int64_t item) {
    return item < items ? item * per_item * NR : tiles * NR + 2 * (item - items);
  };
  auto first_tile = [&](int64_t item) { return item < items ? NR : 2; };
  run_items(items + rest, threads, [&](int64_t item, int64_t next) {
    // What the item's last tile asks for: the first tile of the thread's next item.
    const char* after = next < items + rest ? w + first_block(next) * block_bytes : nullptr;
    const int64_t after_lines = next < items + rest ? first_tile(next) * block_bytes / 64 : 0;
    if (item >= items) {  // a tile of the last 2 blocks
      q4_linear_rows<MR, 2>(x, w, m, row_bytes, first_block(item), after, after_lines, store);
      return;
    }
    for (int64_t t = item * per_item, end = std::min(tiles, t + per_item); t < end; ++t) {
      if (t + 1 == end)
        q4_linear_rows<MR, NR>(x, w, m, row_bytes, t * NR, after, after_lines, store);
      else
        q4_linear_rows<MR, NR>(x, w, m, row_bytes, t * NR, w + (t + 1) * NR * block_bytes,
                               NR * block_bytes / 64, store);
    }
  });
}

// x `[M, K]` bfloat16, contiguous, checked against levels packed by pack_q4_pairs; N.
std::tuple<Tensor, int64_t> q4_linear_input(const Tensor& x_in, const Tensor& packed) {
  TORCH_CHECK(x_in.device().is_cpu(), "x must be on the CPU");
  Tensor x = x_in.contiguous();
  check_cpu_contiguous(packed, "packed weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
              packed.size(2) == kQ4GroupBytes && packed.size(1) * 32 == x.size(1),
              "packed weight [N / 16, K / 32, ", kQ4GroupBytes, "] uint8 for K = ", x.size(1));
  const int64_t n = packed.size(0) * 16;
  TORCH_CHECK(n % 32 == 0, "N must be a multiple of 32");
  return {x, n};
}

// y = x W^T for x `[M, K]` bfloat16 against `packed` `[N / 16, K / 32, kQ4GroupBytes]` uint8
// (pack_q4_pairs); returns `[M, N]` bfloat16, or with `silu_and_mul` (gate and up blocks
// interleaved, as for dp_linear_silu) `[M, N / 2]` silu(gate) * up: what dp_linear and
// dp_linear_silu return for the bfloat16 weight the levels stand for, bit for bit. Up to kQ4Rows
// rows in q4_linear's tiles, past that in dp_linear's over weights rebuilt a tile at a time
// (Q4Tiles).
Tensor q4_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul) {
  const auto [x, n] = q4_linear_input(x_in, packed);
  const int64_t m = x.size(0), k = x.size(1);
  Tensor y = at::empty({m, silu_and_mul ? n / 2 : n}, x.options());
  if (m > kQ4Rows) {
    const Q4Tiles tiles{bytes(packed), k / 32 * kQ4GroupBytes, k / 2};
    if (silu_and_mul)
      dp_linear_tiles_run<Bf16Pairs, kDpSiluRows, kDpSiluBlocks>(
          bytes(x), tiles, m, 2 * k, n / 16, DpSiluStore{ptr<uint16_t>(y), n / 2});
    else
      dp_linear_tiles_run<Bf16Pairs, kDpRows, kDpBlocks>(bytes(x), tiles, m, 2 * k, n / 16,
                                                         DpStore{ptr<uint16_t>(y), n});
    return y;
  }
  auto run = [&](const auto& store) {
    if (m <= kQ4FewRows)
      q4_linear_run<kQ4FewRows, kQ4FewBlocks>(bytes(x), bytes(packed), m, 2 * k, n / 16, store);
    else q4_linear_run<kQ4Rows, kQ4Blocks>(bytes(x), bytes(packed), m, 2 * k, n / 16, store);
  };
  if (silu_and_mul) run(DpSiluStore{ptr<uint16_t>(y), n / 2});
  else run(DpStore{ptr<uint16_t>(y), n});
  return y;
}

#ifdef SHOAL_AMX
// The same levels on AMX CPUs, with amx_linear's result to the bit: amx_linear_blocks' tiles
// and order, each pair of output blocks' weight tiles rebuilt (q4_step) into a scratch of the
// thread's while its first row tile runs, step j just before the tiles load it. (dp_linear's
// vdpbf16ps sums differ from the tiles' in about one output of 2,000 by a bfloat16 unit, so
// q4_linear cannot stand in for amx_linear.)
struct Q4Pairs {
  const char* w;  // levels packed by pack_q4_pairs
  int64_t kt;     // K / 32
  uint16_t* scratch;  // [2][K / 32][512] bfloat16: the pair in pack_weight_pairs' layout
  const uint16_t* pair(int64_t) const { return scratch; }
  void ready(int64_t nb, int64_t j) const {
    for (int64_t b = 0; b < 2; ++b) {
      const char* group = w + ((nb + b) * kt + j) * kQ4GroupBytes;
      const Q4Scales sc = q4_scales(group);
      uint16_t* tile = scratch + (b * kt + j) * 512;
      for (int64_t s = 0; s < 16; ++s)
        _mm512_store_si512(tile + 32 * s, (__m512i)q4_step<true>(group + 64 + 16 * s, sc));
    }
  }
  // Rebuilding the tiles sets the pace, and the next pair's levels asked for ahead keep it
  // there at every size: SmolLM2's 120 projections at 1 / 4 / 16 rows, 2-core Xeon with AMX, in
  // turns: 9.3-9.5 / 9.1-10.5 / 9.0 ms without, 7.6-8.7 / 7.6-8.8 / 6.8-7.8 with.
  static constexpr int64_t kPrefetchAbove = 0;
  const char* next(int64_t nb) const { return w + (nb + 2) * kt * kQ4GroupBytes; }
  int64_t next_lines() const { return 2 * kt * kQ4GroupBytes / 64; }
};

// y = x W^T for x `[M, K]` bfloat16 (any M >= 1) against `packed` (pack_q4_pairs); returns
// `[M, N]` bfloat16, or `[M, N / 2]` with `silu_and_mul`: what amx_linear returns for the
// bfloat16 weight the levels stand for.
Tensor q4_amx_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul) {
  const auto [x, n] = q4_linear_input(x_in, packed);
  const int64_t kt = x.size(1) / 32;
  const char* w = bytes(packed);
  return amx_linear_run(x, n, silu_and_mul, 2 * kt * 512,
                        [&](uint16_t* scratch) { return Q4Pairs{w, kt, scratch}; });
}
#endif

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

}  // namespace shoal
