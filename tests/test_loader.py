"""Model loading: GGUF quantization types, Hugging Face directories, clear errors."""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch

from shoal.messages import IterationPlan, NewRequest
from shoal.model_files import ModelNotFoundError, resolve_model_path
from shoal.sampling_params import SamplingParams
from tests.conftest import random_weights, tiny_config
from worker import loader
from worker.config import EngineConfig
from worker.engine import Engine
from worker.linear import q4_weight
from worker.loader import (
    Q4_LEVELS,
    Q4_SCALE_MIN,
    UnsupportedModelError,
    load_model,
    read_model_config,
)

Q = gguf.GGMLQuantizationType
CFG = tiny_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=64)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The tiny files written here get their weights cache entries under tmp_path."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))


def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def _write_gguf(path, weights, qtype, arch="llama", k_quant_tensor=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG.num_layers)
    w.add_context_length(CFG.max_position_embeddings)
    w.add_embedding_length(CFG.hidden_size)
    w.add_feed_forward_length(CFG.intermediate_size)
    w.add_head_count(CFG.num_heads)
    w.add_head_count_kv(CFG.num_kv_heads)
    w.add_rope_freq_base(CFG.rope_theta)
    w.add_layer_norm_rms_eps(CFG.rms_norm_eps)
    w.add_vocab_size(CFG.vocab_size)
    w.add_eos_token_id(1)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in weights.items():
        arr = t.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            key = rest.removesuffix(".weight")
            gname = f"blk.{i}.{layer[key]}.weight"
            if key == "self_attn.q_proj":
                arr = _permute_like_llama_cpp(arr, CFG.num_heads)
            elif key == "self_attn.k_proj":
                arr = _permute_like_llama_cpp(arr, CFG.num_kv_heads)
        else:
            gname = names[name]
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    if k_quant_tensor is not None:
        w.add_tensor("blk.0.extra_k.weight", k_quant_tensor[1], raw_dtype=k_quant_tensor[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype,tol", [(Q.F32, 1e-7), (Q.F16, 2e-3), (Q.Q8_0, 1e-2), (Q.Q4_0, 0.2),
                                       (Q.Q4_1, 0.2)])
