"""The Triton kernels of worker/kernels against the torch path: on a CUDA device where there is
one (inputs made on the CPU, then copied to it), else by Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported when there is no GPU).

Inputs are random, never zeros; outputs and pools are poisoned first (NaN or random values) so an
element a kernel fails to write, or writes where it should not, fails the comparison.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from shoal.messages import NewRequest  # noqa: E402
from shoal.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import make_engine  # noqa: E402
from worker import ops  # noqa: E402
from worker.attention import (  # noqa: E402
    TorchAttention,
    build_metadata,
    decode_attention_reference,
    make_backend,
    write_kv,
)
from worker.kernels import TritonAttention  # noqa: E402
from worker.offline import generate  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1")

# Where the kernels run: the references are computed on the CPU from the same inputs.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_REL_MAX = 1e-5  # the bound for float32
LOW_PRECISION_REL_MAX = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `tensors` on DEVICE."""
    return [t.to(DEVICE) for t in tensors]


def bound(dtype: torch.dtype) -> float:
    return FP32_REL_MAX if dtype == torch.float32 else LOW_PRECISION_REL_MAX[dtype]


def random_pools(g, hkv, num_blocks, bs, d, dtype):
    k_pool = torch.randn(hkv, num_blocks, d, bs, generator=g).to(dtype)
    v_pool = torch.randn(hkv, num_blocks, bs, d, generator=g).to(dtype)
    return k_pool, v_pool


