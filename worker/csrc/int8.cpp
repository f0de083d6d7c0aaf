// int8 activations: W8A8's per-row quantization and dequantization, and int8_gemv, the
// weight-only int8 matmul of iterations of a few rows.

#include "common.h"
#include "ops.h"

namespace shoal {

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

#ifdef SHOAL_INT8_GEMV
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

}  // namespace shoal
