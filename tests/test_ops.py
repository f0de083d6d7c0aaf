"""The C++ CPU kernels (worker/csrc/) against their torch references, on random inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import random_q4_levels
from worker import cpu_ops, ops
from worker.attention import (
    AttentionBackend,
    TorchAttention,
    build_metadata,
    decode_attention_reference,
    write_kv,
)
from worker.linear import (
    AMX_MAX_ROWS,
    AMX_NARROW_MAX_K,
    DP_MAX_ROWS,
    F32_LANES_AVX2_MAX_ROWS,
    INT4_Q8_MAX_ROWS,
    LANES_MAX_ROWS,
    LM_HEAD_DP_MAX_ROWS,
    Q4_AMX_MAX_ROWS,
    Q4_LANES_MAX_ROWS,
    Q4_MAX_ROWS,
    QUANTIZED_MAX_ROWS,
    W8A8_MIN_ROWS,
    W8A8_VNNI_MIN_ROWS,
    Linear,
    int4_levels,
    pack_int4_lanes,
    pack_int4_quads,
    pack_lanes,
    pack_q4_lanes,
    pack_q4_pairs,
    q4_weight,
    quantize_int4,
    quantize_int8,
    swiglu_interleave,
)

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="the C++ kernels did not build here")

LOAD = [sys.executable, "-c", "from worker import cpu_ops; print(cpu_ops.load())"]


def test_a_process_killed_while_loading_does_not_block_the_next(tmp_path):
    """torch holds a lock file for every load (about 1.5 s when built); a worker killed in that
    window (a chaos kill, the OOM killer) left it behind and every later worker on the machine
    waited on it forever (CI, session 19)."""
    # A private copy of the build (mtimes kept, so ninja finds it up to date): other test
    # processes load the shared one all the time and would clear the stale lock before we look.
    shutil.copytree(cpu_ops.build_directory(), tmp_path / cpu_ops.build_directory().name)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = tmp_path / cpu_ops.build_directory().name / "lock"
    victim = subprocess.Popen(LOAD, stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not lock.exists() and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert lock.exists(), "the loading process never took torch's lock"
        victim.kill()
        victim.wait(10)
        assert lock.exists()  # the stale lock the next process meets
        r = subprocess.run(LOAD, capture_output=True, text=True, timeout=120, env=env)
        assert r.stdout.strip() == "True", r.stderr
        assert not lock.exists()
    finally:
        victim.kill()


def test_the_build_goes_where_torch_extensions_dir_says(monkeypatch, tmp_path):
    """The Docker image and the Kubernetes pods point TORCH_EXTENSIONS_DIR at a writable
    emptyDir under a read-only root; torch's `get_default_build_root` ignores the variable, so
    the build was aimed at the read-only home, where it cannot succeed."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_ops.build_directory().parent == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_ops.build_directory().parent != tmp_path


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, "same"])
def test_add_rms_norm(dtype, delta_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 96, generator=g) * 3
    w = torch.rand(96, generator=g) + 0.5
    delta = None
    if delta_dtype is not None:
        delta = torch.randn(37, 96, generator=g).to(dtype if delta_dtype == "same" else delta_dtype)
    x_kernel, x_ref = x.clone(), x.clone()
    out = ops.add_rms_norm(x_kernel, delta, w, 1e-5, dtype, kernels=True)
    ref = ops.add_rms_norm_reference(x_ref, delta, w, 1e-5, dtype)
    assert out.dtype == dtype and out.shape == (37, 96)
    assert rel(out, ref) <= TOL[dtype]
    assert torch.allclose(x_kernel, x_ref, rtol=0, atol=1e-6)  # the residual stream was updated
    if delta is not None:
        assert not torch.equal(x_kernel, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(19, 2 * 75, generator=g) * 4).to(dtype)
    out = ops.silu_and_mul(gate_up, kernels=True)
    assert out.shape == (19, 75)
    assert rel(out, ops.silu_and_mul_reference(gate_up)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope(dtype, head_dim):
    g = torch.Generator().manual_seed(3)
    hq, hkv, n = 6, 2, 23
    qkv = torch.randn(n, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (n,), generator=g)
    table = ops.rope_cos_sin(10000.0, head_dim, 4096)
    a, b = qkv.clone(), qkv.clone()
    ops.rope_(a, positions, table, hq + hkv, head_dim, kernels=True)
    ops.rope_reference_(b, positions, table, hq + hkv, head_dim)
    assert rel(a, b) <= TOL[dtype]
    rotated = (hq + hkv) * head_dim
    assert torch.equal(a[:, rotated:], qkv[:, rotated:])  # V is left alone
    assert not torch.allclose(a[:, :rotated].float(), qkv[:, :rotated].float())
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rope_(a, torch.full((n,), 4096), table, hq + hkv, head_dim, kernels=True)


def _random_cache(g, hkv, num_blocks, bs, d, dtype):
    k_pool = torch.randn(hkv, num_blocks, d, bs, generator=g).to(dtype)
    v_pool = torch.randn(hkv, num_blocks, bs, d, generator=g).to(dtype)
    return k_pool, v_pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_touches_only_its_slots(dtype):
    g = torch.Generator().manual_seed(4)
    hkv, nb, bs, d, n = 3, 20, 8, 64, 29
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    pools = []
    for kernels in (True, False):
        k_pool = torch.full((hkv, nb, d, bs), float("nan"), dtype=dtype)
        v_pool = torch.full((hkv, nb, bs, d), float("nan"), dtype=dtype)
        write_kv(k, v, k_pool, v_pool, slots, kernels)
        pools.append((k_pool, v_pool))
    (kk, vk), (kr, vr) = pools
    assert torch.equal(kk.isnan(), kr.isnan()) and torch.equal(vk.isnan(), vr.isnan())
    assert (~kk.isnan()).sum() == n * hkv * d  # exactly the slots written
    assert torch.equal(kk.nan_to_num(), kr.nan_to_num()) and torch.equal(vk.nan_to_num(), vr.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (32, 8)])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_attention(dtype, head_dim, block_size, group):
    g = torch.Generator().manual_seed(5 + head_dim + group)
    hkv, num_blocks = 2, 96
    lens = [1, 2, block_size, block_size + 1, 77, 300, 5, 129]
    # Non-contiguous, shuffled blocks, never shared between requests.
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        m = -(-n // block_size)
        tables.append(free[:m])
        free = free[m:]
    k_pool, v_pool = _random_cache(g, hkv, num_blocks, block_size, head_dim, dtype)
    # The kernel never reads a slot past a request's length, whatever it holds (NaN here); the
    # reference path multiplies them by zero probabilities, so it gets them zeroed.
    clean = k_pool.clone(), v_pool.clone()
    for n, table in zip(lens, tables):
        k_pool[:, table[-1], :, (n - 1) % block_size + 1:] = float("nan")
        v_pool[:, table[-1], (n - 1) % block_size + 1:] = float("nan")
    q = torch.randn(len(lens), hkv * group, head_dim, generator=g).to(dtype)
    meta = build_metadata(tables, lens, [], block_size)
    scale = head_dim**-0.5
    out = torch.ops.shoal.paged_attention(q, k_pool, v_pool, meta.decode_block_tables,
                                          torch.arange(len(lens) + 1), meta.decode_lens, scale)
    ref = decode_attention_reference(q.float(), clean[0].float(), clean[1].float(), meta, scale)
    assert out.shape == (len(lens), hkv * group * head_dim) and out.dtype == dtype
    assert out.isfinite().all()
    assert rel(out, ref) <= TOL[dtype]
    # A one-token context attends only to itself: the output is that token's value.
    first = out[0].view(hkv * group, head_dim).float()
    own_v = v_pool[:, tables[0][0], 0].float().repeat_interleave(group, dim=0)
    assert torch.allclose(first, own_v, atol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4])
