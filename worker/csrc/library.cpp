// The CPU kernels of the worker's engine, registered as torch operators `shoal::*`.
//
// Built on first use by worker/cpu_ops.py (torch.utils.cpp_extension, against the torch that is
// installed, so the ABI always matches). Every kernel computes in float32 whatever the storage
// dtype (float32 or bfloat16), and parallelises with at::parallel_for, which honours
// torch.set_num_threads (its OpenMP pragmas are inline in ATen's headers: build with -fopenmp).
// Loops are written for the compiler to vectorise (-O3 -march=native, `omp simd` reductions), so
// the files build on any CPU gcc targets; paged attention and SiLU x up have AVX-512 versions
// written out, the projections run on AVX512_BF16 / VNNI dot products where the CPU has them
// (dp_linear, vnni_linear), and where -march=native brings AMX, prefill attention and the
// projections of small iterations run on AMX tiles (SHOAL_AMX).
//
// One file a family of kernels, their C++ signatures in ops.h: attention.cpp (the paged K/V
// cache, attention, RoPE), elementwise.cpp (add + RMSNorm, SwiGLU), int8.cpp (int8 activations),
// lanes.cpp (float32-activation matmuls on 16-channel vectors), int4_q8.cpp, topk.cpp, bitmask.cpp
// (structured outputs' masks), sample.cpp (sampling whole rows), pairs.cpp
// (bfloat16 pair dot products and AMX tiles), decode_stack.cpp (every layer in one call), and
// what they share in common.h. This file only names the operators' schemas.

#include <torch/library.h>

#include "ops.h"

using namespace shoal;

TORCH_LIBRARY(shoal, m) {
#ifdef SHOAL_AMX
  m.def("amx_available() -> bool", [] { return amx_permitted(); });
#endif
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, ScalarType out_dtype) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
#ifdef SHOAL_INT8_GEMV
  m.def("int8_gemv(Tensor x, Tensor w, Tensor w_scale, Tensor w_sum) -> Tensor");
#endif
#ifdef SHOAL_LANES
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q4_lanes_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale_min) -> Tensor");
#endif
#ifdef SHOAL_INT4_Q8
  m.def("int4_q8_linear(Tensor x, Tensor w, Tensor scale_min) -> Tensor");
#endif
  m.def("dequantize_rows(Tensor acc, Tensor row_scale, Tensor col_scale, bool silu_and_mul, "
        "ScalarType out_dtype) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
  m.def("log_normalizers(Tensor logits, Tensor temperature) -> Tensor");
  m.def("candidate_logits(Tensor h, Tensor weight, Tensor idx) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int num_heads, int head_dim) -> ()");
  m.def("attend_qkv(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, Tensor(b!) k_pool, "
        "Tensor(c!) v_pool, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float scale) -> Tensor");
#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
  m.def("decode_stack(Tensor x, Tensor[] weights, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
        "Tensor positions, Tensor cos_sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor? output_rows, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale, bool pairs) -> Tensor");
#endif
#ifdef SHOAL_BF16_PAIRS
  m.def("pack_weight_pairs(Tensor weight) -> Tensor");
  m.def("dp_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("dp_linear_silu(Tensor x, Tensor packed) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor packed, bool silu_and_mul) -> Tensor");
#if defined(__AVX512VNNI__)
  m.def("vnni_linear(Tensor x, Tensor row_scale, Tensor packed, Tensor col_scale, Tensor col_sum, "
        "bool silu_and_mul) -> Tensor");
#endif
#endif
#ifdef SHOAL_AMX
  m.def("amx_linear(Tensor x, Tensor packed, bool silu_and_mul=False) -> Tensor");
  m.def("q4_amx_linear(Tensor x, Tensor packed, bool silu_and_mul=False) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(shoal, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("quantize_rows", &quantize_rows);
#ifdef SHOAL_INT8_GEMV
  m.impl("int8_gemv", &int8_gemv);
#endif
#ifdef SHOAL_LANES
  m.impl("int8_linear", &int8_linear);
  m.impl("f32_linear", &f32_linear);
  m.impl("q4_lanes_linear", &q4_lanes_linear);
  m.impl("int4_linear", &int4_linear);
#endif
#ifdef SHOAL_INT4_Q8
  m.impl("int4_q8_linear", &int4_q8_linear);
#endif
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("topk_rows", &topk_rows);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("sample_rows", &sample_rows);
  m.impl("log_normalizers", &log_normalizers);
  m.impl("candidate_logits", &candidate_logits);
  m.impl("rope_", &rope_);
  m.impl("attend_qkv", &attend_qkv);
#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
  m.impl("decode_stack", &decode_stack);
#endif
#ifdef SHOAL_BF16_PAIRS
  m.impl("pack_weight_pairs", &pack_weight_pairs);
  m.impl("dp_linear", &dp_linear);
  m.impl("dp_linear_silu", &dp_linear_silu);
  m.impl("q4_linear", &q4_linear);
#if defined(__AVX512VNNI__)
  m.impl("vnni_linear", &vnni_linear);
#endif
#endif
#ifdef SHOAL_AMX
  m.impl("amx_linear", &amx_linear);
  m.impl("q4_amx_linear", &q4_amx_linear);
#endif
}

