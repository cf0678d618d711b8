"""Tiny random models of each architecture the engine runs, built by transformers (the oracle), and written as a
GGUF file the way llama.cpp's convert_hf_to_gguf.py writes them, or saved as an HF safetensors directory.

    hf = hf_model("qwen3", vocab_size=320)             # transformers' own model, every weight random
    write_gguf(path, hf, tokenizer_meta)               # names, q/k permutation (llama only), fused phi3 matrices,
                                                       # rope_freqs / rope_factors_* tensors, per-architecture keys

The converter's conventions mirrored here: `blk.N.attn_q/k/v(.bias)`, `attn_q_norm`/`attn_k_norm` (qwen3),
`attn_qkv` and `ffn_up` holding gate and up (phi3), `output` absent when the embeddings are tied; llama q/k rows
permuted for llama.cpp's interleaved rotary (the others are stored as HF has them); a Llama 3 rope's per-frequency
divisors as `rope_freqs.weight`; Phi-3's longrope factors as `rope_factors_long/short.weight` with
`rope.scaling.original_context_length` and `rope.scaling.attn_factor`.
"""
from __future__ import annotations

import math

import gguf
import numpy as np
import torch
import transformers

from models.gguf_loader import permute_rotary_rows

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
PHI3_ORIGINAL = 256  # Phi-3's longrope: short factors up to this context, long ones beyond
VARIANTS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "phi3-longrope")


def hf_model(variant: str, vocab_size: int, seed: int = 0, tied: bool = False):
    """A transformers model of `variant` (one of VARIANTS) with every parameter random, norms and biases included
    (transformers initialises those to ones and zeros, which would hide a missing bias or norm)."""
    torch.manual_seed(seed)
    common = dict(SHAPE, vocab_size=vocab_size, max_position_embeddings=512, tie_word_embeddings=tied,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    if variant in ("llama", "llama3"):
        rope = LLAMA3_ROPE if variant == "llama3" else {"rope_type": "default", "rope_theta": 50000.0}
        if variant == "llama3":  # Llama 3.2: 131,072 positions, scaled from 8,192
            common["max_position_embeddings"] = 131072
        cfg = transformers.LlamaConfig(**common, rope_parameters=dict(rope))
        model = transformers.LlamaForCausalLM(cfg)
    elif variant == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = transformers.Qwen2ForCausalLM(cfg)
    elif variant == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32,  # not hidden / heads, as in Qwen3-0.6B
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = transformers.Qwen3ForCausalLM(cfg)
    elif variant in ("phi3", "phi3-longrope"):
        kw = dict(common)
        if variant == "phi3-longrope":
            half = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
            g = torch.Generator().manual_seed(seed + 7)
            kw.update(max_position_embeddings=4096, original_max_position_embeddings=PHI3_ORIGINAL,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist(),
                                       "short_factor": (1 + 0.5 * torch.rand(half, generator=g)).tolist()})
        else:
            kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw))
    else:
        raise ValueError(variant)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None  # compare full lengths; random weights stop at random
    return model.eval()


def architecture(variant: str) -> str:
    return {"llama3": "llama", "phi3-longrope": "phi3"}.get(variant, variant)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def gguf_tensor_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(path, hf, tokenizer_meta: dict, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               chat_template: str | None = None) -> None:
    """hf written as llama.cpp's converter writes it; matrices in qtype (F32: exact), vectors F32.
    tokenizer_meta: {"model": "gpt2" | "llama", "tokens", "types", "merges" | "scores", "pre", "bos", "eos"}."""
    cfg = hf.config
    arch = cfg.model_type
    rope = dict(cfg.rope_parameters)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    extra: dict[str, np.ndarray] = {}
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        extra["rope_freqs.weight"] = np.array(factors, np.float32)
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(0)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    t = tokenizer_meta
    w.add_tokenizer_model(t["model"])
    w.add_tokenizer_pre(t.get("pre", "default"))
    w.add_token_list(t["tokens"])
    w.add_token_types(t["types"])
    if "merges" in t:
        w.add_token_merges(t["merges"])
    if "scores" in t:
        w.add_token_scores(t["scores"])
    w.add_bos_token_id(t["bos"])
    w.add_eos_token_id(t["eos"])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, array in extra.items():
        w.add_tensor(name, array)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = p.detach().float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            x = permute_rotary_rows(x, heads)
        kind = qtype if x.dim() == 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(x.numpy(), kind) if kind != gguf.GGMLQuantizationType.F32 else x.numpy()
        w.add_tensor(gguf_tensor_name(name), data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- vocabularies as GGUF stores them ------------------------------------------------------------------------------
CORPUS = ["the pump moves water 12345 times", "a valve opens and the pump stops", "Temperature of reactor 2 is 73.5",
          "What is a centrifugal pump? It moves fluid by rotation."] * 20
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab(pre: str = "default") -> dict:
    """A byte-level BPE trained here (Qwen / Llama 3 style), as GGUF metadata: control tokens first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
            "types": [3] * len(CHATML_SPECIALS) + [1] * (len(tokens) - len(CHATML_SPECIALS)), "bos": 0, "eos": 2}


PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]


def sentencepiece_vocab() -> dict:
    """A SentencePiece-style vocabulary (Llama 2 / Phi-3 as llama.cpp converts it): <unk>, <s>, </s>, the 256
    <0xXX> byte tokens, pieces with "▁" for spaces scored by merge order, then Phi-3's control tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = [t for t, _ in sorted(json.loads(tok.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned + PHI3_SPECIALS
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned) + [3] * len(PHI3_SPECIALS)
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))] + [0.0] * len(PHI3_SPECIALS)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1,
            "eos": tokens.index("<|endoftext|>")}
