"""The engine's fused ops: the C++ kernels of `worker/csrc/` where they are built, the
plain torch reference otherwise. The model is written once against these functions.

Each op has a `*_reference` in torch: it is the fallback (no compiler, float16, `SHOAL_CPU_OPS=0`)
and the oracle the kernels are tested against. Both compute in float32 and round once to the
storage dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from worker import cpu_ops

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernels_enabled(dtype: torch.dtype) -> bool:
    """True when the C++ kernels are built and support `dtype`."""
    return dtype in KERNEL_DTYPES and cpu_ops.load()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype, kernels: bool) -> torch.Tensor:
    """Residual add then RMSNorm (Zhang & Sennrich 2019): `x += delta` in place, then return
    `x / sqrt(mean(x^2) + eps) * weight` cast to `dtype`.

    Args:
        x: `[n, hidden]` float32, the residual stream (updated in place when `delta` is given).
        delta: `[n, hidden]` float32 or `dtype`, or None.
        weight: `[hidden]` float32.
        kernels: use the C++ kernel (see `kernels_enabled`).

    Returns:
        `[n, hidden]` in `dtype`.
    """
    if kernels:
        return torch.ops.shoal.add_rms_norm(x, delta, weight, eps, dtype)
    return add_rms_norm_reference(x, delta, weight, eps, dtype)


def add_rms_norm_reference(x, delta, weight, eps, dtype):
    if delta is not None:
        x += delta
    return F.rms_norm(x, (x.shape[-1],), weight, eps).to(dtype)


def silu_and_mul(gate_up: torch.Tensor, kernels: bool) -> torch.Tensor:
    """SwiGLU's product (Shazeer 2020): `silu(gate) * up` in float32, rounded once.

    Args:
        gate_up: `[n, 2 * intermediate]`, gate in the first half of each row, up in the second.

    Returns:
        `[n, intermediate]` in gate_up's dtype.
    """
    if kernels:
        return torch.ops.shoal.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def int8_gemv_available() -> bool:
    """True when the C++ kernels were built with AVX-512 VNNI, or with AVX2 and no AVX-512:
    `shoal::int8_gemv` (worker/linear.py: the quantized LM head's iterations of a few rows)."""
    return cpu_ops.load() and hasattr(torch.ops.shoal, "int8_gemv")


def lanes_linear_available() -> bool:
    """True when the C++ kernels were built with AVX-512, or AVX2 with FMA and F16C:
    `shoal::int8_linear` and `shoal::int4_linear`, weight-only quantized matmuls with float32
    activations (worker/linear.py)."""
    return cpu_ops.load() and hasattr(torch.ops.shoal, "int4_linear")


@functools.cache  # read once: every projection of a float32 model asks
def lanes_avx512() -> bool:
    """True when the lanes kernels were built with AVX-512 (else AVX2): the float32 iterations
    `shoal::q4_lanes_linear` serves from the levels differ by build (Q4_LANES_MAX_ROWS,
    worker/linear.py)."""
    words = cpu_ops.cpu_flag_words()
    return lanes_linear_available() and words is not None and "avx512f" in words


def int4_q8_available() -> bool:
    """True when the C++ kernels were built with AVX2 and either no AVX-512 or AVX-512 VNNI:
    `shoal::int4_q8_linear`, int4 weights against int8 activations quantized per block of 32
    inputs, which serves `--quantization int4` at every size there (worker/linear.py)."""
    return cpu_ops.load() and hasattr(torch.ops.shoal, "int4_q8_linear")


def dp_linear_available() -> bool:
    """True when the C++ kernels were built with AVX512_BF16: `shoal::dp_linear` and the
    bfloat16-pair prefill attention (worker/linear.py, worker/csrc/attention.cpp)."""
    return cpu_ops.load() and hasattr(torch.ops.shoal, "dp_linear")


def vnni_linear_available() -> bool:
    """True when the C++ kernels were built with AVX512_BF16 and AVX-512 VNNI: `shoal::vnni_linear`,
    W8A8's int8 matmul with its dequantization (worker/linear.py)."""
    return cpu_ops.load() and hasattr(torch.ops.shoal, "vnni_linear")


@functools.cache  # read once: every W8A8 projection asks
def int8_matmul_fast() -> bool:
    """Whether `torch._int_mm` (W8A8's int8 matmul where `shoal::vnni_linear` does not serve)
    runs on int8 dot-product instructions here: AVX-512 VNNI or AMX. On an AVX2-only CPU (AMD
    Zen 3) it ran a reference loop at 6 GOP/s, against float32's 146 GFLOP/s through oneDNN
    (docs/benchmarks.md, session 15), so W8A8 keeps float activations there."""
    words = cpu_ops.cpu_flag_words()
    return words is not None and bool(words & {"avx512_vnni", "amx_int8"})


def amx_available() -> bool:
    """True when the C++ kernels were built for AMX (bfloat16 tiles) and Linux lets this process
    use them: `shoal::amx_linear` (worker/linear.py) and the prefill attention's tile path."""
    return (cpu_ops.load() and hasattr(torch.ops.shoal, "amx_available")
            and torch.ops.shoal.amx_available())


def quantize_rows(x: torch.Tensor, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8 (W8A8's activations): `x ≈ q * scale[:, None]`.

    Args:
        x: `[rows, width]` float32 or bfloat16 (contiguous for the kernel).

    Returns:
        `q` `[rows, width]` int8 in [-127, 127] and `scale` `[rows]` float32 (`max |x| / 127`;
        1 for an all-zero row).
    """
    if kernels:
        return torch.ops.shoal.quantize_rows(x)
    xf = x.float()
    m = xf.abs().amax(dim=1)
    scale = torch.where(m > 0, m / 127.0, torch.ones_like(m))
    return torch.round(xf / scale[:, None]).to(torch.int8), scale


def dequantize_rows(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                    silu_and_mul: bool, dtype: torch.dtype, kernels: bool) -> torch.Tensor:
    """An int8 x int8 matmul's result back in `dtype`: `acc * row_scale[:, None] * col_scale`,
    and with `silu_and_mul` the SwiGLU product of its two halves (see `silu_and_mul`), in one pass.

    Args:
        acc: `[rows, width]` int32 accumulators.
        row_scale: `[rows]` float32 (the activations', `quantize_rows`).
        col_scale: `[width]` float32 (the weight's, per output channel).

    Returns:
        `[rows, width]`, or `[rows, width / 2]` with `silu_and_mul`, in `dtype`.
    """
    if kernels:
        return torch.ops.shoal.dequantize_rows(acc, row_scale, col_scale, silu_and_mul, dtype)
    out = acc.float() * row_scale[:, None] * col_scale[None, :]
    if silu_and_mul:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.to(dtype)


def rope_cos_sin(theta: float, head_dim: int, max_positions: int) -> torch.Tensor:
    """RoPE table (Su et al. 2021) as transformers builds its angles: `[max_positions, head_dim]`
    float32, cos of the `head_dim / 2` frequencies in the first half of a row, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
          head_dim: int, kernels: bool) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of `qkv` by its position, in the
    "rotate half" layout: `x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin` for the two halves.

    Args:
        qkv: `[n, >= num_heads * head_dim]` contiguous (the fused QKV output: query and key heads
            come first, so `num_heads = Hq + Hkv` rotates both and leaves V alone).
        positions: `[n]` int64.
        cos_sin: `rope_cos_sin(...)`.

    Raises:
        RuntimeError (kernel) / IndexError (reference): a position outside the table.
    """
    if kernels:
        torch.ops.shoal.rope_(qkv, positions, cos_sin, num_heads, head_dim)
    else:
        rope_reference_(qkv, positions, cos_sin, num_heads, head_dim)


def rope_reference_(qkv, positions, cos_sin, num_heads, head_dim):
    half = head_dim // 2
    x = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    cs = cos_sin[positions].unsqueeze(1)  # [n, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def topk_rows(x: torch.Tensor, k: int, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest entries of each row, in descending order.

    Args:
        x: `[rows, width]` (contiguous for the kernel).

    Returns:
        values `[rows, k]` float32 and their column indices `[rows, k]` int64 (among equal values
        the order is unspecified).
    """
    if kernels:
        return torch.ops.shoal.topk_rows(x, k)
    values, indices = x.float().topk(k, dim=-1)
    return values, indices


# Row k of `_BITS` holds byte k's 8 bits, least significant first.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                         kernels: bool) -> None:
    """Set to -inf, in place, every logit whose bit is clear in its row's token bitmask
    (llguidance's layout: token 32 * w + j is bit j of int32 word w), and every logit past the
    mask's width.

    Args:
        logits: `[num_rows, vocab]` float32 (contiguous for the kernel).
        bitmask: `[n, words]` int32, one row for each of `rows`.
        rows: `[n]` int64, the logits row each bitmask row masks.
        kernels: use the C++ kernel (see `kernels_enabled`).

    Raises:
        RuntimeError: a row index out of range.
    """
    if kernels:
        torch.ops.shoal.apply_token_bitmask_(logits, bitmask, rows)
        return
    # Little-endian int32 words: byte i of the mask covers tokens 8 * i to 8 * i + 7.
    allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], 1)
    logits[rows] = logits[rows].masked_fill_(~allowed[:, :vocab], float("-inf"))


def candidate_logits(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor,
                     kernels: bool) -> torch.Tensor:
    """Each row's candidates' logits, recomputed exactly: `out[r, j] = h[r] . weight[idx[r, j]]`
    in float32 (the weight's rows widened exactly).

    Args:
        h: `[rows, hidden]` float32 (contiguous for the kernel).
        weight: `[vocab, hidden]` float32 or bfloat16, the LM head.
        idx: `[rows, k]` int64 row indices of `weight`.

    Returns:
        `[rows, k]` float32. The kernel's sums run in a fixed order, so a row's values do not
        depend on the other rows or on k; the reference's follow torch's matmul.

    Raises:
        RuntimeError: an index out of range.
    """
    if kernels:
        return torch.ops.shoal.candidate_logits(h, weight, idx)
    rows = weight.index_select(0, idx.view(-1)).view(*idx.shape, -1)
    return torch.einsum("rd,rkd->rk", h, rows.float())


def rope_rotate(x: torch.Tensor, delta: int, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate keys that carry RoPE at positions p so they carry it at p + delta (delta may be
    negative): `K' = R(delta * theta) K` per frequency, the "rotate half" layout as in `rope_`.
    Shift-RoPE-K (Neural Speed's infinite inference) moves cached keys back this way instead of
    recomputing them.

    Args:
        x: `[..., head_dim]` keys, any float dtype.
        delta: positions to move by; |delta| must be a row of `cos_sin`.
        cos_sin: `rope_cos_sin(...)`.

    Returns:
        Rotated keys, x's shape and dtype (computed in float32).
    """
    half = x.shape[-1] // 2
    row = cos_sin[abs(delta)]
    cos, sin = row[:half], row[half:] * (1 if delta >= 0 else -1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
