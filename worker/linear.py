"""The engine's projections: `y = x @ W.T`, with the weight held in the layouts that are fastest
for the number of rows an iteration brings.

- **oneDNN prepacked bfloat16 and float32** (`torch.ops.mkldnn._linear_pointwise` on a weight
  reordered once by `_reorder_linear_weight`, what inductor's `freezing=True` does for CPU
  linears). Measured per SmolLM2 layer (four projections, 2 threads), bfloat16: 1 row 730 ->
  420 µs, 8 rows 666 -> 424 µs, 64 rows 1,445 -> 1,058 µs, 2,048 rows 22.2 -> 23.5 ms; results
  equal `F.linear`'s to 3e-5. float32, one [3072, 576] projection on an AMD EPYC (weights out of
  cache): 3 rows 1,118 -> 238 µs (MKL's small-M sgemm reads weights at about 7 GB/s), 64 rows
  1,624 -> 639 µs, 2,048 rows 41 -> 17 ms; relative difference to `F.linear` about 3e-6.
- **int8 weight-only** (`--quantization int8`: `torch.ops.aten._weight_int8pack_mm`, symmetric
  per-output-channel scales) for iterations of at most `INT8_MAX_ROWS` rows, where reading half the
  bytes wins: 1 row 679 -> 285 µs per layer, LM head 6.3 -> 2.8 ms; at 16 rows it is 2.5x slower
  than bfloat16, so larger iterations keep the bfloat16 weight.
- Plain `F.linear` otherwise (float16, another device, or no oneDNN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX_ROWS = 4  # int8 weight-only matmul is faster than bfloat16 up to here (measured: 4 yes, 16 no)
QUANTIZATIONS = ("none", "int8")


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


def _mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """One projection without bias.

    Args:
        weight: `[out_features, in_features]` in the serving dtype.
        quantization: "none" or "int8" (int8 is used for iterations of at most INT8_MAX_ROWS rows;
            bfloat16 or float32 weights only).
        pack: hold a oneDNN prepacked copy for bfloat16 or float32 on the CPU (the plain weight is
            then dropped).

    Raises:
        ValueError: an unknown quantization.
    """

    PACK_ROWS_HINT = 64  # the batch size oneDNN chooses its weight layout for

    def __init__(self, weight: torch.Tensor, quantization: str = "none", pack: bool = True) -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        self.out_features, self.in_features = weight.shape
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        if quantization == "int8":
            self.int8 = quantize_int8(weight)
        self.packed = None
        self.weight: torch.Tensor | None = weight
        if (pack and weight.dtype in (torch.bfloat16, torch.float32)
                and weight.device.type == "cpu" and _mkldnn_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_ROWS_HINT)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[rows, in_features]` -> `[rows, out_features]`, both in the serving dtype."""
        if self.int8 is not None and x.shape[0] <= INT8_MAX_ROWS:
            q, scale = self.int8
            return torch.ops.aten._weight_int8pack_mm(x, q, scale)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")
        return F.linear(x, self.weight)
