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
//                order from their accumulators.
//   output_rows  the rows whose output is wanted (the last layer's O and MLP run on them
//                alone), or none for all.
// Returns the last layer's output [rows, hidden] float32, before the final RMSNorm.
Tensor decode_stack(const Tensor& embedded, at::TensorList weights, at::TensorList k_pools,
                    at::TensorList v_pools, const Tensor& positions, const Tensor& cos_sin,
                    const Tensor& slot_mapping, const Tensor& block_tables,
                    const Tensor& query_start_loc, const Tensor& seq_lens,
                    const c10::optional<Tensor>& output_rows, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool pairs) {
  constexpr size_t kPerLayer = 6;
  const size_t layers = k_pools.size();
  TORCH_CHECK(weights.size() == kPerLayer * layers && v_pools.size() == layers,
              "decode_stack: 6 weights and a K and V pool per layer");
#ifndef SHOAL_BF16_PAIRS
  TORCH_CHECK(!pairs, "decode_stack: the bfloat16 kernels are not built on this CPU");
#endif
#ifndef SHOAL_LANES
  TORCH_CHECK(pairs, "decode_stack: the float32 lanes kernels are not built on this CPU");
#endif
  const at::ScalarType dtype = pairs ? at::kBFloat16 : at::kFloat;
#ifdef SHOAL_AMX
  const bool amx = pairs && amx_permitted();
#endif
  const auto linear = [&](const Tensor& in, const Tensor& packed, bool silu) -> Tensor {
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
    const Tensor* w = weights.data() + kPerLayer * l;
    Tensor h = add_rms_norm(x, delta, w[0], eps, dtype);
    Tensor a = attend_qkv(linear(h, w[1], false), positions, cos_sin, k_pools[l], v_pools[l],
                          slot_mapping, block_tables, query_start_loc, seq_lens, num_heads,
                          num_kv_heads, head_dim, scale);
    if (l + 1 == layers && output_rows) {
      a = a.index_select(0, *output_rows);
      x = x.index_select(0, *output_rows);
      if (a.size(0) == 0) return x;
    }
    h = add_rms_norm(x, linear(a, w[2], false), w[3], eps, dtype);
    delta = linear(linear(h, w[4], true), w[5], false);
  }
  if (delta) x.add_(*delta);
  return x;
}
#endif

}  // namespace shoal
