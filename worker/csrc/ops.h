// The engine's CPU operators, `shoal::*` in torch (schemas and registration: library.cpp), one
// declaration each, grouped by the file that defines them. Tensors are CPU tensors; "bfloat16"
// storage is uint16_t inside the kernels. What each computes, its layouts and its figures are
// beside its definition.
#pragma once

#include <tuple>

#include "common.h"

namespace shoal {

// attention.cpp: the paged K/V cache, attention, RoPE.
void write_kv(const Tensor& k, const Tensor& v, Tensor k_pool, Tensor v_pool, const Tensor& slots);
Tensor paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                       const Tensor& block_tables, const Tensor& query_start_loc,
                       const Tensor& seq_lens, double scale);
void rope_(Tensor qkv, const Tensor& positions, const Tensor& cos_sin, int64_t num_heads,
           int64_t head_dim);
Tensor attend_qkv(Tensor qkv, const Tensor& positions, const Tensor& cos_sin, Tensor k_pool,
                  Tensor v_pool, const Tensor& slot_mapping, const Tensor& block_tables,
                  const Tensor& query_start_loc, const Tensor& seq_lens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, double scale);

// elementwise.cpp
Tensor add_rms_norm(Tensor x, const c10::optional<Tensor>& delta, const Tensor& weight, double eps,
                    at::ScalarType out_dtype);
Tensor silu_and_mul(const Tensor& gate_up);

// int8.cpp
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x);
Tensor dequantize_rows(const Tensor& acc, const Tensor& row_scale, const Tensor& col_scale,
                       bool silu_and_mul, at::ScalarType out_dtype);
#ifdef SHOAL_INT8_GEMV
Tensor int8_gemv(const Tensor& x, const Tensor& w, const Tensor& w_scale, const Tensor& w_sum);
#endif

// lanes.cpp
#ifdef SHOAL_LANES
Tensor int8_linear(const Tensor& x, const Tensor& w, const Tensor& scale);
Tensor f32_linear(const Tensor& x, const Tensor& w);
Tensor q4_lanes_linear(const Tensor& x, const Tensor& packed);
Tensor int4_linear(const Tensor& x, const Tensor& w, const Tensor& scale_min);
#endif

// int4_q8.cpp
#ifdef SHOAL_INT4_Q8
Tensor int4_q8_linear(const Tensor& x, const Tensor& w, const Tensor& scale_min);
#endif

// sample.cpp
Tensor sample_rows(const Tensor& logits, const Tensor& temperature, const Tensor& u);
Tensor log_normalizers(const Tensor& logits, const Tensor& temperature);

// bitmask.cpp
void apply_token_bitmask_(Tensor logits, const Tensor& bitmask, const Tensor& rows);

// topk.cpp
std::tuple<Tensor, Tensor> topk_rows(const Tensor& x, int64_t k);
Tensor candidate_logits(const Tensor& h, const Tensor& weight, const Tensor& idx);

// pairs.cpp
#ifdef SHOAL_BF16_PAIRS
Tensor pack_weight_pairs(const Tensor& w);
Tensor dp_linear(const Tensor& x_in, const Tensor& packed);
Tensor dp_linear_silu(const Tensor& x_in, const Tensor& packed);
Tensor q4_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul);
#if defined(__AVX512VNNI__)
Tensor vnni_linear(const Tensor& x_in, const Tensor& row_scale, const Tensor& packed,
                   const Tensor& col_scale, const Tensor& col_sum, bool silu_and_mul);
#endif
#endif
#ifdef SHOAL_AMX
Tensor amx_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul);
Tensor q4_amx_linear(const Tensor& x_in, const Tensor& packed, bool silu_and_mul);
#endif

// decode_stack.cpp
#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
Tensor decode_stack(const Tensor& embedded, at::TensorList weights, at::TensorList k_pools,
                    at::TensorList v_pools, const Tensor& positions, const Tensor& cos_sin,
                    const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& query_start_loc, const Tensor& seq_lens,
                    const c10::optional<Tensor>& output_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool pairs);
#endif

}  // namespace shoal