def test_one_kernel_call_attends_decodes_and_prefill_chunks(dtype, group):
    """A whole iteration (decodes, a prompt prefilled at once, and a chunk continuing a cached
    prefix) through the kernel path, which scores every row as a query over its request's pages,
    against the reference path (SDPA per chunk, gathered blocks). In bfloat16 the prefill chunks
    take the bfloat16-pair kernels where the CPU has them (AVX512_BF16 or AMX), one instantiation
    per GQA group."""
    g = torch.Generator().manual_seed(17 + group)
    hkv, d, bs, num_blocks = 3, 64, 16, 64
    k_pool, v_pool = _random_cache(g, hkv, num_blocks, bs, d, dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()

    def take(tokens):
        nonlocal free
        m = -(-tokens // bs)
        table, free = free[:m], free[m:]
        return table

    decode_lens = [5, 40, 129]
    decode_tables = [take(n) for n in decode_lens]
    prefills = [(take(37), 0, 37), (take(70 + 45), 70, 45)]  # (table, cached, chunk)
    meta = build_metadata(decode_tables, decode_lens, prefills, bs)
    n = len(decode_lens) + 37 + 45
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    scale = d**-0.5
    ref = TorchAttention(cpu_kernels=False).forward(q.float(), k.float(), v.float(),
                                                    k_pool.float(), v_pool.float(), meta, scale)
    out = TorchAttention(cpu_kernels=True).forward(q, k, v, k_pool, v_pool, meta, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel(out, ref) <= TOL[dtype]
    for span in meta.prefills:  # each chunk by itself: a wrong one is not hidden by the rest
        rows = slice(span.start, span.end)
        assert rel(out[rows], ref[rows]) <= TOL[dtype], (span.num_cached, span.end - span.start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_qkv_is_rope_write_kv_and_paged_attention(dtype):
    """shoal::attend_qkv (one call a layer) against the backend's three calls in turn on a fused
    QKV projection of decodes and prefill chunks: the same output and pools, to the bit, and the
    same RoPE applied in place."""
    g = torch.Generator().manual_seed(23)
    hq, hkv, d, bs, num_blocks = 6, 2, 64, 16, 64
    pools = _random_cache(g, hkv, num_blocks, bs, d, dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    decode_lens = [5, 40]
    tables = [free[:1], free[1:4]]
    prefills = [(free[4:8], 20, 30)]  # (table, cached, chunk)
    meta = build_metadata(tables, decode_lens, prefills, bs)
    n = len(decode_lens) + 30
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.tensor([4, 39, *range(20, 50)])
    cos_sin = ops.rope_cos_sin(10000.0, d, 256)
    runs = []
    for fused in (True, False):
        x, k_pool, v_pool = qkv.clone(), pools[0].clone(), pools[1].clone()
        backend = TorchAttention(cpu_kernels=True)
        if fused:
            out = backend.attend(x, positions, cos_sin, k_pool, v_pool, meta, d**-0.5, hq, hkv, d)
        else:  # the base class's sequence of the same primitives
            out = AttentionBackend.attend(backend, x, positions, cos_sin, k_pool, v_pool, meta,
                                          d**-0.5, hq, hkv, d)
        runs.append((out, x, k_pool, v_pool))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0][1], qkv)  # RoPE rotated the rows in place
    with pytest.raises(RuntimeError, match="qkv"):
        torch.ops.shoal.attend_qkv(qkv[:, :-64].contiguous(), positions, cos_sin, *pools,
                                   meta.slot_mapping, *meta.seq_arrays, hq, hkv, d, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,k", [(5000, 8), (49152, 128), (49152, 64), (130, 64), (1000, 1)])
def test_topk_rows(dtype, width, k):
    """The k largest of each row in descending order, equal values by lower column: rows of a
    vocabulary's width (the kernel then reads only the chunks whose maximum reaches the k-th
    largest chunk maximum) and rows of fewer chunks than k (every entry read)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, width, generator=g).to(dtype)
    x[:, ::5] = x[:, 2:3]  # ties, some among the best
    x[1] = x[1].abs().neg()  # a row of negative logits
    values, indices = ops.topk_rows(x, k, kernels=True)
    ref_values, ref_indices = x.float().sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, ref_values[:, :k])
    assert torch.equal(indices, ref_indices[:, :k])
    assert torch.equal(ops.topk_rows(x, 1, kernels=True)[0][:, 0], x.float().max(dim=-1).values)


def test_topk_rows_of_masked_logits():
    """Logits masked to -inf (a logit bias) rank below every finite one; fewer finite entries
    than k leave -inf values behind the finite ones, each a real column."""
    x = torch.full((2, 49152), float("-inf"))
    x[0, 7], x[0, 40000], x[1, 123] = 1.0, 2.0, -3.0
    values, indices = ops.topk_rows(x, 4, kernels=True)
    assert values[0, :2].tolist() == [2.0, 1.0] and indices[0, :2].tolist() == [40000, 7]
    assert values[1, 0] == -3.0 and indices[1, 0] == 123
    assert torch.isneginf(values[:, 2:]).all() and indices[1, 1:].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_candidate_logits(dtype):
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(3000, 72, generator=g).to(dtype)  # 72: a partial 16-lane tail
    h = torch.randn(9, 72, generator=g)
    idx = torch.randint(0, 3000, (9, 40), generator=g)
    out = ops.candidate_logits(h, weight, idx, kernels=True)
    exact = torch.einsum("rd,rkd->rk", h.double(), weight.double()[idx])
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    # A row's values do not depend on the other rows or on how many candidates it has.
    one = ops.candidate_logits(h[4:5].contiguous(), weight, idx[4:5, :7].contiguous(), True)
    assert torch.equal(one, out[4:5, :7])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.candidate_logits(h, weight, idx.clone().fill_(3000), kernels=True)


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_packed_linear_matches_f_linear(dtype, bound):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    lin = Linear(w)
    # oneDNN packs bfloat16 only on CPUs it computes bfloat16 on (not AVX2-only ones: Zen 3)
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        assert lin.packed is not None and lin.weight is None  # the packed path is what ran
    else:
        assert lin.packed is None and lin.weight is not None
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        assert rel(lin(x), torch.nn.functional.linear(x, w)) <= bound


@pytest.mark.skipif(not ops.dp_linear_available(), reason="the kernels were built without AVX512_BF16")
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (64, 160), (160, 1536)])
def test_bfloat16_pair_kernels_serve_their_iterations(out_features, in_features):
    """shoal::dp_linear (AVX512_BF16) and, where the CPU has AMX, shoal::amx_linear, both over
    weights packed in pairs of input channels, against float32 math for row counts that fill
    and that leave partial register blocks, tiles and row passes (1,536 inputs: 80 rows a pass);
    Linear hands the pair kernels exactly the iterations it should."""
    g = torch.Generator().manual_seed(30 + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).to(torch.bfloat16)
    packed = torch.ops.shoal.pack_weight_pairs(w)
    lin = Linear(w, kernels=True)
    assert lin.pairs is not None and lin.amx == ops.amx_available()
    narrow = in_features <= AMX_NARROW_MAX_K  # amx_linear beats oneDNN at every size there
    assert lin.pairs_max_rows == (DP_MAX_ROWS if not lin.amx
                                  else sys.maxsize if narrow else AMX_MAX_ROWS)
    for rows in (1, 3, 7, 8, 16, 17, 40, 64, 81, 100, 300, AMX_MAX_ROWS, 2 * AMX_MAX_ROWS + 5):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        exact = torch.nn.functional.linear(x.float(), w.float())
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        assert rel(y, exact) <= 5e-3
        dp = torch.ops.shoal.dp_linear(x, packed)
        assert rel(dp, exact) <= 5e-3, rows
        if lin.amx and rows <= lin.pairs_max_rows:
            assert torch.equal(y, torch.ops.shoal.amx_linear(x, packed))
    # Which path serves which size: with the packed pairs zeroed, exactly the iterations the
    # pair kernels serve come out zero (dp_linear and oneDNN can agree to the bit here).
    lin.pairs = torch.zeros_like(lin.pairs)
    for rows in (1, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 2 * AMX_MAX_ROWS + 5):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        assert (lin(x) == 0).all() == (rows <= lin.pairs_max_rows), rows
    if not lin.amx:  # dp_linear serves every size: the packed pairs are the only copy kept
        assert lin.weight is None and lin.packed is None
    with pytest.raises(RuntimeError, match="multiples of 32"):
        torch.ops.shoal.pack_weight_pairs(w[:, :40].contiguous())
    with pytest.raises(RuntimeError, match="packed by pack_weight_pairs"):
        torch.ops.shoal.dp_linear(torch.zeros(2, in_features + 32, dtype=torch.bfloat16), packed)


@pytest.mark.skipif(not ops.amx_available(), reason="needs AMX")
@pytest.mark.parametrize(("out_features", "in_features", "silu"),
                         [(960, 576, False), (3072, 576, True), (96, 640, False),
                          (160, 1536, False), (64, 160, True)])
def test_amx_linear_rows_get_the_same_bits_in_any_iteration(out_features, in_features, silu):
    """Past 64 rows amx_linear turns its loop order over (K <= 640: 32 rows of x at a time
    against groups of weight blocks, worker/csrc/pairs.cpp): every row must still come out with
    the bits it gets in an iteration of 16 rows, so a request's tokens do not depend on what
    runs beside it (3,072 channels at K = 576: several groups of blocks a thread; K = 1,536: the
    old order throughout)."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).to(torch.bfloat16)
    packed = torch.ops.shoal.pack_weight_pairs(w)
    for rows in (65, 97, 300, 1100):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        y = torch.ops.shoal.amx_linear(x, packed, silu)
        small = torch.cat([torch.ops.shoal.amx_linear(x[i:i + 16], packed, silu)
                           for i in range(0, rows, 16)])
        assert torch.equal(y.view(torch.int16), small.view(torch.int16)), rows
        if not silu:  # (SwiGLU's values: test_pair_kernels_give_swiglu_of_the_gate_up_projection)
            assert rel(y, torch.nn.functional.linear(x.float(), w.float())) <= 5e-3, rows


@pytest.mark.skipif(not ops.dp_linear_available(), reason="needs AVX512_BF16")
@pytest.mark.parametrize(("intermediate", "in_features"), [(48, 64), (64, 1536)])
def test_pair_kernels_give_swiglu_of_the_gate_up_projection(intermediate, in_features):
    """A fused gate/up Linear on dp_linear (or, with AMX, amx_linear) computes silu(gate) * up
    from the accumulators (shoal::dp_linear_silu, amx_linear's silu_and_mul) for every
    iteration it serves (row counts that leave partial tiles and, at 1,536 inputs, several row
    passes; 48 channels: a last pair of blocks outside dp's 4-block tiles; AMX: one and two row
    tiles, several 256-row passes), against float32 math; the projection itself still comes
    back in [gate | up] order."""
    g = torch.Generator().manual_seed(50 + in_features)
    w = (torch.randn(2 * intermediate, in_features, generator=g) * 0.1).to(torch.bfloat16)
    lin = Linear(w, kernels=True, swiglu=True)
    assert lin.swiglu_pairs
    for rows in (1, 5, 6, 7, 13, 17, 64, 300, 600, 2 * AMX_MAX_ROWS + 5):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        exact = torch.nn.functional.linear(x.float(), w.float())
        gate, up = exact.chunk(2, dim=-1)
        out = lin.silu_and_mul(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, intermediate)
        assert rel(out, torch.nn.functional.silu(gate) * up) <= 5e-3, rows
        assert rel(lin(x), exact) <= 5e-3, rows
    # The fused kernels serve every size (on AMX too: no oneDNN copy is kept), so with the
    # packed pairs zeroed every output comes out zero.
    assert lin.pairs_max_rows == sys.maxsize and lin.weight is None and lin.packed is None
    lin.pairs = torch.zeros_like(lin.pairs)
    for rows in (300, 2 * AMX_MAX_ROWS + 5):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        assert (lin.silu_and_mul(x) == 0).all(), rows


@pytest.mark.skipif(not ops.dp_linear_available() or ops.amx_available(),
                    reason="needs AVX512_BF16 without AMX")
@pytest.mark.parametrize(("out_features", "in_features", "q4_0"),
                         [(32, 64, False), (128, 64, False), (96, 576, True),
                          (960, 128, False)])
def test_q4_linear_gives_dp_linears_bits_from_4_bit_levels(out_features, in_features, q4_0):
    """shoal::q4_linear rebuilds the bfloat16 weight from GGUF's 4-bit levels in registers and
    must return dp_linear's result over that weight to the bit (so serving from the levels
    changes no logit), plain and SwiGLU, for row counts that fill and leave partial tiles (32
    and 128 channels: 2 and 8 blocks, 2 outside the 6-block tiles of 1-2 rows), and past 8 rows,
    where each tile's weights are rebuilt into a scratch for dp_linear's tiles (300 rows of 576
    inputs: two passes of rows, each rebuilding them); the values are also checked against
    float32 math, so a layout error shared by both cannot pass."""
    g = torch.Generator().manual_seed(70 + in_features)
    levels, scale_min = random_q4_levels(out_features, in_features, g, q4_0)
    w = q4_weight(levels, scale_min, torch.bfloat16)
    packed = pack_q4_pairs(levels, scale_min)
    pairs = torch.ops.shoal.pack_weight_pairs(w)
    silu_levels = pack_q4_pairs(swiglu_interleave(levels),
                                swiglu_interleave(scale_min.flatten(1)).view(scale_min.shape))
    silu_pairs = torch.ops.shoal.pack_weight_pairs(swiglu_interleave(w))
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, 41, 300):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        y = torch.ops.shoal.q4_linear(x, packed, False)
        assert torch.equal(y.view(torch.int16), torch.ops.shoal.dp_linear(x, pairs).view(torch.int16))
        assert rel(y, torch.nn.functional.linear(x.float(), w.float())) <= 5e-3
        s = torch.ops.shoal.q4_linear(x, silu_levels, True)
        assert s.shape == (rows, out_features // 2)
        assert torch.equal(s.view(torch.int16),
                           torch.ops.shoal.dp_linear_silu(x, silu_pairs).view(torch.int16))
    with pytest.raises(RuntimeError, match="packed weight"):
        torch.ops.shoal.q4_linear(torch.zeros(1, in_features + 32, dtype=torch.bfloat16), packed,
                                  False)


@pytest.mark.skipif(not ops.lanes_linear_available(), reason="the lanes kernels are not built here")
@pytest.mark.parametrize(("out_features", "in_features", "q4_0"),
                         [(32, 64, False), (96, 128, False), (960, 576, True)])
def test_q4_lanes_linear_gives_f32_linears_bits_from_4_bit_levels(out_features, in_features,
                                                                  q4_0):
    """The float32 counterpart: shoal::q4_lanes_linear equals f32_linear over the float32 weight
    the levels stand for, to the bit, and float32 math."""
    g = torch.Generator().manual_seed(90 + in_features)
    levels, scale_min = random_q4_levels(out_features, in_features, g, q4_0)
    w = q4_weight(levels, scale_min, torch.float32)
    packed, lanes = pack_q4_lanes(levels, scale_min), pack_lanes(w)
    # Every tile shape of both (AVX2: chunks of 4 rows in q4_lanes_tiles; AVX-512: tiles of two
    # groups to 4 rows, of one group and up to 12 rows from 5 to 16; f32_item's tiles of 6 over
    # blocks of 256 inputs saved between them), and the weights rebuilt once an iteration
    # (q4_lanes_unpacked) past 12 rows (AVX2) or 16 (AVX-512), last tiles of every size
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 33, 34, 64, 67, 300):
        x = torch.randn(rows, in_features, generator=g)
        y = torch.ops.shoal.q4_lanes_linear(x, packed)
        assert torch.equal(y.view(torch.int32), torch.ops.shoal.f32_linear(x, lanes).view(torch.int32))
        assert rel(y, torch.nn.functional.linear(x, w)) <= 1e-5


@pytest.mark.skipif(not ops.amx_available(), reason="needs AMX")
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 64), (96, 576), (960, 128)])
def test_q4_amx_linear_gives_amx_linears_bits_from_4_bit_levels(out_features, in_features):
    """On AMX CPUs the levels go through shoal::q4_amx_linear, which rebuilds each pair of
    blocks' weight tiles and must return amx_linear's result over the bfloat16 weight to the bit
    (dp_linear's differs there), for one and two row tiles, several pairs of 32 rows and more
    than one 256-row pass, plain and SwiGLU; the values are also checked against float32
    math."""
    g = torch.Generator().manual_seed(75 + in_features)
    levels, scale_min = random_q4_levels(out_features, in_features, g)
    w = q4_weight(levels, scale_min, torch.bfloat16)
    packed, pairs = pack_q4_pairs(levels, scale_min), torch.ops.shoal.pack_weight_pairs(w)
    silu_levels = pack_q4_pairs(swiglu_interleave(levels),
                                swiglu_interleave(scale_min.flatten(1)).view(scale_min.shape))
    silu_pairs = torch.ops.shoal.pack_weight_pairs(swiglu_interleave(w))
    for rows in (1, 2, 16, 17, 33, 64, 300):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        y = torch.ops.shoal.q4_amx_linear(x, packed)
        assert torch.equal(y.view(torch.int16), torch.ops.shoal.amx_linear(x, pairs).view(torch.int16))
        assert rel(y, torch.nn.functional.linear(x.float(), w.float())) <= 5e-3
        s = torch.ops.shoal.q4_amx_linear(x, silu_levels, True)
        assert s.shape == (rows, out_features // 2)
        assert torch.equal(s.view(torch.int16),
                           torch.ops.shoal.amx_linear(x, silu_pairs, True).view(torch.int16))
    with pytest.raises(RuntimeError, match="packed weight"):
        torch.ops.shoal.q4_amx_linear(torch.zeros(1, in_features + 32, dtype=torch.bfloat16),
                                      packed)


def _q4_served(dtype: torch.dtype) -> bool:
    """Whether a Linear of `dtype` takes 4-bit levels on this CPU (worker/linear.py)."""
    if dtype == torch.bfloat16:
        return ops.dp_linear_available() or ops.amx_available()
    return ops.lanes_linear_available()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_serves_few_rows_from_levels_that_give_back_its_weight(dtype, swiglu, caplog):
    """A Linear given the levels its weight came from serves iterations of up to Q4_MAX_ROWS
    rows (bfloat16; Q4_AMX_MAX_ROWS on AMX CPUs) or Q4_LANES_MAX_ROWS (float32, keeping no
    lanes copy) from them (with its other copies zeroed, exactly those rows still come out
    right); levels that do not give back the weight are refused, with a warning."""
    if not _q4_served(dtype):
        pytest.skip(f"no 4-bit levels kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(80 + swiglu)
    levels, scale_min = random_q4_levels(64, 96, g)
    w = q4_weight(levels, scale_min, dtype)
    lin = Linear(w, kernels=True, swiglu=swiglu, q4=(levels, scale_min))
    max_rows = ((Q4_AMX_MAX_ROWS if lin.amx else Q4_MAX_ROWS) if dtype == torch.bfloat16
                else Q4_LANES_MAX_ROWS["avx512" if ops.lanes_avx512() else "avx2"])
    assert lin.q4 is not None and lin.q4_max_rows == max_rows
    assert lin.q4_lanes == (dtype == torch.float32)
    if dtype == torch.bfloat16:
        lin.pairs = torch.zeros_like(lin.pairs)
    else:  # the levels serve every row the lanes copy did, which is not kept; oneDNN the rest
        assert lin.lanes is None and lin.lanes_max_rows == 0
        lin.packed, lin.weight = None, torch.zeros_like(w)
    for rows in (1, max_rows, max_rows + 1):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        exact = torch.nn.functional.linear(x.float(), w.float())
        if swiglu:
            gate, up = exact.chunk(2, dim=-1)
            exact = torch.nn.functional.silu(gate) * up
        y = lin.silu_and_mul(x) if swiglu else lin(x)
        assert (rel(y, exact) <= 5e-3) == (rows <= max_rows), rows
        if swiglu and rows <= max_rows:  # the projection itself, in [gate | up] order
            assert rel(lin(x), torch.nn.functional.linear(x.float(), w.float())) <= 5e-3
    wrong = levels.clone()
    wrong[5, 7] ^= 1
    with caplog.at_level("WARNING", logger="worker.linear"):
        refused = Linear(w, kernels=True, swiglu=swiglu, q4=(wrong, scale_min))
    assert refused.q4 is None and refused.q4_max_rows == 0
    assert "do not give back its weight" in caplog.text
    assert Linear(w, "int8", kernels=True, q4=(levels, scale_min)).q4 is None  # unquantized only


def test_int8_linear_is_used_for_few_rows_only():
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert rel(q.float() * scale.float()[:, None], w) <= 1e-2
    lin = Linear(w, "int8")
    small = torch.randn(QUANTIZED_MAX_ROWS["int8"], 64, generator=g).to(torch.bfloat16)
    dequantized = torch.nn.functional.linear(small.float(), q.float() * scale.float()[:, None])
    assert rel(lin(small), dequantized) <= 1e-2
    large = torch.randn(QUANTIZED_MAX_ROWS["int8"] + 1, 64, generator=g).to(torch.bfloat16)
    assert rel(lin(large), torch.nn.functional.linear(large, w)) <= 1e-2
    with pytest.raises(ValueError, match="quantization"):
        Linear(w, "int3")


def test_int4_gives_back_q4_1_weights_and_serves_few_rows_only():
    """Weights on a Q4_1 grid (per group of 32: min + d * q, q in [0, 15], both ends present,
    as GGUF's quantizer leaves them) come back exactly; larger iterations use the plain weight."""
    g = torch.Generator().manual_seed(9)
    out_features, in_features = 96, 128
    levels = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15
    d = torch.rand(out_features, in_features // 32, 1, generator=g) * 0.01 + 1e-3
    lo = -torch.rand(out_features, in_features // 32, 1, generator=g) * 0.05
    w = (lo + d * levels).reshape(out_features, in_features)
    packed, scales_zeros = quantize_int4(w)
    assert scales_zeros.shape == (in_features // 32, out_features, 2)
    lin = Linear(w, "int4")
    small = torch.randn(QUANTIZED_MAX_ROWS["int4"], in_features, generator=g)
    assert rel(lin(small), torch.nn.functional.linear(small, w)) <= 1e-5  # float32: exact grid
    # Off the grid, 4 bits err by a few percent: that tells which weight served which rows.
    wb = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    lin = Linear(wb, "int4")
    small = small.to(torch.bfloat16)
    assert 1e-2 < rel(lin(small), torch.nn.functional.linear(small, wb)) < 0.2
    large = torch.randn(QUANTIZED_MAX_ROWS["int4"] + 1, in_features, generator=g).to(torch.bfloat16)
    assert rel(lin(large), torch.nn.functional.linear(large, wb)) <= 1e-2
    with pytest.raises(ValueError, match="int4 needs"):
        Linear(w[:, :100], "int4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_and_dequantize_rows(dtype):
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(37, 96, generator=g) * torch.rand(37, 1, generator=g) * 5).to(dtype)
    x[3] = 0  # an all-zero row keeps a finite scale
    q, scale = ops.quantize_rows(x, kernels=True)
    q_ref, scale_ref = ops.quantize_rows(x, kernels=False)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.allclose(scale, scale_ref) and scale[3] == 1.0
    assert (q.int() - q_ref.int()).abs().max() <= 1  # rounding of exact halves may differ
    assert rel(q.float() * scale[:, None], x) <= 1e-2
    acc = torch.randint(-20000, 20000, (37, 64), generator=g, dtype=torch.int32)
    col = torch.rand(64, generator=g) * 1e-3
    for silu in (False, True):
        out = ops.dequantize_rows(acc, scale_ref, col, silu, dtype, kernels=True)
        ref = ops.dequantize_rows(acc, scale_ref, col, silu, torch.float32, kernels=False)
        assert out.dtype == dtype and out.shape == (37, 32 if silu else 64)
        assert rel(out, ref) <= TOL[dtype]


def test_w8a8_linear_quantizes_activations_of_large_iterations_only():
    g = torch.Generator().manual_seed(22)
    # 80 input channels: no AMX copy (multiples of 32 only), which would take every size.
    w = (torch.randn(128, 80, generator=g) * 0.1).to(torch.bfloat16)
    lin = Linear(w, "w8a8", quantize_activations=True, kernels=True)
    plain = Linear(w, "w8a8", kernels=True)  # int8 weight-only for tiny iterations, else bfloat16
    q, scale = quantize_int8(w)
    dequantized = q.float() * scale.float()[:, None]
    assert lin.w8a8_min_rows == (W8A8_VNNI_MIN_ROWS if lin.vnni_w8a8 is not None
                                 else W8A8_MIN_ROWS)
    for rows in (1, QUANTIZED_MAX_ROWS["w8a8"] + 1, lin.w8a8_min_rows - 1, lin.w8a8_min_rows,
                 300):
        x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
        exact = torch.nn.functional.linear(x.float(), w.float())
        assert rel(lin(x), exact) <= 2e-2 and rel(plain(x), exact) <= 2e-2
        # Which path served: int8 x int8 equals the dequantized product of the quantized rows.
        xq, xs = ops.quantize_rows(x, kernels=False)
        both = torch.nn.functional.linear(xq.float() * xs[:, None], dequantized)
        # (Not where torch._int_mm has no int8 instructions: activations stay bfloat16 there.)
        quantized = rows >= lin.w8a8_min_rows and ops.int8_matmul_fast()
        assert (rel(lin(x), both) <= 4e-3) == lin.uses_w8a8(rows) == quantized
    x = torch.randn(64, 80, generator=g).to(torch.bfloat16)
    gate, up = torch.nn.functional.linear(x.float(), w.float()).chunk(2, dim=-1)
    assert rel(lin.silu_and_mul(x), torch.nn.functional.silu(gate) * up) <= 3e-2
    if ops.amx_available():  # AMX bfloat16 tiles beat int8 x int8 there: never quantized
        amx = Linear(torch.randn(128, 96, generator=g).to(torch.bfloat16), "w8a8",
                     quantize_activations=True, kernels=True)
        assert amx.amx and not amx.uses_w8a8(4096)


@pytest.mark.skipif(not ops.vnni_linear_available() or ops.amx_available(),
                    reason="the kernels were built without AVX512_BF16 and VNNI, or AMX serves")
@pytest.mark.parametrize("out_features,in_features,swiglu", [(96, 128, True), (960, 576, False),
                                                             (64, 1536, False)])
def test_vnni_linear_gives_the_values_of_int_mm_and_dequantize_rows(out_features, in_features,
                                                                    swiglu):
    """W8A8's fused kernel (shoal::vnni_linear) against torch._int_mm and dequantize_rows on the
    same int8 operands: the same int32 sums, so the same bfloat16 outputs, bar SwiGLU's product
    (a reciprocal where dequantize_rows divides) one unit in the last place on a few elements.
    Rows cover tile tails and several passes over the weights."""
    g = torch.Generator().manual_seed(24)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(torch.bfloat16)
    lin = Linear(w, "w8a8", quantize_activations=True, kernels=True, swiglu=swiglu)
    assert lin.vnni_w8a8 is not None
    for rows in (16, 37, 300, 1100):
        x = (torch.randn(rows, in_features, generator=g) * 3).to(torch.bfloat16)
        q, row_scale = ops.quantize_rows(x, kernels=True)
        acc = torch._int_mm(q, lin.w8a8[0])
        for silu in (False, True) if swiglu else (False,):
            ref = ops.dequantize_rows(acc, row_scale, lin.w8a8[1], silu, torch.bfloat16, True)
            out = lin._w8a8(x, silu)
            assert out.shape == ref.shape and out.dtype == torch.bfloat16
            if not silu:
                assert torch.equal(out, ref)
            else:
                ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
                assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3
    packed, _, col_sum = lin.vnni_w8a8  # the packed copy is what serves: zero weights, zero out
    packed.zero_()
    col_sum.zero_()
    assert lin._w8a8(x, False).abs().max() == 0
    # The kernel writes bfloat16: float32 serving keeps torch._int_mm and its own dtype.
    lin32 = Linear(w.float(), "w8a8", quantize_activations=True, kernels=True, swiglu=swiglu)
    assert lin32.vnni_w8a8 is None and lin32._w8a8(x.float(), False).dtype == torch.float32


@pytest.mark.skipif(not ops.int8_gemv_available(),
                    reason="the kernels were built without VNNI, or with AVX-512 but no VNNI")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
def test_int8_gemv_is_int8_activations_times_int8_weights(dtype, rows):
    g = torch.Generator().manual_seed(23 + rows)
    w = (torch.randn(200, 128, generator=g) * 0.1).to(torch.bfloat16)
    q, scale = quantize_int8(w)
    x = (torch.randn(rows, 128, generator=g) * 3).to(dtype)
    y = torch.ops.shoal.int8_gemv(x, q, scale.float(), q.sum(dim=1, dtype=torch.int32))
    xq, xs = ops.quantize_rows(x, kernels=False)
    ref = torch.nn.functional.linear(xq.float() * xs[:, None], q.float() * scale.float()[:, None])
    assert y.dtype == dtype and y.shape == (rows, 200)
    assert rel(y, ref) <= TOL[dtype]
    # In float32 the kernel's result is exact, which tells it from the plain weight's.
    w32 = w.float()
    q, scale = quantize_int8(w32)
    lin = Linear(w32, "int8", int8_gemv=True, kernels=True)
    assert lin.vnni and lin.max_quantized_rows >= 4
    xq, xs = ops.quantize_rows(x.float(), kernels=False)
    ref = torch.nn.functional.linear(xq.float() * xs[:, None], q * scale[:, None])
    assert (rel(lin(x.float()), ref) <= 1e-5) == (rows <= lin.max_quantized_rows)


@pytest.mark.skipif(not ops.dp_linear_available() or ops.amx_available(),
                    reason="needs AVX512_BF16 without AMX")
def test_the_lm_head_leaves_dp_linear_earlier():
    """The LM head's dp_linear cap (LM_HEAD_DP_MAX_ROWS) is its own: larger iterations take
    oneDNN's prepacked copy, while projections keep dp_linear up to DP_MAX_ROWS."""
    g = torch.Generator().manual_seed(40)
    w = (torch.randn(128, 64, generator=g) * 0.1).to(torch.bfloat16)
    head = Linear(w, kernels=True, dp_max_rows=LM_HEAD_DP_MAX_ROWS)
    assert head.pairs_max_rows == LM_HEAD_DP_MAX_ROWS < DP_MAX_ROWS
    head.pairs = torch.zeros_like(head.pairs)  # dp_linear's iterations now come out zero
    x = torch.randn(LM_HEAD_DP_MAX_ROWS + 1, 64, generator=g).to(torch.bfloat16)
    assert (head(x[:-1]) == 0).all()
    assert rel(head(x), torch.nn.functional.linear(x.float(), w.float())) <= 5e-3


def _dequantized_int4(w: torch.Tensor) -> torch.Tensor:
    """What int4_linear multiplies by: the levels times float16-rounded scales, plus minimums."""
    q, scale, lo = int4_levels(w, 32)
    blocks = q.float().reshape(w.shape[0], -1, 32)
    scale, lo = scale.half().float()[..., None], lo.half().float()[..., None]
    return (blocks * scale + lo).reshape(w.shape)


@pytest.mark.skipif(not ops.lanes_linear_available(), reason="the kernels were built without AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11])
def test_lanes_kernels_equal_the_dequantized_weights_matmul(dtype, rows):
    """int8_linear, int4_linear and f32_linear against float32 matmuls with the dequantized (or
    float32) weights, on row counts that leave partial tiles of 4 rows; out_features 96 leaves
    an odd number of 16-lane groups per thread."""
    g = torch.Generator().manual_seed(40 + rows)
    w = torch.randn(96, 160, generator=g) * 0.1
    x = (torch.randn(rows, 160, generator=g) * 2).to(dtype)
    q, scale = quantize_int8(w)
    y8 = torch.ops.shoal.int8_linear(x, pack_lanes(q), scale)
    ref8 = torch.nn.functional.linear(x.float(), q.float() * scale[:, None])
    y4 = torch.ops.shoal.int4_linear(x, *pack_int4_lanes(w))
    ref4 = torch.nn.functional.linear(x.float(), _dequantized_int4(w))
    y32 = torch.ops.shoal.f32_linear(x, pack_lanes(w))
    ref32 = torch.nn.functional.linear(x.double(), w.double())
    for y, ref in ((y8, ref8), (y4, ref4), (y32, ref32)):
        assert y.dtype == dtype and y.shape == (rows, 96)
        assert rel(y, ref) <= TOL[dtype]
    assert rel(ref4, torch.nn.functional.linear(x.float(), w)) > 1e-2  # 4 bits are not exact
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.shoal.int8_linear(x[:, :100].contiguous(), pack_lanes(q), scale)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.shoal.f32_linear(x, pack_lanes(q))
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_int4_lanes(w[:80])


@pytest.mark.skipif(not ops.int4_q8_available(),
                    reason="the kernels were built without AVX2, or with AVX-512 but no VNNI")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11, 133])
def test_int4_q8_linear_equals_its_block_quantized_product(rows):
    """int4_q8_linear against the same arithmetic in float64: each row quantized to int8 per
    block of 32 inputs (scale max |x| / 127), times the int4 levels, scaled per block, plus each
    block's minimum times the block's exact sum; rows that leave partial tiles of 4 (and of 8,
    with VNNI), and blocks of zeros (a zero scale). Each row comes out bit for bit as when it
    is alone (with VNNI, iterations of more than 4 rows take the 16-channel form)."""
    g = torch.Generator().manual_seed(60 + rows)
    w = torch.randn(96, 160, generator=g) * 0.1
    x = torch.randn(rows, 160, generator=g) * 2
    x[0, 32:64] = 0.0
    q, scale, lo = int4_levels(w, 32)
    scale, lo = scale.half().double(), lo.half().double()
    blocks = x.double().reshape(rows, 5, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    x8 = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    ref = (torch.einsum("rbk,nbk->rn", x8 * d, q.double().reshape(96, 5, 32) * scale[..., None])
           + torch.einsum("rb,nb->rn", blocks.sum(-1), lo))
    assert x8.abs().max() == 127  # the scale uses the whole int8 range
    packed = pack_int4_quads(w)
    y = torch.ops.shoal.int4_q8_linear(x, *packed)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert rel(y.double(), ref) <= 1e-6
    alone = torch.cat([torch.ops.shoal.int4_q8_linear(x[i : i + 1], *packed) for i in range(rows)])
    assert torch.equal(y, alone)
    xb = x.bfloat16()  # bfloat16 serving: the same product of the widened rows, rounded
    assert torch.equal(torch.ops.shoal.int4_q8_linear(xb, *packed),
                       torch.ops.shoal.int4_q8_linear(xb.float(), *packed).bfloat16())
    # int8 activations err by about 1% against float ones on Gaussian rows: not exact, not far
    exact_x = torch.nn.functional.linear(x.double(), _dequantized_int4(w).double())
    assert 1e-4 < rel(y.double(), exact_x) < 3e-2
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_int4_quads(w[:92])


@pytest.mark.skipif(not ops.lanes_linear_available(), reason="the kernels were built without AVX-512 or AVX2")
def test_unquantized_float32_linear_takes_f32_linear_up_to_its_rows_then_onednn():
    """Without levels, float32 iterations of up to LANES_MAX_ROWS["none"] rows (AVX2:
    F32_LANES_AVX2_MAX_ROWS, where f32_linear's tiles beat oneDNN that far) run f32_linear, to
    the bit, and larger ones oneDNN's prepacked copy: the rows the levels take on the same CPU,
    so an engine with them and one without give the same bits (tests/test_fast_paths.py)."""
    g = torch.Generator().manual_seed(45)
    w = torch.randn(64, 1536, generator=g) * 0.1  # oneDNN splits K this long: other bits
    lin = Linear(w, kernels=True)
    max_rows = LANES_MAX_ROWS["none"] if ops.lanes_avx512() else F32_LANES_AVX2_MAX_ROWS
    assert lin.lanes_op == torch.ops.shoal.f32_linear and lin.lanes_max_rows == max_rows
    assert lin.lanes_max_rows == Q4_LANES_MAX_ROWS["avx2"] or ops.lanes_avx512()
    for rows in (max_rows, max_rows + 1):
        x = torch.randn(rows, 1536, generator=g)
        lanes = torch.ops.shoal.f32_linear(x, pack_lanes(w))
        assert rel(lanes, torch.nn.functional.linear(x, w)) <= 1e-5
        assert torch.equal(lin(x), lanes) == (rows <= max_rows), rows
        if rows > max_rows and lin.packed is not None:
            onednn = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [None], "")
            assert torch.equal(lin(x), onednn)


@pytest.mark.skipif(not ops.lanes_linear_available(), reason="the kernels were built without AVX-512 or AVX2")
@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_float32_quantized_linear_takes_the_lanes_kernels_for_few_rows(quantization):
    """float32 weights under --quantization: up to LANES_MAX_ROWS rows through the lanes
    kernels (equal to the dequantized weights' product), more through the float32 weight."""
    g = torch.Generator().manual_seed(44)
    w = torch.randn(128, 96, generator=g) * 0.1
    lin = Linear(w, quantization, kernels=True)
    q8 = quantization == "int4" and ops.int4_q8_available()  # int8 activations, every size
    assert lin.lanes is not None
    assert lin.lanes_max_rows == (INT4_Q8_MAX_ROWS if q8 else LANES_MAX_ROWS[quantization])
    if quantization == "int4":
        dequantized = _dequantized_int4(w)
    else:
        q, scale = quantize_int8(w)
        dequantized = q.float() * scale[:, None]
    for rows in (1, LANES_MAX_ROWS[quantization], LANES_MAX_ROWS[quantization] + 1, 300):
        x = torch.randn(rows, 96, generator=g)
        on_lanes = rel(lin(x), torch.nn.functional.linear(x, dequantized)) <= 1e-5
        if q8:  # (int4_q8_linear is tested above)
            on_lanes = torch.equal(lin(x), torch.ops.shoal.int4_q8_linear(x, *pack_int4_quads(w)))
        exact = rel(lin(x), torch.nn.functional.linear(x, w)) <= 1e-5
        assert (on_lanes, exact) == ((True, False) if rows <= lin.lanes_max_rows else (False, True))
    bf16 = Linear(w.to(torch.bfloat16), quantization, kernels=True)
    if q8 and not ops.amx_available():  # int4 x int8 serves bfloat16 too, at every size
        assert bf16.lanes_max_rows == INT4_Q8_MAX_ROWS and bf16.pairs is None
        x = torch.randn(300, 96, generator=g).bfloat16()
        packed = pack_int4_quads(w.to(torch.bfloat16))
        assert torch.equal(bf16(x), torch.ops.shoal.int4_q8_linear(x, *packed))
    else:
        assert bf16.lanes is None
