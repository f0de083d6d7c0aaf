// topk_rows: the k largest entries of each row of the LM head's logits.

#include "common.h"
#include "ops.h"

namespace shoal {

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

}  // namespace shoal
