"""The engine's projections: `y = x @ W.T`, with the weight held in the layouts that are fastest
for the number of rows an iteration brings.

- **oneDNN prepacked bfloat16 and float32** (`torch.ops.mkldnn._linear_pointwise` on a weight
  reordered once by `_reorder_linear_weight`, what inductor's `freezing=True` does for CPU
  linears). Measured per SmolLM2 layer (four projections, 2 threads), bfloat16: 1 row 730 ->
  420 µs, 8 rows 666 -> 424 µs, 64 rows 1,445 -> 1,058 µs, 2,048 rows 22.2 -> 23.5 ms; results
  equal `F.linear`'s to 3e-5. float32, one [3072, 576] projection on an AMD EPYC (weights out of
  cache): 3 rows 1,118 -> 238 µs (MKL's small-M sgemm reads weights at about 7 GB/s), 64 rows
  1,624 -> 639 µs, 2,048 rows 41 -> 17 ms; relative difference to `F.linear` about 3e-6.
- **Weight-only quantization for small iterations** (`--quantization`), where a step is bound by
  reading weights. Measured on an AMD EPYC, all 120 SmolLM2 projections with weights out of cache
  (2 threads), ms per step (identical runs on this shared host vary by up to 1.5x):

  | rows | 1 | 2 | 4 | 8 | 16 |
  | --- | --- | --- | --- | --- | --- |
  | bfloat16 prepacked | 13.0 | | 9.6 | 11.4 | 14.4 |
  | int8, `aten._weight_int8pack_mm` (per-output-channel scales) | 8.3-10.5 | 11.3 | 11.4 | 20.6-21.8 | 32.1 |
  | int8, `shoal::int8_gemv` (VNNI, int8 activations) | 5.0 | 4.6 | 5.3 | 10.1 | |
  | int4, `aten._weight_int4pack_mm_for_cpu` (groups of 32, scale and zero) | 4.0-4.8 | 5.7 | 6.5-7.7 | 11.2 | 21.2 |

  so int8 weights serve iterations of at most 2 rows through torch's kernel, and int4 at most 4;
  larger ones use the bfloat16 weight, kept next to the quantized copy. `shoal::int8_gemv`
  quantizes each row of the activations to int8 on the fly (as llama.cpp's Q8 activations) and
  multiplies with vpdpbusd, up to 4 rows. It serves the LM head under any quantization
  (SmolLM2's at 1 row: 2.5 -> 0.6 ms), where greedy tokens are recomputed exactly anyway. On the
  projections, int8 activations cost perplexity one token per iteration (512 tokens: 19.16
  against 18.86 on all four; 160 tokens: +4.6% on QKV and gate/up alone), so they keep weight-only
  int8. A VNNI kernel for the int4 levels (int8 activations, Q4_1's scales and minimums as
  float16) measured no better than torch's int4 kernel (3.96-4.6 against 4.6-4.8 ms at 1 row;
  single-stream decode 111-115 against 94-119 tokens/s in the engine) and was not kept.

  int4 in groups of 32 with a scale and a minimum is GGUF's Q4_1, the format SmolLM2's
  projections ship in: quantizing the dequantized Q4_1 weights again by each group's minimum and
  maximum gives back the file's own 4-bit levels (Q4_1's quantizer sets them from the same
  minimum and maximum), so int4 serves those weights as shipped, up to the rounding of scales to
  bfloat16.
- **W8A8 for large iterations** (`--quantization w8a8`): activations quantized per row on the
  fly, weights per output channel, int8 dot products (AVX-512 VNNI: twice bfloat16's
  multiply-adds per instruction). Where the kernels have AVX512_BF16 and VNNI,
  `shoal::vnni_linear` (dp_linear's tiles with `vpdpbusd`; the dequantization, and SwiGLU's
  product for gate/up, in the tile's store) against a third copy of the weights in its layout
  (`pack_int8_quads`); elsewhere `torch._int_mm` and one dequantization pass (fused with SwiGLU).
  Measured on the EPYC, 2 threads: `[2048, 576] x [576, 3072]` 17.3 -> 8.8 ms, `[64, 576] x [576,
  960]` 0.19 -> 0.10 ms; no gain at 8 rows. On a 2-core Zen 4 (session 13), quantization of the
  activations included, bfloat16 `dp_linear` / `torch._int_mm` + `dequantize_rows` /
  `vnni_linear`: `[2048, 576] x [576, 3072]` with SwiGLU 18.0-18.4 / 11.0-11.7 / 10.0-10.5 ms,
  `[2048, 576] x [576, 960]` 6.1-6.2 / 3.8-4.4 / 4.1 (the kernel alone 3.3 and 10.0 ms,
  690-730 GOP/s, 75-79% of the cores' int8 peak), `[512, 576] x [576, 3072]` 4.4-4.6 / 3.2-3.5 /
  2.7, `[64, 576] x [576, 3072]` 0.55-0.58 / 0.48-0.52 / 0.40. Only the QKV and gate/up
  projections take it (their inputs are RMSNorm outputs): prefilling 512 tokens of GPL-3 at
  once, perplexity rose 1.8% over bfloat16 (QKV alone: within noise; gate/up alone: 1.2%; with O
  and down as well: 4.6% on 1,024 tokens). Iterations of at most 2 rows use int8 weight-only, as
  `int8` does.
- **AMX tiles for bfloat16 iterations of up to 1,024 rows** (`shoal::amx_linear`, where the CPU has
  AMX): such an iteration is bound by reading the weights, which a second copy holds in the order
  the tiles consume them (`shoal::pack_weight_pairs`); each thread streams its share once, and every
  weight tile serves all the iteration's rows; rows go 256 at a time, which stay in L2. All 120
  SmolLM2 projections on a 2-core Xeon with AMX, ms per iteration:

  | rows | 1 | 32 | 64 | 128 | 512 | 1,024 | 2,048 |
  | --- | --- | --- | --- | --- | --- | --- | --- |
  | oneDNN prepacked | 12.5 | 14.9 | 16.9 | 23.5 | 59-64 | 119-131 | 161-171 |
  | `shoal::amx_linear` | 9.3 | 10.0 | 12.8 | 18.5 | 49-55 | 99-108 | 205 |

  so oneDNN keeps iterations of more than 1,024 rows, but for gate/up: with SwiGLU's product
  written from the accumulators (`silu_and_mul=True`, gate and up blocks interleaved as for
  dp_linear_silu) amx_linear beats oneDNN and a separate `silu_and_mul` at every size
  (AMX_SWIGLU_MAX_ROWS). Since session 26 amx_linear turns its loop order over past 64 rows
  where K <= 640 (worker/csrc/pairs.cpp), and then beats oneDNN at every size there too
  (AMX_NARROW_MAX_K): of SmolLM2's projections only down keeps a oneDNN copy.
- **AVX512_BF16 dot products for bfloat16 iterations of every size** (`shoal::dp_linear`,
  where the CPU has AVX512_BF16 but no AMX: AMD Zen 4 and 5): the same packed weights, each
  64-byte vector a pair of input channels for 16 output channels, `vdpbf16ps` against a broadcast
  pair of x (32 multiply-adds an instruction), 8 rows by 48 channels of accumulators in registers.
  The gate/up projection packs its blocks in (gate, up) pairs and `shoal::dp_linear_silu` writes
  SwiGLU's product from 6 rows by 2 such pairs of accumulators: the `[rows, 2 * intermediate]`
  product is never stored. The threads take the work in small items (a pass of rows by a group of
  blocks) as they come free, so a thread preempted by the fleet's other processes holds back one
  item, not half the matmul. All 120 SmolLM2 projections (SwiGLU included) on a 2-core AMD EPYC
  (Zen 5), weights out of cache, ms per iteration (medians of runs interleaved in one process):

  | rows | 1 | 16 | 64 | 256 | 512 | 1,024 | 2,048 |
  | --- | --- | --- | --- | --- | --- | --- | --- |
  | oneDNN prepacked, then `silu_and_mul` | 6.9 | 9.4 | 20.8 | 61.6 | 117 | 241 | 474 |
  | `shoal::dp_linear`, `dp_linear_silu` | 5.5 | 7.6 | 17.6 | 57.4 | 113 | 224 | 443 |

  The cores' peak is about 555 GFLOP/s each (a loop of independent `vdpbf16ps`); with weights in
  cache the kernel reaches 980-1,080 GFLOP/s on 2 cores from 256 rows up. Session 6 measured
  oneDNN up to 9% faster at 512-2,048 rows inside the engine and kept it there; session 8 found
  W64's prefill iterations 2.14-2.30 s with dp_linear and dp_linear_silu at every size against
  2.26-2.42 with oneDNN and `silu_and_mul` above 256 rows (interleaved runs), so dp_linear now
  serves every size and no oneDNN copy of these weights is kept.
- **GGUF's 4-bit levels for iterations of a few rows, unquantized**
  (`shoal::q4_linear`, where dp_linear serves). SmolLM2's projections ship as Q4_1: the
  bfloat16 weight is `bfloat16(d * q + m)`, q a 4-bit level and d, m float16 per group of 32
  inputs. The kernel rebuilds each 64-byte vector of dp_linear's layout from 20 bytes (the
  levels and the group's d and m, `pack_q4_pairs`) in registers, exactly (d q is exact in
  float32, so an FMA rounds once as gguf's multiply-then-add does, and `vcvtne2ps2bf16` rounds
  to nearest even as torch does), and runs dp_linear's `vdpbf16ps` steps in dp_linear's order:
  the same output bits, so nothing a client sees changes, from 67 MB a decode step instead of
  213. The Linear checks at start-up that the levels give back its weight bit for bit (0.4 s
  for SmolLM2) and otherwise serves without them. Decoding costs more than the dot products,
  so the kernel is bound by it, not by memory; past 8 rows it decodes each tile of weights once
  per pass of rows into a scratch that dp_linear's tiles read, and loses past 16 rows (table at
  Q4_MAX_ROWS; decode at batch 10 / 12 / 16 1,046-1,062 / 1,231-1,295 / 1,588-1,593 ->
  1,333-1,356 / 1,467-1,502 / 1,645-1,679 tokens/s on a 2-core Zen 5, session 52);
  single-stream decode 77-90 -> 122-133 tokens/s (2-core Zen 4, docs/benchmarks.md session 21).
  Where the engine serves float32, `shoal::q4_lanes_linear` does the same beside `f32_linear`
  (its chains and order, float32 weights d q + m: f32_linear's bits): a decode step reads 67 MB
  instead of 425; single-stream decode 40-63 -> 103-113 tokens/s with `--dtype float32` on the
  Zen 4. Past a few rows it rebuilds each weight once an iteration into a buffer and runs
  f32_linear's tiles over it (the same bits), which beats f32_linear and oneDNN up to
  `Q4_LANES_MAX_ROWS` rows (256 with AVX-512, 1,024 with AVX2): there the levels and oneDNN's
  copy serve every iteration, and the float32 lanes copy is not kept.
  On AMX CPUs, where amx_linear serves and its tiles sum in another order than dp_linear's
  `vdpbf16ps` (about one output in 2,000 differs by a bfloat16 unit), `shoal::q4_amx_linear`
  rebuilds each pair of blocks' weight tiles from the levels into a scratch buffer and runs
  amx_linear's tile products in its order: amx_linear's bits, for iterations of up to
  Q4_AMX_MAX_ROWS rows (decode at batch 1 73.5 -> 93.6 tokens/s on a 2-core Xeon with AMX,
  104.5 with `decode_stack`; session 25). Not under `--quantization`. Tensor-parallel shards
  carry their part of the levels (the row-parallel ones split by inputs, whole groups of 32
  where the split falls on them, else not used).
- **Lanes kernels for float32 iterations of a few rows under `--quantization`**
  (`shoal::int8_linear`, `shoal::int4_linear`, any AVX-512 CPU): where the engine serves float32
  (`--dtype auto` on CPUs without fast bfloat16 arithmetic), torch's weight-only kernels were slower
  than the unquantized matmul: single-stream decode steps of 50 ms (int8) and 126 ms (int4)
  against 27 ms on a 2-core Xeon. These kernels keep the activations in float32 and widen 16
  output channels' weights per vector (int4: a nibble becomes its float level in one `vpermps`).
  All 120 SmolLM2 projections, weights out of cache, ms per iteration on that Xeon:

  | rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 |
  | --- | --- | --- | --- | --- | --- | --- | --- |
  | float32, oneDNN prepacked | 20.6 | 20.7 | 22.4 | 25.8 | 31.7 | 42.9 | 68.9 |
  | `shoal::int8_linear` | 6.3 | 6.7 | 7.7 | 11.6 | 19.8 | 35.8 | 69.9 |
  | `shoal::int4_linear` | 4.4 | 4.5 | 6.6 | 11.3 | 20.1 | 37.3 | 73.9 |

  so they serve up to `LANES_MAX_ROWS` rows (int4 stops at 16, where the two are within noise).
  On AVX2-only CPUs (AMD Zen 3) the same kernels run on pairs of ymm registers, 2 rows at a time,
  and int4 is bound by widening every weight to float32; there `shoal::int4_q8_linear` takes
  int4 instead: each row quantized to int8 per block of 32 inputs (llama.cpp's Q8
  activations), `vpmaddubsw` multiplying 32 levels by 32 bytes at once, the levels in their own
  layout (`pack_int4_quads`). All 120 SmolLM2 projections, weights out of cache, ms per
  iteration on a 2-core Zen 3 (session 15):

  | rows | 1 | 2 | 4 | 8 | 16 | 32 | 128 | 512 |
  | --- | --- | --- | --- | --- | --- | --- | --- | --- |
  | float32, oneDNN prepacked | 22.9 | | 29.1 | 37.0 | 49.3 | 67.0 | 233 | 787 |
  | `shoal::int4_linear` (AVX2) | 5.5 | 9.4 | 13.1 | 26.8 | 49.2 | 90.9 | | |
  | `shoal::int4_q8_linear` | 3.5 | 4.2 | 5.6 | 8.4 | 15.7 | 30.0 | 117 | 522 |

  so it serves int4 iterations of every size there (`INT4_Q8_MAX_ROWS`), and no float32 copy
  of those weights is kept. Perplexity of 512 tokens of GPL-3 as one prompt 18.645 against
  float32's 18.832; one token per iteration (320 tokens) 19.925 against 20.117.
  With AVX-512 VNNI (no AMX) it serves int4 at every size for bfloat16 serving too, in place of
  `_weight_int4pack_mm_for_cpu` and `dp_linear`: past 4 rows `vpdpbusd` on 16 channels a zmm
  register. All 120 projections on a 2-core Zen 4, bfloat16 activations, ms per iteration:

  | rows | 1 | 2 | 4 | 8 | 64 | 512 | 2,048 |
  | --- | --- | --- | --- | --- | --- | --- | --- |
  | `shoal::dp_linear` (bfloat16 weights) | 7.0-8.1 | 7.0-7.3 | 7.3-8.5 | 8.3-9.3 | 35.7-36.0 | 275-277 | 1,179 |
  | `aten._weight_int4pack_mm_for_cpu` | 3.9-4.0 | 4.6 | 6.2-6.3 | 11.2-11.4 | 82 | | |
  | `shoal::int4_q8_linear` | 2.9-3.1 | 3.1-3.2 | 3.9-4.1 | 7.1-7.4 | 31.9-34.3 | 245-268 | 955 |

  Float32 serving there, against oneDNN and `int4_linear`: 1 row 2.7 / 17.4 / 4.8, 16 rows
  11.3 / 25.0 / 25.4, 512 rows 351 / 597 / -.
- **float32 iterations of up to 128 rows (AVX2: 1,024), unquantized** (`shoal::f32_linear`: the
  lanes kernel with float32 weights, `LANES_MAX_ROWS["none"]`), where the engine serves float32
  on a CPU the lanes kernels build for. oneDNN's prepacked float32 matmul streams a decode step's weights at
  about 13 GB/s on a 2-core Zen 3 (AVX2), half of what the two cores read. All 120 SmolLM2
  projections (425 MB), weights out of cache, ms per iteration there, medians of five rounds
  interleaved (session 17):

  | rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 256 | 512 | 2,048 |
  | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
  | oneDNN prepacked | 24.0 | 37.0 | 40.7 | 47.4 | 55.2 | 76.8 | 125 | 208 | 384 | 719-753 | 2,741-2,806 |
  | `shoal::f32_linear` | 15.0 | 15.9 | 18.3 | 22.9 | 33.8 | 55.4 | 99 | 191 | 371 | 766-861 | 2,970-3,321 |

  so both copies are kept (the lanes one adds the float32 weights once more: 0.54 GB for
  SmolLM2 with its LM head) and oneDNN serves iterations past 128 rows. On AVX2 f32_linear's
  tiles have since kept blocks of one group's weights in L1 (`f32_item`, worker/csrc/lanes.cpp):
  32 / 64 / 128 rows 71.8 / 132.4 / 265.2 -> 63.0 / 122.4 / 222.9 ms on another Zen 3 of that
  kind, in turns (session 31), and beat oneDNN up to 1,024 rows on a third (session 50:
  `F32_LANES_AVX2_MAX_ROWS`). The lanes copy stays on
  ordinary pages: on huge pages decode at batch 1 measured 50.9 against 49.1 tokens/s (five
  rounds each, ranges overlapping) for about 100 MiB more resident memory (each tensor's last
  huge page). A projection that has its file's 4-bit levels keeps no lanes copy: the levels
  serve up to Q4_LANES_MAX_ROWS rows, oneDNN beyond (above).
- Plain `F.linear` otherwise (float16, another device, or no oneDNN).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker import ops
from worker.config import QUANTIZATIONS
from worker.hugepages import on_huge_pages

log = logging.getLogger(__name__)

# The most rows an iteration may have for the quantized kernel to beat bfloat16 (table above).
QUANTIZED_MAX_ROWS = {"int8": 2, "int4": 4, "w8a8": 2}
VNNI_INT8_MAX_ROWS = 4  # int8 weights through shoal::int8_gemv beat bfloat16 up to here (8: even)
W8A8_MIN_ROWS = 16  # int8 x int8 matmuls beat bfloat16 from here (measured: 17 yes, 8 no)
# ... and through shoal::vnni_linear from here, against the 4-bit levels up to 8 rows and
# bfloat16 pairs beyond, both through decode_stack: SmolLM2 decode tokens/s, 2-core Zen 4, in
# turns, medians of 4 (session 44), w8a8 from 9 / from 16 rows: 9 rows 573.8 / 558.8, 12 rows
# 725.5 / 665.5, 15 rows 873.3 / 786.7; from 4 / from 9 rows: 4 rows 427.4 / 498.1, 8 rows
# 653.0 / 704.6.
W8A8_VNNI_MIN_ROWS = 9
# float32 iterations of up to this many rows take shoal::int8_linear / int4_linear, or unquantized
# shoal::f32_linear (tables above).
LANES_MAX_ROWS = {"int8": 32, "int4": 16, "w8a8": W8A8_MIN_ROWS - 1, "none": 128}
# ... unquantized ones on AVX2, where f32_linear's blocked tiles beat oneDNN up to here: all 120
# SmolLM2 projections on a 2-core Zen 3, ms, f32_linear / oneDNN, medians in turns (session 50):
# 192 rows 245.8 / 273.1, 256 rows 326.8 / 362.8, 512 rows 672.9 / 716.2, 1,024 rows 1,353.5 /
# 1,589.3, 2,048 rows 3,036.2 / 2,922.9. (SmolLM2's LM head, 49,152 outputs, at 256 / 512 /
# 1,024 rows 104.1 / 262.0 / 530.0 against 99.1 / 226.9 / 469.0: rows it sees only from prompt
# logprobs or more than the default 256 sequences a step, so it takes the same limit.)
F32_LANES_AVX2_MAX_ROWS = 1024
# shoal::int4_q8_linear beats float32 oneDNN (AVX2-only CPUs) and bfloat16 dp_linear (AVX-512
# VNNI) at every size measured (tables above). On a 2-core Zen 5, whose vdpbf16ps runs at twice
# a Zen 4's rate, SmolLM2's 120 projections at 16 / 64 / 128 / 2,048 rows: 6.15-6.45 / 15.9-16.1
# / 27.5 / 420-432 ms against the unquantized path's 5.63-6.15 / 15.5-15.8 / 29.4 / 450-459
# (docs/benchmarks.md, session 52): about even at a few dozen rows, ahead past them.
INT4_Q8_MAX_ROWS = sys.maxsize
AMX_MAX_ROWS = 1024  # shoal::amx_linear beats oneDNN up to here (table above; 2,048 rows: not)
# ... but with SwiGLU's product from its accumulators it beats oneDNN followed by silu_and_mul
# at every size: 30 SmolLM2 gate/up projections, 2-core Xeon with AMX, ms, in turns (medians of
# 6): 512 rows 75.6 / 70.3, 1,024 rows 139.6 / 139.7, 1,536 rows 221.9 / 207.4, 2,048 rows
# 296.5 / 275.5 (session 25). So a gate/up weight keeps no oneDNN copy there.
AMX_SWIGLU_MAX_ROWS = sys.maxsize
# Past 64 rows amx_linear turns its loop order over where 32 rows of x fit in L1 (K <= 640,
# worker/csrc/pairs.cpp kAmxRowsOuterMaxK): then it beats oneDNN at every size. SmolLM2's 30
# layers at 2,048 rows, ms, in turns (session 26, 2-core Xeon with AMX), oneDNN / amx_linear:
# QKV 31.3 / 26.5, O 18.8 / 16.6; 512 rows QKV 17.4 / 8.5, O 10.8 / 4.6. So those projections
# keep no oneDNN copy either; down (K = 1,536) keeps AMX_MAX_ROWS.
AMX_NARROW_MAX_K = 640
# shoal::dp_linear serves bfloat16 iterations of every size where it runs (see above).
DP_MAX_ROWS = sys.maxsize
# shoal::q4_linear (GGUF's 4-bit levels, dp_linear's bits) beats dp_linear up to here: all 120
# SmolLM2 projections, 2-core Zen 4, ms (runs interleaved in one process; this host's speed
# moved 1.5x within the hour): 1 row 7.9-9.7 against 4.3-5.0; 4 rows 10.0 / 7.2; 5 rows 10.7 /
# 7.6; 8 rows 11.5 / 9.1; 9 rows (two tiles) 11.9 / 11.7; 12 rows 13.2 / 14.4. Since each tile
# asks for the next one's levels ahead (session 27, 2-core Zen 5, dp_linear / q4_linear): 1 row
# 3.95 / 2.53, 4 rows 4.20 / 3.12, 8 rows 5.01 / 4.17, 10 rows (two tiles) 5.50 / 5.93, 16 rows
# 5.35 / 7.27. Past 8 rows q4_linear now rebuilds each tile's weights once per pass of rows and
# runs dp_linear's tiles on them (session 52, 2-core Zen 5, in turns in one process, dp_linear /
# q4_linear): 9 rows 5.92-6.35 / 4.66-4.72, 12 rows 5.71-5.89 / 4.60-4.70, 14 rows 5.84-6.23 /
# 5.18-5.39, 16 rows 5.46-5.94 / 5.36-5.59, 24 rows 6.13-6.41 / 7.04-7.22, 64 rows 14.5-15.1 /
# 15.4-15.8, 2,048 rows 431-442 / 450.
Q4_MAX_ROWS = 16
# shoal::q4_lanes_linear (float32 serving, f32_linear's bits) rebuilds each weight from the
# levels once per few rows, and past those (worker/csrc/lanes.cpp) once an iteration into a
# thread's buffer, f32_linear's tiles running over it. Its rows direct, against f32_linear, all
# 120 SmolLM2 projections on a 2-core Zen 4 (AVX-512), ms for 1 / 2 / 4 / 8 / 16 rows: 5.4 / 6.3
# / 7.8 / 14.3 / 27.0 against 12.0 / 12.9 / 13.1 / 20.2 / 34.4. With the rebuild it beats
# f32_linear up to here (by ISA of the kernels' build), so that no float32 lanes copy is kept
# beside the levels (0.4 GB for SmolLM2) and oneDNN serves larger iterations. All 120
# projections, ms, levels / f32_linear / oneDNN, medians in turns. AVX-512, a 2-core Xeon without
# AMX (session 49): 32 rows 38.2 / 43.9 / 47.8, 64 rows 68.4 / 74.3 / 79.2, 96 rows 100.4 / 93.1
# / 98.9, 128 rows 129.2 / 119.0 / 118.0; since f32_item's tiles keep a block of the weights in
# L1 (session 53, the same kind of host), levels / oneDNN 64 rows 51.1 / 70.1, 96 rows 72.2 /
# 87.7, 128 rows 95.7 / 111.2, 192 rows 138.7 / 150.1, 256 rows 183.3 / 192.1, 512 rows 363.2 /
# 359.0, 1,024 rows 760.3 / 715.5, 2,048 rows 1,619.9 / 1,439.6. AVX2, a 2-core Zen 3
# (session 50): 1 row 8.9 / 17.3 /
# 25.7, 16 rows 29.3 / 34.0 / 45.9, 64 rows 87.6 / 90.8 / 119.1, 128 rows 166.0 / 166.7 /
# 196.7, 256 rows 367.2 / 326.8 / 391.9, 512 rows 653.0 / 672.9 / 705.1, 1,024 rows 1,321.6 /
# 1,353.5 / 1,420.5, 2,048 rows 3,083.0 / 3,036.2 / 2,961.1: there the levels take iterations of
# up to 1,024 rows, as f32_linear does (in the engine, prefill of 2 / 4 / 8 prompts of 128 tokens
# against the levels up to 128 rows and oneDNN past them, 12 / 12 / 10 pairs in turns: 1.140 /
# 1.065 / 0.998x).
# (torch's F.linear, MKL's sgemm, beat oneDNN's copy from 1,536 rows alone, 2,664.9 ms at 2,048,
# but not in the engine: prefill of 2,048 rows 0.964x, 12 pairs; not kept.)
Q4_LANES_MAX_ROWS = {"avx512": 256, "avx2": F32_LANES_AVX2_MAX_ROWS}
# shoal::q4_amx_linear (the levels on AMX tiles, amx_linear's bits) beats amx_linear up to here:
# all 120 SmolLM2 projections, 2-core Xeon with AMX, ms (runs in turns in one process;
# docs/benchmarks.md, session 25), amx_linear / q4_amx_linear: 1 row 10.8 / 8.5, 8 rows 14.0 / 9.3,
# 32 rows 11.1 / 8.8, 64 rows 14.6 / 13.6, 96 rows 16.6 / 17.1, 128 rows 21.0 / 20.1. In the
# engine (decode tokens/s in turns, medians of 5, levels off / on) 16 rows 731 / 910, 32 rows
# 980 / 966-995, 48 rows 1,137 / 1,166, 64 rows 1,312 / 1,202: a gain at 16 rows, within the
# host's noise past it. Session 46, the same kind of host with its memory slower (other tenants):
# 120 projections at 32 / 40 / 48 / 64 / 96 / 128 rows, amx_linear 16.9 / 25.3 / 23.8 / 22.8 /
# 32.2 / 38.7 against the levels 11.3 / 16.5 / 15.3 / 14.8 / 30.7 / 46.9 ms; in the engine,
# levels up to 32 against 64 rows, in turns, 6 pairs: decode at batch 40 +7-17% in all 6, at
# batch 64 +6% in 5 of 6, W64 520.0 -> 537.3 tokens/s (5 of 6). So the levels serve every row
# count the stack runs.
Q4_AMX_MAX_ROWS = 64
# SmolLM2's LM head ([49152, 576]) through dp_linear against oneDNN, ms (2-core Zen 5, A/B
# interleaved): 8 rows 0.92 / 1.26, 64 rows 4.67 / 4.85, 128 rows 10.25 / 9.30, 256 rows 19.6 /
# 17.0 (why was not investigated), so it stops earlier. Session 8, another Zen 5 host: 16 rows
# 1.21 / 1.67, 64 rows 3.95 / 4.06, 128 rows 7.48 / 7.65, 256 rows 15.2 / 14.6.
LM_HEAD_DP_MAX_ROWS = 64
INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `weight ≈ q * scale[:, None]`.

    Args:
        weight: `[out, in]` float.

    Returns:
        `q` `[out, in]` int8 in [-127, 127] and `scale` `[out]` in weight's dtype.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def int4_levels(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group_size` input channels (GGUF Q4_1's scheme):
    `weight[o, g * group_size + j] ≈ scale[o, g] * q[o, g * group_size + j] + minimum[o, g]`,
    q in [0, 15], with `scale = (max - min) / 15` per group.

    Args:
        weight: `[out, in]` float; `in` divisible by `group_size`.

    Returns:
        `q` `[out, in]` int32 levels, `scale` and `minimum` `[out, in / group_size]` float32.

    Raises:
        ValueError: `in` not divisible by `group_size`.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, "
                         f"got {tuple(weight.shape)}")
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(out_features, in_features), scale, lo


def quantize_int4(weight: torch.Tensor,
                  group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_levels` packed for `aten._weight_int4pack_mm_for_cpu`.

    Args:
        weight: `[out, in]` float; `in` divisible by `group_size`, `out` even.

    Returns:
        The 4-bit levels packed for the kernel (`[out, in / 2]` uint8), and its
        `[in / group_size, out, 2]` scales and zeros in weight's dtype (the kernel computes
        `(q - 8) * scale + zero`, so `zero = minimum + 8 * scale`).

    Raises:
        ValueError: shapes the kernel cannot take.
    """
    if weight.shape[0] % 2:
        raise ValueError(f"int4 needs even out_features, got {tuple(weight.shape)}")
    q, scale, lo = int4_levels(weight, group_size)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale, lo + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_zeros.to(weight.dtype)