def random_tables(g, lens, bs, num_blocks):
    """Disjoint, shuffled (non-contiguous) block tables covering each length."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[:need])
        perm = perm[need:]
    return tables


CASES = [(64, 1, 16), (64, 3, 16), (128, 4, 32), (128, 3, 16), (64, 4, 32)]  # head_dim, GQA, BS


@pytest.mark.parametrize("head_dim,group,bs", CASES)
def test_decode_attention_matches_the_torch_path(head_dim, group, bs):
    g = torch.Generator().manual_seed(head_dim * 10 + group)
    hkv, lens = 2, [1, 2, bs - 1, bs, bs + 1, 77, 300]
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    k_pool, v_pool = random_pools(g, hkv, num_blocks, bs, head_dim, torch.float32)
    tables = random_tables(g, lens, bs, num_blocks)
    meta = build_metadata(tables, lens, [], bs)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=g)
    out = torch.full((len(lens), hkv * group * head_dim), float("nan"), device=DEVICE)
    TritonAttention().decode(*on_device(q, k_pool, v_pool),
                             build_metadata(tables, lens, [], bs, DEVICE), head_dim**-0.5, out)
    out = out.cpu()
    expected = decode_attention_reference(q, k_pool, v_pool, meta, head_dim**-0.5)
    assert not out.isnan().any()
    for r in range(len(lens)):  # every request by itself: a short one is not hidden by long ones
        assert rel(out[r], expected[r]) <= FP32_REL_MAX, (r, lens[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_in_half_precision(dtype):
    g = torch.Generator().manual_seed(7)
    hkv, group, d, bs, lens = 3, 3, 64, 16, [5, 40, 123]
    k_pool, v_pool = random_pools(g, hkv, 20, bs, d, dtype)
    tables = random_tables(g, lens, bs, 20)
    meta = build_metadata(tables, lens, [], bs)
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    out = torch.full((len(lens), hkv * group * d), float("nan"), dtype=dtype, device=DEVICE)
    TritonAttention().decode(*on_device(q, k_pool, v_pool),
                             build_metadata(tables, lens, [], bs, DEVICE), d**-0.5, out)
    expected = decode_attention_reference(q.float(), k_pool.float(), v_pool.float(), meta, d**-0.5)
    assert rel(out, expected) <= bound(dtype)


@pytest.mark.parametrize("head_dim,group,bs", CASES[:3])
def test_prefill_attention_over_cached_prefixes_matches_the_torch_path(head_dim, group, bs):
    """Several chunks in one flat batch after two decodes: whole prompts (nothing cached) and
    chunks of chunked prefills whose queries also see their request's cached prefix."""
    g = torch.Generator().manual_seed(head_dim + group)
    hkv = 2
    hq = hkv * group
    decode_lens = [9, 40]
    chunks = [(0, 37), (50, 20), (250, 50), (3, 1), (0, 1)]  # (num_cached, chunk)
    totals = [c + n for c, n in chunks]
    num_blocks = sum(-(-n // bs) for n in decode_lens + totals) + 3
    k_pool, v_pool = random_pools(g, hkv, num_blocks, bs, head_dim, torch.float32)
    tables = random_tables(g, decode_lens + totals, bs, num_blocks)
    meta = build_metadata(tables[:2], decode_lens,
                          [(t, c, n) for t, (c, n) in zip(tables[2:], chunks)], bs)
    num_tokens = 2 + sum(n for _, n in chunks)
    q = torch.randn(num_tokens, hq, head_dim, generator=g)
    k = torch.randn(num_tokens, hkv, head_dim, generator=g)
    v = torch.randn(num_tokens, hkv, head_dim, generator=g)
    write_kv(k, v, k_pool, v_pool, meta.slot_mapping, kernels=False)
    got = torch.full((num_tokens, hq * head_dim), float("nan"), device=DEVICE)
    expected = torch.full((num_tokens, hq * head_dim), float("nan"))
    dev_meta = build_metadata(tables[:2], decode_lens,
                              [(t, c, n) for t, (c, n) in zip(tables[2:], chunks)], bs, DEVICE)
    TritonAttention().prefill(*on_device(q, k, v, k_pool, v_pool), dev_meta, head_dim**-0.5, got)
    got = got.cpu()
    TorchAttention(cpu_kernels=False).prefill(q, k, v, k_pool, v_pool, meta, head_dim**-0.5,
                                              expected)
    assert got[:2].isnan().all()  # the decode rows are not the prefill kernel's to write
    for span in meta.prefills:
        rows = slice(span.start, span.end)
        assert not got[rows].isnan().any()
        assert rel(got[rows], expected[rows]) <= FP32_REL_MAX, (span.num_cached, span.end - span.start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_its_slots(dtype):
    g = torch.Generator().manual_seed(3)
    hkv, d, bs, num_blocks = 3, 64, 16, 12
    k_pool, v_pool = random_pools(g, hkv, num_blocks, bs, d, dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:29]
    k = torch.randn(29, hkv, d, generator=g).to(dtype)
    v = torch.randn(29, hkv, d, generator=g).to(dtype)
    ek, ev = k_pool.clone(), v_pool.clone()
    write_kv(k, v, ek, ev, slots, kernels=False)
    k_pool, v_pool = on_device(k_pool, v_pool)
    TritonAttention().write_kv(*on_device(k, v), k_pool, v_pool, slots.to(DEVICE))
    assert torch.equal(k_pool.cpu(), ek) and torch.equal(v_pool.cpu(), ev)


def test_write_kv_skips_padding_rows():
    """Rows with a negative slot (a CUDA graph's padding, worker/cuda_graphs.py) write nothing;
    the others land at their slots."""
    g = torch.Generator().manual_seed(4)
    hkv, d, bs, num_blocks = 3, 64, 16, 6
    k_pool, v_pool = random_pools(g, hkv, num_blocks, bs, d, torch.float32)
    slots = torch.tensor([17, -1, 40, -1, -1, 3])
    k, v = torch.randn(6, hkv, d, generator=g), torch.randn(6, hkv, d, generator=g)
    real = slots >= 0
    ek, ev = k_pool.clone(), v_pool.clone()
    write_kv(k[real], v[real], ek, ev, slots[real], kernels=False)
    k_pool, v_pool = on_device(k_pool, v_pool)
    TritonAttention().write_kv(*on_device(k, v), k_pool, v_pool, slots.to(DEVICE))
    assert torch.equal(k_pool.cpu(), ek) and torch.equal(v_pool.cpu(), ev)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_matches_the_reference(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    hq, hkv, n = 9, 3, 23
    table = ops.rope_cos_sin(10000.0, head_dim, 512)
    qkv = torch.randn(n, (hq + 2 * hkv) * head_dim, generator=g)
    positions = torch.randint(0, 512, (n,), generator=g)
    expected = qkv.clone()
    ops.rope_reference_(expected, positions, table, hq + hkv, head_dim)
    qkv = qkv.to(DEVICE)
    TritonAttention().rope_(qkv, *on_device(positions, table), hq + hkv, head_dim)
    qkv = qkv.cpu()
    assert rel(qkv, expected) <= FP32_REL_MAX
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], expected[:, (hq + hkv) * head_dim:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("delta", [-1, -37, -200, 5])
def test_rotating_keys_in_place_matches_rope_rotate(head_dim, delta):
    g = torch.Generator().manual_seed(abs(delta))
    table = ops.rope_cos_sin(10000.0, head_dim, 512)
    keys = torch.randn(31, 3, head_dim, generator=g)
    expected = ops.rope_rotate(keys, delta, table)
    got = TritonAttention().rotate_keys(keys.to(DEVICE), delta, table.to(DEVICE))
    assert rel(got, expected) <= FP32_REL_MAX


def test_shift_request_kv_moves_and_rotates_like_the_torch_path():
    g = torch.Generator().manual_seed(11)
    hkv, d, bs = 3, 64, 16
    k_pool, v_pool = random_pools(g, hkv, 24, bs, d, torch.float32)
    table = random_tables(g, [200], bs, 24)[0]
    table_ = ops.rope_cos_sin(10000.0, d, 512)
    ek, ev = k_pool.clone(), v_pool.clone()
    TorchAttention(cpu_kernels=False).shift_request_kv(ek, ev, table, 4, 98, 200, table_)
    k_pool, v_pool = on_device(k_pool, v_pool)
    TritonAttention().shift_request_kv(k_pool, v_pool, table, 4, 98, 200, table_.to(DEVICE))
    assert rel(k_pool, ek) <= FP32_REL_MAX and torch.equal(v_pool.cpu(), ev)


def test_backend_choice():
    assert isinstance(make_backend("auto", torch.device("cpu"), True), TorchAttention)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels run interpreted on the CPU
        assert isinstance(make_backend("triton", torch.device("cpu"), True), TritonAttention)
    else:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            make_backend("triton", torch.device("cpu"), True)
    if torch.cuda.is_available():
        assert isinstance(make_backend("auto", DEVICE, True), TritonAttention)
    with pytest.raises(ValueError, match="attention backend"):
        make_backend("flash", torch.device("cpu"), True)
    with pytest.raises(ValueError, match="--block-size to be a power of two"):
        TritonAttention().check(8, 64)
    with pytest.raises(ValueError, match="head dim"):
        TritonAttention().check(16, 48)
    TorchAttention(cpu_kernels=False).check(8, 48)  # the torch path serves any size


def test_bench_kernels_says_there_is_no_gpu_and_succeeds(tmp_path):
    import subprocess

    from shoal.fleet import shoal_command

    r = subprocess.run([*shoal_command("bench", "kernels", "--output", str(tmp_path / "k.json"))],
                       capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        assert r.returncode == 0 and (tmp_path / "k.json").exists(), r.stderr
    else:
        assert r.returncode == 0 and "no CUDA device" in r.stdout, r.stderr
        assert not (tmp_path / "k.json").exists()


@pytest.mark.slow
def test_engine_with_triton_backend_gives_the_torch_tokens(fp32_model, tokenizer):
    """Whole iterations of the real model, prefill and decode mixed, with every attention op
    a Triton kernel: the same greedy tokens as the torch backend (both on the GPU where there
    is one: the torch backend's chunked prefill over a cached prefix once built its mask on the
    CPU there)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # Two: the short one decodes beside the long one's prefill chunks.
    prompts = ["The capital of France is",
               "Once upon a time, in a small village by the sea, there lived"]
    requests = [NewRequest(f"r{i}", tokenizer.encode(p, add_special_tokens=False), params)
                for i, p in enumerate(prompts)]
    tokens = {}
    for backend in ("torch", "triton"):
        # An 8-token budget chunks the longest prompt: queries also attend to a cached prefix.
        engine = make_engine(fp32_model, attention_backend=backend, kv_cache_bytes=16 << 20,
                             max_num_batched_tokens=8, device=str(DEVICE))
        assert engine.model.attention.name == backend
        tokens[backend] = {r: c.token_ids for r, c in generate(engine, requests).items()}
    assert all(len(t) == 4 for t in tokens["triton"].values())
    assert tokens["triton"] == tokens["torch"]
