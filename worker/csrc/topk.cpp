// The LM head's candidates: topk_rows (the k largest logits of each row) and candidate_logits
// (those candidates' logits recomputed exactly).

#include "common.h"
#include "ops.h"

namespace shoal {

// ---------------------------------------------------------------------------------------------
// The k largest entries of each row (k small: the LM head's candidates), for its output. torch's
// topk and argmax along a 49,152-wide row took 2-3 ms for 32 rows here. Each row is read in
// chunks of 64: first every chunk's maximum; the k-th largest of those maxima is at most the
// row's k-th largest entry (the k largest maxima are k entries), so only the chunks whose maximum
// reaches it can hold one of the k largest, and only their entries that reach it are kept; the
// k largest of those, by value then by lower index, are the answer. An insertion into a sorted
// list of the k best as the row was scanned (ties keeping the lower index, as here) cost, at 1 /
// 8 / 64 rows of normal random logits, 71 / 150 / 1,673 us for k = 128 / 64 / 64, and 150 us for
// one row of SmolLM2's logits at k = 128 (2-core Xeon with AMX).
// ---------------------------------------------------------------------------------------------
constexpr int64_t kTopkChunk = 64;

// The k-th largest of n floats (none NaN; 1 <= k <= n), through `keys` (n of scratch): each
// float's bits made an unsigned integer of the same order, the answer's bits then set from the
// top one down, each kept where at least k keys reach it. 32 counting passes a compiler
// vectorises: std::nth_element's data-dependent branches cost about 7 us on 768 maxima.
inline float kth_largest(const float* v, int64_t n, int64_t k, uint32_t* keys) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = __builtin_bit_cast(uint32_t, v[i]);
    keys[i] = b & 0x80000000u ? ~b : b | 0x80000000u;
  }
  uint32_t answer = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = answer | (1u << bit);
    int64_t reach = 0;
#pragma omp simd reduction(+ : reach)
    for (int64_t i = 0; i < n; ++i) reach += keys[i] >= candidate;
    if (reach >= k) answer = candidate;
  }
  return __builtin_bit_cast(float, answer & 0x80000000u ? answer & 0x7fffffffu : ~answer);
}

template <typename scalar_t>
void topk_rows_impl(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  const int64_t rows = x.size(0), width = x.size(1);
  const int64_t chunks = (width + kTopkChunk - 1) / kTopkChunk;
  const scalar_t* xp = ptr<scalar_t>(x);
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> maxima(chunks);
    std::vector<uint32_t> keys(chunks);
    std::vector<std::pair<float, int64_t>> kept;  // (value, column) of the entries that reach
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = xp + r * width;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t c0 = c * kTopkChunk, c1 = std::min(width, c0 + kTopkChunk);
        float m = -std::numeric_limits<float>::infinity();  // (a NaN entry is never above it)
#pragma omp simd reduction(max : m)
        for (int64_t i = c0; i < c1; ++i) {
          const float v = to_float(row[i]);
          m = v > m ? v : m;
        }
        maxima[c] = m;
      }
      const float threshold = chunks >= k ? kth_largest(maxima.data(), chunks, k, keys.data())
                                          : -std::numeric_limits<float>::infinity();
      kept.clear();
      for (int64_t c = 0; c < chunks; ++c) {
        if (!(maxima[c] >= threshold)) continue;
        for (int64_t i = c * kTopkChunk, c1 = std::min(width, i + kTopkChunk); i < c1; ++i) {
          const float v = to_float(row[i]);
          if (v >= threshold) kept.emplace_back(v, i);
        }
      }
      const int64_t found = std::min<int64_t>(k, kept.size());
      std::partial_sort(kept.begin(), kept.begin() + found, kept.end(),
                        [](const auto& a, const auto& b) {
                          return a.first > b.first || (a.first == b.first && a.second < b.second);
                        });
      for (int64_t j = 0; j < k; ++j) {  // fewer than k only where NaN entries were skipped
        vp[r * k + j] = j < found ? kept[j].first : -std::numeric_limits<float>::infinity();
        ip[r * k + j] = j < found ? kept[j].second : 0;
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

// ---------------------------------------------------------------------------------------------
// Each row's candidates' logits recomputed exactly, after a low-precision LM head (or one rounded
// to bfloat16) chose them: out[r][j] = h[r] . weight[idx[r][j]], float32 activations against the
// weight rows widened exactly. Done in torch (index_select, widen, einsum) this cost 1.18 ms for
// 64 rows of 64 candidates and 0.15-0.17 ms for a single row (SmolLM2's head out of cache, 2-core
// Zen 5): the gathered rows written twice and four op calls. Here each candidate's row is read
// once, straight from the weight, the next ones asked for ahead (they lie anywhere in 56 MB).
// The sum runs in 16 partial sums (lane i takes elements i, i + 16, ...) added in one fixed
// order: a row gets the same bits whatever the other rows, the number of candidates or the
// threads.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kCandidateLanes = 16;
// Candidates whose rows are asked for in advance (4, 8 and 16 measured alike).
constexpr int64_t kCandidatesAhead = 8;
constexpr int64_t kCandidateGrain = 128;  // candidates a thread takes at least

template <typename scalar_t>
void candidate_logits_impl(const Tensor& h, const Tensor& weight, const Tensor& idx, Tensor& out) {
  const int64_t k = idx.size(1), d = h.size(1);
  const float* hp = h.data_ptr<float>();
  const scalar_t* wp = ptr<scalar_t>(weight);
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(scalar_t));
  auto ask = [&](int64_t i) {  // candidate i's row, into L1
    for (int64_t off = 0; off < row_bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(wp + ip[i] * d) + off, 0, 3);
  };
  at::parallel_for(0, idx.numel(), kCandidateGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < std::min(end, begin + kCandidatesAhead); ++i) ask(i);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kCandidatesAhead < end) ask(i + kCandidatesAhead);
      const float* x = hp + i / k * d;
      const scalar_t* w = wp + ip[i] * d;
      float acc[kCandidateLanes] = {};
      int64_t e = 0;
      for (; e + kCandidateLanes <= d; e += kCandidateLanes)
        for (int64_t l = 0; l < kCandidateLanes; ++l) acc[l] += x[e + l] * to_float(w[e + l]);
      for (int64_t l = 0; e + l < d; ++l) acc[l] += x[e + l] * to_float(w[e + l]);
      float sum = 0.f;
      for (int64_t l = 0; l < kCandidateLanes; ++l) sum += acc[l];
      op[i] = sum;
    }
  });
}

Tensor candidate_logits(const Tensor& h, const Tensor& weight, const Tensor& idx) {
  check_cpu_contiguous(h, "h");
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(idx, "idx");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h: [rows, hidden] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == h.size(1), "weight: [vocab, hidden]");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == h.size(0) && idx.scalar_type() == at::kLong,
              "idx: [rows, k] int64");
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t vocab = weight.size(0);
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < vocab, "candidate_logits: index ", ip[i], " out of range");
  Tensor out = at::empty(idx.sizes(), h.options());
  dispatch_storage(weight.scalar_type(), "candidate_logits", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    candidate_logits_impl<scalar_t>(h, weight, idx, out);
  });
  return out;
}

}  // namespace shoal
