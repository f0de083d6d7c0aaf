// Structured outputs' token masks: apply_token_bitmask_ sets to -inf every logit a request's
// constraint does not allow next (worker/structured_output.py).

#include "common.h"
#include "ops.h"

namespace shoal {

// ---------------------------------------------------------------------------------------------
// llguidance's bitmask gives one bit a vocabulary entry, token 32 * w + j in bit j of int32 word
// w. Unpacking it to a boolean tensor and masked_fill took 4.4 + 2.0 ms at 64 rows of SmolLM2's
// 49,152 logits (2-core Zen 4): eight bytes of index a bit. Here each word is read once; a word of
// all ones (inside a JSON string, nearly every word) is skipped, the others clear their entries,
// with AVX-512 as two masked stores of 16 lanes (a bit loop took 2.0 ms for 64 rows of a regex's
// mask where most words are mixed).
// ---------------------------------------------------------------------------------------------
void apply_token_bitmask_(Tensor logits, const Tensor& bitmask, const Tensor& rows) {
  check_cpu_contiguous(logits, "logits");
  check_cpu_contiguous(bitmask, "bitmask");
  check_cpu_contiguous(rows, "rows");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits: [rows, vocab] float32");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt, "bitmask: [n, words] int32");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == bitmask.size(0) && rows.scalar_type() == at::kLong,
              "rows: [n] int64, a logits row for each bitmask row");
  const int64_t n = rows.size(0), words = bitmask.size(1), vocab = logits.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "apply_token_bitmask_: row ", rp[i],
                " out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * vocab;
      const uint32_t* m = mp + i * words;
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xffffffffu) continue;
        const int64_t base = w * 32, width = std::min<int64_t>(32, vocab - base);
#if defined(__AVX512F__)
        if (width == 32) {
          const __m512 neg_inf = _mm512_set1_ps(kNegInf);
          _mm512_mask_storeu_ps(row + base, static_cast<__mmask16>(~bits & 0xffffu), neg_inf);
          _mm512_mask_storeu_ps(row + base + 16, static_cast<__mmask16>(~bits >> 16), neg_inf);
          continue;
        }
#endif
        for (int64_t j = 0; j < width; ++j)
          if (!((bits >> j) & 1u)) row[base + j] = kNegInf;
      }
      for (int64_t j = words * 32; j < vocab; ++j) row[j] = kNegInf;  // past the mask
    }
  });
}

}  // namespace shoal
