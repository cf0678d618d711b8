"""Llama-family weights from a GGUF file (architectures llama, qwen2, qwen3, phi3: models/llama_config.py):
dequantised to torch tensors under HF checkpoint names, or kept quantized (models/quant.py).

The `gguf` package memory-maps the file; F32 tensors asked for in float32 stay views of that (copy-on-write)
mapping. Q8_0, Q4_0, Q4_1, F16 and BF16 are dequantised here, vectorised in numpy; any other type goes through
`gguf.quants.dequantize` (numpy). llama.cpp's converter permutes the rows of q_proj and k_proj of `llama` models
so that its rotary pairs adjacent elements; we undo that so HF-style rotary (rotate_half over the two halves of a
head) applies (qwen2, qwen3 and phi3 are converted unpermuted: llama.cpp runs them with NEOX-style rotary).
Rotary scaling stored as tensors (a Llama 3 file's `rope_freqs`, Phi-3's `rope_factors_long/short`) is read with
the header into the config, not into the model's tensors.
"""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.llama_config import ARCHITECTURES, LlamaConfig
from models.tokenizer import ChatTokenizer

# blk.N.<GGUF part>.<weight|bias> -> model.layers.N.<HF part>.<weight|bias>
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_FUSED_LAYER_NAMES = {"ffn_up": "mlp.gate_up_proj"}  # phi3: ffn_up holds gate and up, in HF's order
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Rotary scaling stored as tensors: read with the header (key in the header metadata we keep), not model weights.
ROPE_TENSORS = {"rope_freqs.weight": "appliance.rope_freqs", "rope_factors_long.weight": "appliance.rope_long",
                "rope_factors_short.weight": "appliance.rope_short"}

# bytes per block and weights per block of the types dequantised here
_BLOCK = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32)}


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The HF checkpoint name of a GGUF tensor name; ValueError for tensors the model does not have (the loader
    then checks every name against the architecture's list: models/llama_config.py tensor_shapes)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        part = _FUSED_LAYER_NAMES.get(m.group(2)) if architecture == "phi3" else None
        return f"model.layers.{m.group(1)}.{part or _LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported {architecture} model")


