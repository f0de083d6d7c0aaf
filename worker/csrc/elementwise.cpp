// Fused elementwise ops of the non-attention chain: residual add + RMSNorm, SwiGLU's SiLU x up.

#include "common.h"
#include "ops.h"

namespace shoal {

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

}  // namespace shoal
