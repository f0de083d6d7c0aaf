// Paged attention (PagedAttention, Kwon et al., SOSP'23): the K/V cache writes, decode and prefill
// attention against each request's own blocks (AVX-512 / AVX2 lanes, AVX512_BF16 pairs, AMX
// tiles), RoPE, and attend_qkv, the three of them in one call.

#include "common.h"
#include "ops.h"

namespace shoal {

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
  int64_t padded;  // len rounded up to the block size, then to a multiple of 16
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

// Decode attention asks for a request's K blocks this many blocks before it scores them.
constexpr int64_t kPrefetchBlocks = 4;
// ... and, besides asking for each V block as it scores the keys of its block, asks for it
// again this many blocks before the weighted sum of values reads it: of the requests made during
// the key pass many came too late or not at all (64 requests of 140-260 tokens, 30 layers' pools
// out of cache, 2-core Zen 5, in turns: 14.18 -> 12.92 ms, 3 blocks ahead 12.90 against 12.96,
// without the key pass's requests 13.26 against 12.71; decode at batch 64 1,696 -> 1,744 tokens/s,
// W64 566.3 against 568.4).
constexpr int64_t kValuePrefetchBlocks = 2;

// Softmax of each of the G score rows over its first `len` entries, in place, then zeros up to
// `padded` (the row's length, a multiple of 16: so a tile's shorter rows add nothing past their
// length); returns 1 / sum per row in inv_sum (the output is scaled once at the end). The
// exponentials run over whole vectors to `padded`, the entries past `len` (scores of a block's
// unused slots, or of keys a shorter row does not see) selected away: a loop to `len` left up to
// 15 of them a row to scalar code, a fifth of a prefill's attention time (perf, 2-core Xeon).
inline void softmax_rows(float* scores, int64_t g, int64_t len, int64_t padded, float* inv_sum) {
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * padded;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
    // 16 lanes' sums, as a vector (a loop of fixed length 16 that GCC vectorises whole).
    float lanes[16] = {};
    for (int64_t t0 = 0; t0 < padded; t0 += 16)
      for (int64_t u = 0; u < 16; ++u) {
        const float e = fast_exp(s[t0 + u] - m);
        s[t0 + u] = t0 + u < len ? e : 0.f;
        lanes[u] += s[t0 + u];
      }
#pragma GCC unroll 4
    for (int64_t w = 8; w >= 1; w /= 2)  // pairwise, in vector steps (in turn: 16 dependent adds)
      for (int64_t u = 0; u < w; ++u) lanes[u] += lanes[u + w];
    inv_sum[j] = 1.f / lanes[0];
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
    softmax_rows(it.scores + r * G * it.padded, G, it.len - (R - 1 - r), it.padded,
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

// Blocks of keys a decode row scores at once: each (query, block) accumulator is a chain of D
// dependent FMAs, and a decode row's G = 3 chains kept the FMA units waiting on their latency;
// two blocks' chains interleaved hide most of it, with each lane summing over D in the same order
// as before (the same bits). 64 requests of 140-260 tokens, 30 layers' pools out of cache, 2
// threads of a Zen 5, in turns: 14.03 -> 12.85 ms (four blocks at once: 13.57 against 13.13).
// Past 8 queries (a prefill tile of 3 or 4 heads) or on AVX2 (16 ymm) the registers hold one
// block's accumulators.
constexpr int64_t attend_key_blocks(int64_t q) {
#if defined(__AVX512F__)
  return q <= 8 ? 2 : 1;
#else
  (void)q;
  return 1;
#endif
}

// Scores of Q queries against N blocks of 16 keys from block b on, into it.scores.
template <typename scalar_t, int64_t Q, int64_t D, int64_t N>
inline void score_blocks16(const AttnItem<scalar_t>& it, int64_t b, int64_t nblocks) {
  constexpr int64_t BS = 16;
  const scalar_t* kb[N];
  for (int64_t u = 0; u < N; ++u) {
    kb[u] = it.k_head + it.table[b + u] * D * BS;
    if (b + u + kPrefetchBlocks < nblocks)
      prefetch(it.k_head + it.table[b + u + kPrefetchBlocks] * D * BS, D * BS);
    prefetch(it.v_head + it.table[b + u] * BS * D, BS * D);  // for the weighted sum of values
  }
  Lanes16 acc[N][Q];
  for (int64_t u = 0; u < N; ++u)
    for (int64_t j = 0; j < Q; ++j) acc[u][j] = Lanes16::zero();
  for (int64_t e = 0; e < D; ++e) {
    Lanes16 kf[N];
    for (int64_t u = 0; u < N; ++u) kf[u] = Lanes16::load(kb[u] + e * BS);
    for (int64_t j = 0; j < Q; ++j) {
      const Lanes16 qe = Lanes16::all(it.q[j * D + e]);
      for (int64_t u = 0; u < N; ++u) acc[u][j] = fmadd(qe, kf[u], acc[u][j]);
    }
  }
  for (int64_t u = 0; u < N; ++u)
    for (int64_t j = 0; j < Q; ++j) acc[u][j].store(it.scores + j * it.padded + (b + u) * BS);
}

template <typename scalar_t, int64_t G, int64_t D, int64_t R>
void attend16(const AttnItem<scalar_t>& it) {
  constexpr int64_t BS = 16, Q = R * G, DC = attend_columns(Q, D, R), NV = DC / 16;
  constexpr int64_t KB = attend_key_blocks(Q);
  static_assert(D % DC == 0 && DC % 16 == 0, "head_dim must be a multiple of 32");
  const int64_t nblocks = (it.len + BS - 1) / BS;
  for (int64_t b = 1; b < std::min(kPrefetchBlocks, nblocks); ++b)
    prefetch(it.k_head + it.table[b] * D * BS, D * BS);
  int64_t b = 0;
  for (; b + KB <= nblocks; b += KB) score_blocks16<scalar_t, Q, D, KB>(it, b, nblocks);
  for (; b < nblocks; ++b) score_blocks16<scalar_t, Q, D, 1>(it, b, nblocks);
  float inv_sum[Q];
  for (int64_t r = 0; r < R; ++r)
    softmax_rows(it.scores + r * G * it.padded, G, it.len - (R - 1 - r), it.padded,
                 inv_sum + r * G);
  for (int64_t c = 0; c < D; c += DC) {
    Lanes16 o[Q][NV];
    for (int64_t j = 0; j < Q; ++j)
      for (int64_t u = 0; u < NV; ++u) o[j][u] = Lanes16::zero();
    for (int64_t v = 0; v < std::min(kValuePrefetchBlocks, nblocks); ++v)
      prefetch(it.v_head + it.table[v] * BS * D, BS * D);
    for (int64_t t = 0; t < it.len; ++t) {
      if (t % BS == 0 && t / BS + kValuePrefetchBlocks < nblocks)
        prefetch(it.v_head + it.table[t / BS + kValuePrefetchBlocks] * BS * D, BS * D);
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
  softmax_rows(it.scores, g, it.len, it.padded, inv_sum);
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

#ifdef SHOAL_BF16_PAIRS
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

#ifdef SHOAL_AMX
// AMX tiles (Intel Sapphire Rapids and later): the prefill kernel above with tile products,
// 16 query rows by 16 keys (or 16 output columns) by 32 pairs per tdpbf16ps; and the projections
// of small iterations (amx_linear, pairs.cpp). Measured on a 2-core Xeon with AMX: docs/engine.md.

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
      // Rows of scores: whole blocks, and whole vectors of 16 for softmax_rows.
      const int64_t h = item % hkv, padded = ((w.len + bs - 1) / bs * bs + 15) / 16 * 16;
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

}  // namespace shoal
