// Sampling by inverse transform over whole rows of logits (worker/sampler.py).

#include "common.h"
#include "ops.h"

namespace shoal {

// ---------------------------------------------------------------------------------------------
// Row r's token: the first index whose running sum of weights w_i = exp((x_i - max) / T_r)
// reaches u_r times their total (at least the smallest normal float, so a token of zero weight
// is never chosen; where rounding leaves the running sum short of it, the last index of positive
// weight). A weight is 0 where its logit is -inf (a token masked out) or its exponent is below
// -87.3 (fast_exp would give 1e-38 there, not 0). In torch (divide, softmax, cumsum,
// searchsorted) 64 rows of SmolLM2's 49,152 logits took 4.4 ms an iteration (2-core Zen 4):
// four passes that each write the whole matrix. Here one pass writes each row's weights and the
// sums of their blocks of 64, the blocks' running sum (in double) finds the block, and a scan
// of that block the index.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kSampleBlock = 64;

// Row x's weights into w (vocab entries, then zeros to a whole block) and their blocks' sums;
// returns the row's largest logit (-inf when every token is masked, the weights then unset).
inline float row_weights(const float* x, int64_t vocab, float inv_t, float* w, float* block_sum) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < vocab; ++i) m = x[i] > m ? x[i] : m;
  if (m == -std::numeric_limits<float>::infinity()) return m;
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kSampleBlock, hi = std::min(lo + kSampleBlock, vocab);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) {
      const float z = (x[i] - m) * inv_t;  // -inf for a masked token
      const float e = z < -87.3f ? 0.f : fast_exp(z);
      w[i] = e;
      s += e;
    }
    block_sum[b] = s;
  }
  return m;
}

void check_sampling_rows(const Tensor& logits, const Tensor& temperature) {
  check_cpu_contiguous(logits, "logits");
  check_cpu_contiguous(temperature, "temperature");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits: [rows, vocab] float32");
  TORCH_CHECK(temperature.numel() == logits.size(0) && temperature.scalar_type() == at::kFloat,
              "temperature: [rows] float32");
  const float* tp = temperature.data_ptr<float>();
  for (int64_t r = 0; r < logits.size(0); ++r) TORCH_CHECK(tp[r] > 0.f, "temperature must be > 0");
}

Tensor sample_rows(const Tensor& logits, const Tensor& temperature, const Tensor& u) {
  check_sampling_rows(logits, temperature);
  check_cpu_contiguous(u, "u");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(u.numel() == rows && u.scalar_type() == at::kFloat, "u: [rows] float32");
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(blocks * kSampleBlock, 0.f), block_sum(blocks);
    for (int64_t r = begin; r < end; ++r) {
      if (row_weights(lp + r * vocab, vocab, 1.f / tp[r], w.data(), block_sum.data()) ==
          -std::numeric_limits<float>::infinity()) {
        op[r] = 0;  // every token masked: no choice
        continue;
      }
      double total = 0.0;
      for (int64_t b = 0; b < blocks; ++b) total += block_sum[b];
      const double target = std::max(static_cast<double>(up[r]) * total,
                                     static_cast<double>(std::numeric_limits<float>::min()));
      double acc = 0.0;
      int64_t b = 0;
      while (b < blocks - 1 && acc + block_sum[b] < target) acc += block_sum[b++];
      const int64_t lo = b * kSampleBlock, hi = std::min(lo + kSampleBlock, vocab);
      int64_t pick = -1;
      for (int64_t i = lo; i < hi; ++i) {
        if (w[i] > 0.f) pick = i;
        acc += w[i];
        if (acc >= target && w[i] > 0.f) break;
      }
      if (pick < 0)  // the block held no weight (rounding ran past the last one): go back
        for (int64_t i = lo - 1; i >= 0 && pick < 0; --i)
          if (w[i] > 0.f) pick = i;
      op[r] = pick < 0 ? 0 : pick;  // (no weight anywhere: NaN logits; still a token id)
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Each row's log-normalizer at its temperature, log(sum_i exp(x_i / T)), as m / T + log(sum of
// the weights above): token i's probability is exp(x_i / T - it). Top-k and top-p rows take
// their candidates' probabilities from it (`topk_rows` on the logits), not from a softmax
// written over the whole row.
// ---------------------------------------------------------------------------------------------
Tensor log_normalizers(const Tensor& logits, const Tensor& temperature) {
  check_sampling_rows(logits, temperature);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  Tensor out = at::empty({rows}, logits.options());
  float* op = out.data_ptr<float>();
  const int64_t blocks = (vocab + kSampleBlock - 1) / kSampleBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(blocks * kSampleBlock, 0.f), block_sum(blocks);
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = 1.f / tp[r];
      const float m = row_weights(lp + r * vocab, vocab, inv_t, w.data(), block_sum.data());
      double total = 0.0;
      for (int64_t b = 0; b < blocks && m != -std::numeric_limits<float>::infinity(); ++b)
        total += block_sum[b];
      op[r] = m == -std::numeric_limits<float>::infinity() ? m
                                                           : m * inv_t + static_cast<float>(std::log(total));
    }
  });
  return out;
}

}  // namespace shoal
