// decode_stack: every layer of an iteration of a few rows in one call.

#include "common.h"
#include "ops.h"

namespace shoal {

#if defined(SHOAL_LANES) || defined(SHOAL_BF16_PAIRS)
// ---------------------------------------------------------------------------------------------
// Every layer of an iteration of a few rows in one call: the loop of worker/model.py's
// `LlamaModel.forward`, the same kernels in the same order on the same rows (the same bits). A
// decode step of SmolLM2 otherwise makes about 240 op calls from Python, each paying the
// interpreter and the dispatcher.
//   x            [n, hidden] float32, the embeddings (not modified).
//   weights      per layer: attention RMSNorm weight, packed QKV, packed O, MLP RMSNorm weight,
//                packed gate/up, packed down. Each projection runs the kernel its packed weight
//                is for: uint8 GGUF 4-bit levels through q4_lanes_linear (float32) or, with
//                `pairs`, q4_linear (bfloat16); float32 lanes through f32_linear; bfloat16
//                pairs through dp_linear. With `pairs` gate and up blocks are interleaved
//                (dp_linear_silu's and q4_linear's SwiGLU order). Where AMX serves (the
//                process may use its tiles: worker/linear.py then chose them), bfloat16 levels
//                go through q4_amx_linear and pairs through amx_linear, SwiGLU in the same
//                order from their accumulators. Under `--quantization int4` where
//                int4_q8_linear serves, each projection is two entries, its levels and its
//                scales (10 a layer): int4_q8_linear, then silu_and_mul for gate/up.
//   output_rows  the rows whose output is wanted (the last layer's O and MLP run on them
//                alone), or none for all.
// Returns the last layer's output [rows, hidden] float32, before the final RMSNorm.
Tensor decode_stack(const Tensor& embedded, at::TensorList weights, at::TensorList k_pools,
                    at::TensorList v_pools, const Tensor& positions, const Tensor& cos_sin,
                    const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& query_start_loc, const Tensor& seq_lens,
                    const c10::optional<Tensor>& output_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool pairs) {
  const size_t layers = k_pools.size();
  TORCH_CHECK(layers > 0 && v_pools.size() == layers &&
                  (weights.size() == 6 * layers || weights.size() == 10 * layers),
              "decode_stack: 6 weights (10 with int4 scales) and a K and V pool per layer");
  const size_t per_layer = weights.size() / layers;
  const bool int4 = per_layer == 10;
#ifndef SHOAL_INT4_Q8
  TORCH_CHECK(!int4, "decode_stack: int4_q8_linear is not built on this CPU");
#endif
  // int4_q8_linear takes either dtype; `pairs` then only sets the dtype of the norms' outputs
  // and the attention (the loop's bfloat16 on a CPU without the bfloat16 kernels, too).
#ifndef SHOAL_BF16_PAIRS
  TORCH_CHECK(!pairs || int4, "decode_stack: the bfloat16 kernels are not built on this CPU");
#endif
#ifndef SHOAL_LANES
  TORCH_CHECK(pairs || int4, "decode_stack: the float32 lanes kernels are not built on this CPU");
#endif
  const at::ScalarType dtype = pairs ? at::kBFloat16 : at::kFloat;
#ifdef SHOAL_AMX
  const bool amx = pairs && amx_permitted();
#endif
  // `w` points at the projection's entries: its packed weight, then (int4) its scales.
  const auto linear = [&](const Tensor& in, const Tensor* w, bool silu) -> Tensor {
#ifdef SHOAL_INT4_Q8
    if (int4) {
      Tensor y = int4_q8_linear(in, w[0], w[1]);
      return silu ? silu_and_mul(y) : y;
    }
#endif
    const Tensor& packed = w[0];
    const bool levels = packed.scalar_type() == at::kByte;
#ifdef SHOAL_AMX
    if (amx) return levels ? q4_amx_linear(in, packed, silu) : amx_linear(in, packed, silu);
#endif
#ifdef SHOAL_BF16_PAIRS
    if (pairs) {
      if (levels) return q4_linear(in, packed, silu);
      return silu ? dp_linear_silu(in, packed) : dp_linear(in, packed);
    }
#endif
#ifdef SHOAL_LANES
    if (!pairs) {
      Tensor y = levels ? q4_lanes_linear(in, packed) : f32_linear(in, packed);
      return silu ? silu_and_mul(y) : y;
    }
#endif
    TORCH_CHECK(false, "unreachable");
  };
  Tensor x = embedded.clone();  // the residual stream, updated in place layer by layer
  c10::optional<Tensor> delta;
  for (size_t l = 0; l < layers; ++l) {
    // Where each entry lies: the norms, then each projection's one or two entries.
    const Tensor* w = weights.data() + per_layer * l;
    const size_t p = int4 ? 2 : 1;
    const Tensor *qkv = w + 1, *o = qkv + p, *mlp_norm = o + p, *gate_up = mlp_norm + 1,
                 *down = gate_up + p;
    Tensor h = add_rms_norm(x, delta, w[0], eps, dtype);
    Tensor a = attend_qkv(linear(h, qkv, false), positions, cos_sin, k_pools[l], v_pools[l],
                          slot_mapping, block_tables, query_start_loc, seq_lens, num_heads,
                          num_kv_heads, head_dim, scale);
    if (l + 1 == layers && output_rows) {
      a = a.index_select(0, *output_rows);
      x = x.index_select(0, *output_rows);
      if (a.size(0) == 0) return x;
    }
    h = add_rms_norm(x, linear(a, o, false), *mlp_norm, eps, dtype);
    delta = linear(linear(h, gate_up, true), down, false);
  }
  if (delta) x.add_(*delta);
  return x;
}
#endif

}  // namespace shoal