def pack_lanes(q: torch.Tensor) -> torch.Tensor:
    """Weights `[out, in]` (per-channel int8, or float32) into the layout of `shoal::int8_linear`
    and `shoal::f32_linear`, `[out / 16, in, 16]`: 16 output channels in the lanes of a vector
    (worker/csrc/lanes.cpp).

    Raises:
        ValueError: `out` not a multiple of 32.
    """
    out_features, in_features = q.shape
    if out_features % 32:
        raise ValueError(f"lanes layout needs out_features divisible by 32, got {out_features}")
    return q.reshape(out_features // 16, 16, in_features).transpose(1, 2).contiguous()


def _int4_groups(weight: torch.Tensor, channels: int, layout: str, multiple: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_levels` (blocks of 32 inputs) of `weight` `[out, in]` by groups of `channels` output
    channels: levels `[out / channels, channels, in / 32, 2, 16]` int32 (each block's first and
    second 16 inputs) and scales and minimums `[out / channels, in / 32, 2, channels]` float16.

    Raises:
        ValueError: `out` not a multiple of `multiple` (what `layout` needs), or `in` of 32.
    """
    out_features, in_features = weight.shape
    if out_features % multiple:
        raise ValueError(f"{layout} layout needs out_features divisible by {multiple}, "
                         f"got {out_features}")
    q, scale, lo = int4_levels(weight, 32)
    groups, blocks = out_features // channels, in_features // 32
    scale_min = torch.stack([scale, lo], dim=-1).reshape(groups, channels, blocks, 2)
    return (q.reshape(groups, channels, blocks, 2, 16),
            scale_min.permute(0, 2, 3, 1).to(torch.float16).contiguous())


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels `[..., 2]` (0-15) as bytes `[...]` uint8: the first in the low nibble."""
    return (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8).contiguous()


def pack_int4_lanes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_levels` in `shoal::int4_linear`'s layout (groups of 32 inputs).

    Args:
        weight: `[out, in]` float; `out` a multiple of 32, `in` a multiple of 32.

    Returns:
        `[out / 16, in / 32, 16, 16]` uint8 (byte j of lane c: the levels of inputs j and 16 + j
        of the group, low and high nibble) and `[out / 16, in / 32, 2, 16]` float16 scales and
        minimums.

    Raises:
        ValueError: shapes the layout cannot take.
    """
    q, scale_min = _int4_groups(weight, 16, "lanes", 32)
    # [group, lane, block, nibble, j] -> [group, block, j, lane, nibble]
    return _nibbles(q.permute(0, 2, 4, 1, 3)), scale_min


def pack_int4_quads(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_levels` in `shoal::int4_q8_linear`'s layout (quads of inputs for `vpmaddubsw` or
    `vpdpbusd`; with VNNI two adjacent 8-channel groups fill one zmm register).

    Args:
        weight: `[out, in]` float; `out` a multiple of 8, `in` a multiple of 32.

    Returns:
        `[out / 8, in / 32, 4, 8, 4]` uint8 (vector t of a block: for each of 8 channels, the
        levels of inputs 4t + i in the low nibbles and 16 + 4t + i in the high ones) and
        `[out / 8, in / 32, 2, 8]` float16 scales and minimums.

    Raises:
        ValueError: shapes the layout cannot take.
    """
    q, scale_min = _int4_groups(weight, 8, "quads", 8)
    groups, _, blocks = q.shape[:3]
    # [group, channel, block, nibble, t, i] -> [group, block, t, channel, i, nibble]
    return _nibbles(q.reshape(groups, 8, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)), scale_min


def pack_int8_quads(q: torch.Tensor, scale: torch.Tensor, swiglu: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 weight `q` `[N, K]` (per-output-channel `scale` `[N]` float32) in the layout of
    `shoal::vnni_linear`: `[N / 16, K / 4, 16, 4]` int8, each 64-byte vector four consecutive input
    channels of 16 output channels, with the scales and each channel's weight sum (int32, for
    the kernel's unsigned activations) in the same channel order. With `swiglu`, a fused gate/up
    weight's blocks are interleaved first (`swiglu_interleave`), as SwiGLU's fused product reads
    them. N must be a multiple of 32 and K of 4."""
    if swiglu:
        q = swiglu_interleave(q)
        scale = swiglu_interleave(scale[:, None]).squeeze(1)
    n, k = q.shape
    packed = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return (on_huge_pages(packed), scale.contiguous(), q.sum(dim=1, dtype=torch.int32))


def vnni_matmul(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                silu_and_mul: bool = False) -> torch.Tensor:
    """W8A8's matmul through `shoal::vnni_linear`: `x` `[rows, K]` bfloat16 or float32,
    quantized per row to int8 (`ops.quantize_rows`), against a weight packed by
    `pack_int8_quads` -> `[rows, N]` bfloat16 (with `silu_and_mul`, `[rows, N / 2]` SwiGLU's
    product of interleaved gate/up blocks)."""
    q, row_scale = ops.quantize_rows(x, True)
    # vpdpbusd multiplies unsigned by signed bytes: the activations go offset by 128.
    u = q.view(torch.uint8).bitwise_xor_(128)
    return torch.ops.shoal.vnni_linear(u, row_scale, *packed, silu_and_mul)


def q4_weight(levels: torch.Tensor, scale_min: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight GGUF's 4-bit levels stand for, as the loader builds it: `levels` `[N, K]` uint8
    (0-15), `scale_min` `[N, K / 32, 2]` float16 (each group's d and m) -> `[N, K]` in `dtype`,
    `float32(d) * q + float32(m)` (gguf's dequantization) rounded once."""
    n, k = levels.shape
    d, m = scale_min.float().unbind(-1)
    w = levels.view(n, k // 32, 32).float() * d[..., None] + m[..., None]
    return w.view(n, k).to(dtype)


def pack_q4_pairs(levels: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit levels in `shoal::q4_linear`'s layout (bfloat16 serving; worker/csrc/pairs.cpp).

    Args:
        levels: `[N, K]` uint8, 0-15 (N a multiple of 16, K of 32).
        scale_min: `[N, K / 32, 2]` float16, each group's scale d and minimum m (Q4_0: m = -8 d).

    Returns:
        `[N / 16, K / 32, 320]` uint8: per block of 16 channels and group of 32
        inputs, d[16] and m[16], then 16 steps of 16 bytes, byte j of step s holding channel
        j // 2's level at input 2 s + j % 2 (low nibble) and channel 8 + j // 2's (high).
    """
    n, k = levels.shape
    words = levels.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [nb, g, s, ch, e]
    words = words.reshape(n // 16, k // 32, 16, 32)  # word 2 ch + e: dp_linear's order
    return _q4_groups(scale_min, words[..., :16] | (words[..., 16:] << 4))


def pack_q4_lanes(levels: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit levels in `shoal::q4_lanes_linear`'s layout (float32 serving): as
    `pack_q4_pairs` but byte j of step s holds channel j's levels at inputs 2 s (low nibble) and
    2 s + 1 (high)."""
    n, k = levels.shape
    pairs = levels.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [nb, g, s, ch, e]
    return _q4_groups(scale_min, pairs[..., 0] | (pairs[..., 1] << 4))


def _q4_groups(scale_min: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each group's d[16] and m[16] (from `scale_min` `[N, K / 32, 2]`) followed by its 16 steps
    (`steps` `[N / 16, K / 32, 16, 16]` uint8)."""
    blocks, groups = steps.shape[:2]
    scales = scale_min.view(blocks, 16, groups, 2).permute(0, 2, 3, 1).contiguous()
    return torch.cat([scales.view(torch.uint8).reshape(blocks, groups, 64),
                      steps.reshape(blocks, groups, 256)], dim=2).contiguous()


def _mkldnn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear serves `dtype` here: in this torch build and, for
    bfloat16, on this CPU (its reorder refuses CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT,
    such as AMD Zen 3)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def swiglu_interleave(weight: torch.Tensor) -> torch.Tensor:
    """A fused `[gate; up]` weight `[2 * I, K]` with its 16-row blocks reordered gate 0, up 0,
    gate 1, up 1, ...: the order `shoal::dp_linear_silu` reads (I a multiple of 16)."""
    n, k = weight.shape
    return weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k).contiguous()


def swiglu_deinterleave(y: torch.Tensor) -> torch.Tensor:
    """The product `[rows, 2 * I]` of a `swiglu_interleave`d weight back in `[gate | up]` order."""
    rows, n = y.shape
    return y.view(rows, n // 32, 2, 16).transpose(1, 2).reshape(rows, n)


class Linear:
    """One projection without bias.

    Args:
        weight: `[out_features, in_features]` in the serving dtype.
        quantization: "none", "int8", "int4" or "w8a8": a weight-only quantized copy serves
            iterations of at most `QUANTIZED_MAX_ROWS[quantization]` rows (bfloat16 or float32
            weights on the CPU only); w8a8 keeps int8 weights (per output channel).
        pack: hold a oneDNN prepacked copy for bfloat16 or float32 on the CPU (the plain weight is
            then dropped).
        quantize_activations: under "w8a8", iterations of at least W8A8_MIN_ROWS rows quantize
            their activations and run int8 x int8 (`torch._int_mm`; W8A8_VNNI_MIN_ROWS where
            `shoal::vnni_linear` runs them): `w8a8_min_rows`.
        int8_gemv: int8 weights serve iterations of a few rows through `shoal::int8_gemv`
            (int8 activations; where the kernels were built with VNNI) instead of weight-only.
        kernels: the C++ kernels quantize and dequantize activations (`worker.ops`), serve
            float32 iterations of up to `LANES_MAX_ROWS` rows from weights in the lanes layout
            (`shoal::int8_linear`, `shoal::int4_linear`, and unquantized with `pack`
            `shoal::f32_linear`; out_features and in_features multiples of 32), int4 at every
            size, float32 or bfloat16, through `shoal::int4_q8_linear` where it is built (not
            on AMX CPUs), and serve bfloat16 iterations of up to AMX_MAX_ROWS rows (a gate/up
            weight, or one of at most AMX_NARROW_MAX_K inputs: every size) on AMX tiles where the
            CPU has them, else of up to `dp_max_rows` rows with AVX512_BF16 (out_features and
            in_features multiples of 32; a packed copy of the weight, the only one kept when it
            serves every size).
        dp_max_rows: the most rows `shoal::dp_linear` serves (DP_MAX_ROWS: all; the LM head
            takes LM_HEAD_DP_MAX_ROWS).
        swiglu: the weight is a fused `[gate; up]` (`[2 * intermediate, in]`, intermediate a
            multiple of 16) used through `silu_and_mul`; where dp_linear or amx_linear serves,
            its packed copy interleaves gate and up blocks for SwiGLU from the accumulators
            (`shoal::dp_linear_silu`, `amx_linear(..., silu_and_mul=True)`; calling the
            projection itself still returns `[gate | up]`).
        q4: the GGUF 4-bit levels `[out, in]` uint8 and scales `[out, in / 32, 2]` float16 the
            weight was dequantized from (worker.loader), or None. Unquantized or under w8a8
            (below `w8a8_min_rows` where it quantizes activations; its few-row int8 copies are then
            not kept), where the levels
            give back the weight bit for bit (checked here), iterations of up to Q4_MAX_ROWS rows
            read them through `shoal::q4_linear` where dp_linear serves (bfloat16; of up to
            Q4_AMX_MAX_ROWS through `shoal::q4_amx_linear` where amx_linear does), and of up to
            Q4_LANES_MAX_ROWS through `shoal::q4_lanes_linear` where f32_linear does (float32,
            with no lanes copy kept): the unquantized kernel's result from a third (a sixth)
            of the bytes.

    Raises:
        ValueError: an unknown quantization, or int4 on a shape it cannot take.
    """

    PACK_ROWS_HINT = 64  # the batch size oneDNN chooses its weight layout for

    def __init__(self, weight: torch.Tensor, quantization: str = "none", pack: bool = True,
                 quantize_activations: bool = False, int8_gemv: bool = False,
                 kernels: bool = False, dp_max_rows: int = DP_MAX_ROWS,
                 swiglu: bool = False,
                 q4: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.out_features, self.in_features = weight.shape
        self.quantization = quantization
        self.swiglu = swiglu
        self.max_quantized_rows = QUANTIZED_MAX_ROWS.get(quantization, 0)
        self.quantized: tuple[torch.Tensor, ...] | None = None
        self.kernels = kernels
        # With `int8_gemv` (and the kernel built), few-row iterations go through
        # `shoal::int8_gemv`: then `quantized` holds float32 scales and each channel's weight sum.
        self.vnni = False
        if quantization in ("int8", "w8a8"):
            q, scale = quantize_int8(weight)
            self.quantized = (q, scale)
            self.vnni = (int8_gemv and kernels and ops.int8_gemv_available()
                         and self.in_features % 64 == 0)
            if self.vnni:
                self.quantized = (q, scale.float(), q.sum(dim=1, dtype=torch.int32))
                self.max_quantized_rows = VNNI_INT8_MAX_ROWS
        shape_ok = self.out_features % 32 == 0 and self.in_features % 32 == 0
        # int4 where shoal::int4_q8_linear is built (AVX2-only or AVX-512 VNNI CPUs; not where
        # AMX tiles serve bfloat16), float32 or bfloat16 weights: int8 activations per block of
        # 32 at every size, beating the unquantized matmul at each (table above), so no other
        # copy is kept.
        int4_q8 = (quantization == "int4" and kernels and shape_ok and ops.int4_q8_available()
                   and (weight.dtype == torch.float32
                        or (weight.dtype == torch.bfloat16 and not ops.amx_available())))
        if quantization == "int4" and not int4_q8:
            self.quantized = quantize_int4(weight)
        # float32 weights: torch's weight-only kernels were slower than the unquantized matmul
        # (table above), so few-row iterations take shoal's lanes kernels, activations in float32;
        # unquantized ones too, where oneDNN reads the weights at half the memory's speed.
        self.lanes: tuple[torch.Tensor, ...] | None = None  # the arguments after x of lanes_op
        self.lanes_max_rows = 0
        self.lanes_op = None  # the shoal kernel that takes `lanes`
        if int4_q8:
            self.lanes = pack_int4_quads(weight)
            self.lanes_op = torch.ops.shoal.int4_q8_linear
            self.lanes_max_rows = INT4_Q8_MAX_ROWS
            self.max_quantized_rows = 0
        elif (kernels and weight.dtype == torch.float32 and ops.lanes_linear_available()
                and shape_ok and (quantization != "none" or pack)):
            self.lanes_max_rows = LANES_MAX_ROWS[quantization]
            if quantization == "none":
                if not ops.lanes_avx512():
                    self.lanes_max_rows = F32_LANES_AVX2_MAX_ROWS
                self.lanes = (pack_lanes(weight),)
                self.lanes_op = torch.ops.shoal.f32_linear
            elif quantization == "int4":
                self.lanes = pack_int4_lanes(weight)
                self.lanes_op = torch.ops.shoal.int4_linear
            else:
                self.lanes = (pack_lanes(self.quantized[0]), self.quantized[1].float())
                self.lanes_op = torch.ops.shoal.int8_linear
            if not self.vnni:
                self.max_quantized_rows = 0
        # bfloat16 weights packed in pairs of input channels serve iterations of up to
        # `pairs_max_rows` rows, on AMX tiles where the CPU has them, else with AVX512_BF16 dot
        # products; oneDNN's prepacked copy serves larger ones (table above).
        self.amx = False
        self.swiglu_pairs = False
        self.pairs: torch.Tensor | None = None
        self.pairs_max_rows = 0
        if (kernels and weight.dtype == torch.bfloat16 and shape_ok
                and self.lanes_max_rows != sys.maxsize):
            if ops.amx_available():
                self.amx = True
                self.pairs_max_rows = (AMX_SWIGLU_MAX_ROWS if swiglu
                                       else sys.maxsize if self.in_features <= AMX_NARROW_MAX_K
                                       else AMX_MAX_ROWS)
            elif ops.dp_linear_available():
                self.pairs_max_rows = dp_max_rows
            # A gate/up weight goes in (gate, up) block pairs: SwiGLU's product then comes out
            # of the accumulators (shoal::dp_linear_silu, amx_linear's `silu_and_mul`).
            self.swiglu_pairs = swiglu and self.pairs_max_rows > 0
            if self.pairs_max_rows:
                self.pairs = on_huge_pages(torch.ops.shoal.pack_weight_pairs(
                    swiglu_interleave(weight) if self.swiglu_pairs else weight))
        # `[in, out]` int8 (a transposed view: what torch._int_mm takes) and `[out]` float32
        # scales. Not where AMX tiles serve bfloat16: they beat `torch._int_mm` at every size
        # measured on an AMX host (`[2048, 576] x [576, 3072]`: 3.2-4.0 ms against oneDNN's
        # bfloat16 on AMX 2.5 ms; W64 with w8a8 514-525 tokens/s against bfloat16's 600).
        self.w8a8: tuple[torch.Tensor, torch.Tensor] | None = None
        # Where the kernels have VNNI: the same int8 weights packed for `shoal::vnni_linear`
        # (packed, scales, sums; gate/up blocks interleaved as for dp_linear_silu).
        self.vnni_w8a8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Nor where torch._int_mm has no int8 instructions to run on (ops.int8_matmul_fast).
        if (quantization == "w8a8" and quantize_activations and not self.amx
                and ops.int8_matmul_fast()):
            q, scale = self.quantized[:2]
            self.w8a8 = (q.t(), scale.float())
            # (The kernel writes bfloat16: float32 serving keeps the path below.)
            if (kernels and weight.dtype == torch.bfloat16 and ops.vnni_linear_available()
                    and self.out_features % 32 == 0 and self.in_features % 4 == 0):
                self.vnni_w8a8 = pack_int8_quads(q, scale.float(), swiglu)
        self.w8a8_min_rows = W8A8_VNNI_MIN_ROWS if self.vnni_w8a8 is not None else W8A8_MIN_ROWS
        # GGUF's 4-bit levels for few-row iterations: shoal::q4_linear beside dp_linear
        # (bfloat16), shoal::q4_lanes_linear beside the lanes kernels (float32). Under w8a8
        # too: below `w8a8_min_rows` its iterations have no int8 activations, and the levels give
        # the unquantized bits from fewer bytes than its int8 weights, through decode_stack
        # (single-stream decode 75.3 -> 157.3 tokens/s on a 2-core Zen 4; docs/benchmarks.md,
        # session 44).
        self.q4: torch.Tensor | None = None
        self.q4_lanes = False
        self.q4_max_rows = 0
        if q4 is not None and quantization in ("none", "w8a8"):
            if self.amx:  # shoal::q4_amx_linear, amx_linear's bits
                self.q4 = self._pack_q4(weight, *q4, pack_q4_pairs)
                self.q4_max_rows = Q4_AMX_MAX_ROWS
            elif self.pairs is not None and self.pairs_max_rows >= Q4_MAX_ROWS:
                self.q4 = self._pack_q4(weight, *q4, pack_q4_pairs)
                self.q4_max_rows = Q4_MAX_ROWS
            elif self.lanes_op is not None:  # f32_linear's lanes (int8_linear's under w8a8)
                self.q4 = self._pack_q4(weight, *q4, pack_q4_lanes)
                self.q4_lanes = True
                self.q4_max_rows = Q4_LANES_MAX_ROWS["avx512" if ops.lanes_avx512() else "avx2"]
                if self.q4 is not None and quantization == "none":
                    self.lanes_max_rows = self.q4_max_rows  # oneDNN past it: no lanes copy (below)
            if self.q4 is None:
                self.q4_max_rows = 0
            elif self.w8a8 is not None:  # int8 activations take the iterations from there
                self.q4_max_rows = min(self.q4_max_rows, self.w8a8_min_rows - 1)
            # Rows the levels serve need no int8 weights of their own (w8a8's few-row copies).
            if self.q4_max_rows >= self.max_quantized_rows:
                self.max_quantized_rows, self.quantized = 0, None  # (self.w8a8 holds its own q)
            if self.q4_max_rows >= self.lanes_max_rows:
                self.lanes, self.lanes_op, self.lanes_max_rows = None, None, 0
        self.packed = None
        self.weight: torch.Tensor | None = weight
        if ((self.pairs is not None and self.pairs_max_rows == sys.maxsize)
                or self.lanes_max_rows == sys.maxsize):
            self.weight = None  # one packed copy serves every iteration: no other is kept
        elif (pack and weight.dtype in (torch.bfloat16, torch.float32)
                and weight.device.type == "cpu" and _mkldnn_available(weight.dtype)):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_ROWS_HINT)
            self.weight = None

    def _pack_q4(self, weight: torch.Tensor, levels: torch.Tensor, scale_min: torch.Tensor,
                 pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor | None:
        """The levels packed by `pack`, or None (logged) where they do not give back the weight
        to the bit: the kernel's result would then differ from the unquantized one's."""
        bits = torch.int16 if weight.dtype == torch.bfloat16 else torch.int32
        if (levels.shape != weight.shape or not torch.equal(
                q4_weight(levels, scale_min, weight.dtype).view(bits), weight.view(bits))):
            log.warning("a projection's 4-bit levels do not give back its weight; it is served "
                        "from the %s weight alone", str(weight.dtype).removeprefix("torch."))
            return None
        if self.swiglu_pairs:  # gate and up blocks interleaved, as in self.pairs
            levels = swiglu_interleave(levels)
            scale_min = swiglu_interleave(scale_min.flatten(1)).view(scale_min.shape)
        return pack(levels, scale_min)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[rows, in_features]` -> `[rows, out_features]`, both in the serving dtype."""
        if x.shape[0] <= self.q4_max_rows:
            if self.q4_lanes:
                return torch.ops.shoal.q4_lanes_linear(x, self.q4)
            y = self._levels(x, silu_and_mul=False)
            return swiglu_deinterleave(y) if self.swiglu_pairs else y
        if x.shape[0] <= self.max_quantized_rows:
            if self.vnni:
                return torch.ops.shoal.int8_gemv(x, *self.quantized)
            q, scale = self.quantized
            if self.quantization == "int4":
                return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, INT4_GROUP_SIZE, scale)
            return torch.ops.aten._weight_int8pack_mm(x, q, scale)
        if x.shape[0] <= self.lanes_max_rows:
            return self.lanes_op(x, *self.lanes)
        if self.uses_w8a8(x.shape[0]):
            return self._w8a8(x, silu_and_mul=False)
        if x.shape[0] <= self.pairs_max_rows:
            y = self._pairs(x, silu_and_mul=False)
            return swiglu_deinterleave(y) if self.swiglu_pairs else y
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")
        return F.linear(x, self.weight)

    def uses_w8a8(self, rows: int) -> bool:
        """Whether an iteration of `rows` rows runs int8 x int8."""
        return self.w8a8 is not None and rows >= self.w8a8_min_rows

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's `silu(gate) * up` of this fused gate/up projection of `x` `[rows, in]` ->
        `[rows, out / 2]`; under W8A8 the dequantization and the product are one pass."""
        rows = x.shape[0]
        if self.uses_w8a8(rows):
            return self._w8a8(x, silu_and_mul=True)
        if self.swiglu_pairs and rows <= self.q4_max_rows:
            return self._levels(x, silu_and_mul=True)
        if self.swiglu_pairs and self.max_quantized_rows < rows <= self.pairs_max_rows:
            return self._pairs(x, silu_and_mul=True)
        return ops.silu_and_mul(self(x), self.kernels)

    def _levels(self, x: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
        """The bfloat16 kernel over the 4-bit levels: q4_amx_linear on AMX, else q4_linear."""
        op = torch.ops.shoal.q4_amx_linear if self.amx else torch.ops.shoal.q4_linear
        return op(x, self.q4, silu_and_mul)

    def _pairs(self, x: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
        """The bfloat16 kernel over the packed pairs: amx_linear on AMX, else dp_linear (its
        SwiGLU form dp_linear_silu)."""
        if self.amx:
            return torch.ops.shoal.amx_linear(x, self.pairs, silu_and_mul)
        if silu_and_mul:
            return torch.ops.shoal.dp_linear_silu(x, self.pairs)
        return torch.ops.shoal.dp_linear(x, self.pairs)

    def stack_operand(self, rows: int) -> tuple[torch.Tensor, ...] | None:
        """The packed weight `shoal::decode_stack` reads for an iteration of `rows` rows, where
        the kernel `__call__` (and `silu_and_mul`) runs for it is one the stack runs too (the
        same kernel, so the same bits): the 4-bit levels (`shoal::q4_linear` or
        `q4_lanes_linear`), float32 lanes (`f32_linear`) or bfloat16 pairs (`dp_linear`, its
        SwiGLU form for gate/up); on AMX CPUs the levels through `shoal::q4_amx_linear` or
        the pairs through `amx_linear` (SwiGLU from their accumulators likewise); under int4
        its levels and scales for `int4_q8_linear` (two tensors: the stack's int4 form). None
        where another kernel serves those rows. The checks follow `__call__`'s order."""
        if rows <= self.q4_max_rows:
            return (self.q4,)
        if rows <= self.max_quantized_rows:
            return None
        if rows <= self.lanes_max_rows:
            if self.lanes_op is torch.ops.shoal.int4_q8_linear:
                return self.lanes
            return (self.lanes[0],) if self.lanes_op is torch.ops.shoal.f32_linear else None
        if self.uses_w8a8(rows) or rows > self.pairs_max_rows:
            return None
        return (self.pairs,) if self.swiglu_pairs or not self.swiglu else None

    def _w8a8(self, x: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
        if self.vnni_w8a8 is not None:
            # SwiGLU from the accumulators needs the gate/up blocks interleaved (swiglu=True).
            fused = silu_and_mul and self.swiglu
            y = vnni_matmul(x, self.vnni_w8a8, fused)
            if self.swiglu and not fused:
                y = swiglu_deinterleave(y)
            return ops.silu_and_mul(y, self.kernels) if silu_and_mul and not fused else y
        q, row_scale = ops.quantize_rows(x, self.kernels)
        weight, col_scale = self.w8a8
        return ops.dequantize_rows(torch._int_mm(q, weight), row_scale, col_scale, silu_and_mul,
                                   x.dtype, self.kernels)