def permute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF half-split rotary -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rotary_rows`: GGUF q/k rows back to HF order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 weights of one GGUF tensor. `raw` is the reader's array (bytes for block types), `shape` the
    torch (row-major) shape. numpy, single-threaded: torch's elementwise ops on many mid-sized tensors were 30x
    slower on a shared 2-core machine (thread contention), numpy's as fast as torch on one thread."""
    if type_name == "F32":
        return _as_tensor(np.asarray(raw).reshape(-1).view(np.float32)).reshape(shape)  # a view of the map
    if type_name in ("F16", "BF16"):
        bits = _as_tensor(np.asarray(raw).reshape(-1).view(np.uint8))
        return bits.view(torch.float16 if type_name == "F16" else torch.bfloat16).reshape(shape).float()
    if type_name in _BLOCK:
        return torch.from_numpy(_dequantize_blocks(np.asarray(raw), type_name)).reshape(shape)
    # other types (K-quants, ...): the gguf package's numpy reference implementation
    import gguf

    out = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def _dequantize_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """(n_blocks, 32) float32 weights of Q8_0 / Q4_0 / Q4_1 blocks."""
    block_bytes, per_block = _BLOCK[type_name]
    blocks = raw.reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # (n_blocks, 1) scale
    out = np.empty((blocks.shape[0], per_block), np.float32)
    if type_name == "Q8_0":
        out[:] = blocks[:, 2:].view(np.int8)
        out *= d
        return out
    packed = blocks[:, 2:18] if type_name == "Q4_0" else blocks[:, 4:20]
    out[:, :16] = packed & 0x0F  # low nibbles are elements 0..15 of the block
    out[:, 16:] = packed >> 4  # high nibbles 16..31
    if type_name == "Q4_0":
        out -= 8.0
        out *= d
    else:
        out *= d
        out += blocks[:, 2:4].view(np.float16).astype(np.float32)  # the block minimum m
    return out


def _as_tensor(flat: np.ndarray) -> torch.Tensor:
    """A torch view of a reader array (no copy)."""
    with warnings.catch_warnings():  # a read-only map would warn; we never write to these tensors
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat)


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def config_from_gguf_metadata(meta: dict[str, Any], has_output_tensor: bool) -> LlamaConfig:
    """LlamaConfig from `<arch>.*` and `tokenizer.ggml.*` metadata (and the rotary tensors header_metadata read);
    tied embeddings when there is no `output` tensor."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length") or hidden // heads)
    rot = key("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError("GGUF partial rotary (rope.dimension_count != head dim) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(key("vocab_size"))
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    context = int(key("context_length", 2048))
    sliding = key("attention.sliding_window") if arch == "phi3" else None
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_decimal(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_decimal(key("rope.freq_base", 10000.0)),
        # a sliding window the context never exceeds changes nothing (see LlamaConfig.from_hf_dict)
        max_position_embeddings=min(context, int(sliding)) if sliding else context,
        tie_word_embeddings=not has_output_tensor,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(eos)),
        architecture=arch,
        rope_scaling=_gguf_rope_scaling(meta, arch, head_dim, context),
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str, head_dim: int, context: int) -> dict[str, Any] | None:
    """Rotary scaling as llama.cpp's converter writes it: `<arch>.rope.scaling.*` keys, a Llama 3 file's
    per-frequency divisors (rope_freqs), Phi-3's longrope factors (rope_factors_long / _short)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    freqs = meta.get(ROPE_TENSORS["rope_freqs.weight"])
    long, short = meta.get(ROPE_TENSORS["rope_factors_long.weight"]), meta.get(ROPE_TENSORS["rope_factors_short.weight"])
    for name, values in (("rope_freqs", freqs), ("rope_factors_long", long), ("rope_factors_short", short)):
        if values is not None and len(values) != head_dim // 2:
            raise ValueError(f"GGUF tensor {name}.weight has {len(values)} values; a head of {head_dim} needs "
                             f"{head_dim // 2}")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
    if kind == "linear":
        if freqs is not None or long is not None:
            raise ValueError("GGUF rope scaling: linear together with rope factor tensors is not supported")
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if freqs is not None:
        return {"rope_type": "freq_factors", "freq_factors": [float(x) for x in freqs]}
    if long is not None or short is not None:
        if long is None or short is None:
            raise ValueError("GGUF rope scaling: rope_factors_long and rope_factors_short come together")
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or context)
        attention_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attention_factor is None:  # what the converter writes (and transformers computes) for longrope
            scale = context / original
            attention_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        return {"rope_type": "longrope", "long_factor": [float(x) for x in long],
                "short_factor": [float(x) for x in short], "original_max_position_embeddings": original,
                "attention_factor": _decimal(attention_factor)}
    return None


def _decimal(value: float) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal that float32
    value stands for (1e-05), the number the model's authors wrote."""
    return float(str(np.float32(value)))


def matrix_types(path: Path) -> set[str]:
    """The GGUF types of the file's matrices (e.g. {"Q4_1", "Q8_0"}), read from its header."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(path, "r").tensors if len(t.shape) == 2}


def matrix_types_by_name(path: Path) -> dict[str, str]:
    """Each matrix's GGUF type by its GGUF name (e.g. {"blk.0.attn_q.weight": "Q4_K", ...}), from the header."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path, "r").tensors if len(t.shape) == 2}


def gguf_header(path: Path) -> tuple[LlamaConfig, ChatTokenizer]:
    """The config and tokenizer of a GGUF file, without touching its tensors' data."""
    import gguf

    return _header(gguf.GGUFReader(path, "r"))


def _header(reader) -> tuple[LlamaConfig, ChatTokenizer]:
    return header_from_metadata(header_metadata(reader))


def gguf_metadata(path: Path) -> dict[str, Any]:
    import gguf

    return header_metadata(gguf.GGUFReader(path, "r"))


def header_metadata(reader) -> dict[str, Any]:
    """What the config and tokenizer are made from: the file's metadata (plain values, JSON-safe) and whether it
    has an output tensor. Reading it is most of a GGUF header's cost (SmolLM2: ~3-5 s for its 49,152 vocabulary
    strings and merges), so the weight cache keeps a copy."""
    meta = read_metadata(reader)
    meta["appliance.has_output_tensor"] = any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:  # rotary scaling factors: a few floats each, part of the config
        if t.name in ROPE_TENSORS:
            meta[ROPE_TENSORS[t.name]] = dequantize(t.data, t.tensor_type.name, (int(t.n_elements),)).tolist()
    return meta


def header_from_metadata(meta: dict[str, Any]) -> tuple[LlamaConfig, ChatTokenizer]:
    return (config_from_gguf_metadata(meta, has_output_tensor=bool(meta["appliance.has_output_tensor"])),
            ChatTokenizer.from_gguf_metadata(meta))


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, quantized: str | None = None
              ) -> tuple[LlamaConfig, dict[str, Any], ChatTokenizer, dict[str, Any]]:
    """(config, HF-named tensors, tokenizer, header metadata) of a Llama GGUF file. Without `quantized` every tensor is dequantised
    to `dtype`; with a quantized format (models/quant.py's FORMATS: blocks, int8, int4) every matrix stays in GGUF
    blocks (the file's own where the format keeps them, see _quantized_matrix) and only norms are floats."""
    import gguf

    # "c": copy-on-write map, so the arrays are writable (torch wants that) while the file stays untouched.
    reader = gguf.GGUFReader(path, "c")
    meta = header_metadata(reader)
    config, tokenizer = header_from_metadata(meta)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:  # read into the config with the header
            continue
        name = hf_name(t.name, config.architecture)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        if quantized and len(shape) == 2:
            tensors[name] = _quantized_matrix(t.data, t.tensor_type.name, shape, quantized, name, config)
            continue
        w = dequantize(t.data, t.tensor_type.name, shape)
        order = _rotary_row_order(name, config)
        if order is not None:
            w = w[order]
        tensors[name] = w if w.dtype == dtype else w.to(dtype)
    return config, tensors, tokenizer, meta


def _rotary_row_order(name: str, config: LlamaConfig) -> torch.Tensor | None:
    """Row index that undoes llama.cpp's q/k permutation (None for other matrices, and for architectures the
    converter does not permute)."""
    if config.architecture != "llama" or not name.endswith(".weight"):
        return None
    heads = (config.num_attention_heads if name.endswith("q_proj.weight")
             else config.num_key_value_heads if name.endswith("k_proj.weight") else None)
    if heads is None:
        return None
    rows = heads * config.head_dim
    return unpermute_rotary_rows(torch.arange(rows), heads)


def _quantized_matrix(raw: np.ndarray, type_name: str, shape: tuple[int, int], fmt: str, name: str,
                      config: LlamaConfig):
    """A matrix kept quantized (models/quant.py): the file's own blocks where `fmt` keeps its type, else
    dequantised a row chunk at a time and quantized by gguf's quantizer. The embeddings and the output matrix keep
    the file's block type whatever fmt is (a float one becomes Q8_0). llama's q/k rows are un-permuted on the raw
    rows first."""
    from models import quant

    def decode(rows: np.ndarray, type_name: str) -> np.ndarray:
        return dequantize(rows, type_name, (rows.shape[0], shape[1])).numpy()

    if name in quant.HEAD_NAMES:
        fmt = "blocks" if type_name in quant.BLOCK_TYPES else "int8"
    order = _rotary_row_order(name, config)
    return quant.from_gguf_blocks(raw, type_name, shape, fmt, decode, None if order is None else order.numpy())