def test_gguf_quant_types_load_and_unpermute(tmp_path, qtype, tol):
    weights = random_weights(CFG, seed=3)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, weights, qtype)
    cfg, loaded = load_model(path, torch.float32)
    assert cfg.rms_norm_eps == pytest.approx(CFG.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(cfg, rms_norm_eps=CFG.rms_norm_eps) == CFG
    for name, t in weights.items():
        err = ((loaded[name] - t).norm() / t.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.3g} for {qtype.name}"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_gguf_4_bit_projections_come_with_levels_that_give_them_back(tmp_path, qtype):
    """Q4_0 and Q4_1 projections carry their levels and scales, rows unpermuted with the weight's
    (Q and K) and sharded with it (a tensor-parallel rank's columns), which give back the loaded
    weight bit for bit in float32 and bfloat16 (Q4_0's negative zeros included); the embedding
    and other types carry none."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, random_weights(CFG, seed=4), qtype)
    for dtype in (torch.float32, torch.bfloat16):  # the second load reads the weights cache
        _, loaded = load_model(path, dtype)
        projections = [n for n in loaded if n.endswith("_proj.weight")]
        assert len(projections) == 7 * CFG.num_layers
        for name in projections:
            prefix = name.removesuffix(".weight")
            levels, scale_min = loaded[prefix + Q4_LEVELS], loaded[prefix + Q4_SCALE_MIN]
            assert levels.dtype == torch.uint8 and levels.shape == loaded[name].shape
            assert scale_min.dtype == torch.float16
            assert levels.max() == 15 and levels.min() == 0
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(q4_weight(levels, scale_min, dtype).view(bits),
                               loaded[name].view(bits)), name
        assert sum(n.endswith(Q4_LEVELS) for n in loaded) == len(projections)
    # Rank 1 of 2, as worker.parallel splits: the second half of every projection's inputs.
    _, sharded = load_model(path, torch.float32, shard=lambda name, w: (
        w.chunk(2, dim=1)[1].contiguous() if name.endswith("_proj.weight") else w))
    for name in (n for n in sharded if n.endswith("_proj.weight")):
        prefix = name.removesuffix(".weight")
        assert sharded[name].shape[1] == CFG.hidden_size // 2 or "down" in name
        assert torch.equal(q4_weight(sharded[prefix + Q4_LEVELS], sharded[prefix + Q4_SCALE_MIN],
                                     torch.float32), sharded[name]), name
    _write_gguf(path, random_weights(CFG, seed=4), Q.Q8_0)
    _, loaded = load_model(path, torch.float32)
    assert not any(n.endswith(Q4_LEVELS) for n in loaded)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K])
def test_gguf_k_quants_dequantize(tmp_path, qtype):
    """Random K-quant blocks (finite scales) load through the gguf library's dequantizer."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4, nbytes), dtype=np.uint8)
    # The float16 super-block scale(s) sit at the end (Q6_K) or start (Q4_K): make them small.
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:
        raw[:, -2:] = scale
    else:
        raw[:, 0:2] = scale
        raw[:, 2:4] = scale
    _write_gguf(tmp_path / "k.gguf", random_weights(CFG), Q.F32, k_quant_tensor=(qtype, raw))
    reader = gguf.GGUFReader(str(tmp_path / "k.gguf"))
    t = next(t for t in reader.tensors if t.name == "blk.0.extra_k.weight")
    expected = gguf.quants.dequantize(t.data, qtype)
    assert expected.shape == (4, block) and np.isfinite(expected).all() and np.abs(expected).max() > 0
    load_model(tmp_path / "k.gguf", torch.float32)  # an unknown extra tensor is skipped, not fatal


def test_gguf_is_read_once_then_loaded_from_its_weights_cache(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, random_weights(CFG, seed=5), Q.Q8_0)
    cfg, first = load_model(path, torch.float32)  # reads the GGUF file, writes the cache
    entries = list((tmp_path / "cache" / "weights").rglob("*.safetensors"))
    assert len(entries) == 1
    # A file of an older format in the entry is removed when the current one is written.
    old = entries[0].with_name("v0.safetensors")
    old.write_bytes(b"an older format")
    entries[0].unlink()
    load_model(path, torch.float32)
    assert list((tmp_path / "cache" / "weights").rglob("*.safetensors")) == entries

    def no_gguf(path):
        raise AssertionError("read the GGUF file again")

    with monkeypatch.context() as m:
        m.setattr(loader, "_read_gguf", no_gguf)
        assert read_model_config(path) == cfg
        cfg2, again = load_model(path, torch.float32)
        _, bf16 = load_model(path, torch.bfloat16)
    assert cfg2 == cfg and again.keys() == first.keys()
    for name, t in first.items():
        assert torch.equal(again[name], t) and torch.equal(bf16[name], t.to(torch.bfloat16))

    # Other weights in the same file name miss the old entry (size and modification time).
    other = random_weights(CFG, seed=6)
    _write_gguf(path, other, Q.F32)
    _, loaded = load_model(path, torch.float32)
    assert torch.equal(loaded["model.norm.weight"], other["model.norm.weight"])

    # A corrupt entry is rewritten; the load still gives the file's weights.
    entry = next(e for e in (tmp_path / "cache" / "weights").rglob("*.safetensors")
                 if e.parent != entries[0].parent)
    entry.write_bytes(b"not safetensors")
    _, loaded = load_model(path, torch.float32)
    assert torch.equal(loaded["model.norm.weight"], other["model.norm.weight"])
    assert entry.stat().st_size > 1000


def test_gguf_loads_where_the_cache_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("x")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "not-a-dir"))
    weights = random_weights(CFG, seed=7)
    _write_gguf(tmp_path / "tiny.gguf", weights, Q.F32)
    _, loaded = load_model(tmp_path / "tiny.gguf", torch.float32)
    assert all(torch.equal(loaded[n], t) for n, t in weights.items())


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, random_weights(CFG), Q.F32, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path, torch.float32)


def test_missing_and_wrong_files_are_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "nope.gguf")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a GGUF"):
        resolve_model_path(tmp_path / "model.bin")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="GGUF"):
        load_model(tmp_path / "bad.gguf", torch.float32)


def test_hf_directory_matches_transformers(tmp_path):
    """A random Llama saved by transformers: our engine's logits equal transformers' own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                         rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         eos_token_id=1)
    model = LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    cfg, weights = load_model(tmp_path, torch.float32)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 16)
    engine = Engine(cfg, weights, EngineConfig(dtype=torch.float32, kv_cache_bytes=1 << 20),
                    keep_logits=True)
    prompt = torch.randint(2, 96, (23,)).tolist()
    res = engine.step(IterationPlan(
        admit=[NewRequest("x", prompt, SamplingParams(max_tokens=4, temperature=0.0))]))
    ours = engine.last_logits["x"]
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt])).logits[0, -1]
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    assert res.outputs[0].token_id == int(theirs.argmax())


def test_hf_directory_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2"):
        load_model(tmp_path, torch.float32)


def test_transformers_oracle_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """`load_transformers_model` (the tests' oracle, the bench's baseline): transformers' own
    reading of the GGUF file, then its cached copy, the same logits either way."""
    from transformers import AutoModelForCausalLM

    from shoal.model_files import cache_entry, load_transformers_model

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, random_weights(CFG, seed=8), Q.Q8_0)
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = direct(ids).logits
        assert torch.equal(load_transformers_model(path, torch.float32)(ids).logits, expected)
        assert (cache_entry(path, "transformers") / "model.safetensors").is_file()
        real = AutoModelForCausalLM.from_pretrained

        def no_gguf(*args, **kw):
            assert "gguf_file" not in kw, "converted the GGUF file again"
            return real(*args, **kw)

        monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_gguf)
        assert torch.equal(load_transformers_model(path, torch.float32)(ids).logits, expected)
        cached = load_transformers_model(path, torch.bfloat16)
    assert cached.dtype == torch.bfloat16
    weights = direct.state_dict()
    assert all(torch.equal(t, weights[name].bfloat16()) for name, t in cached.state_dict().items())
