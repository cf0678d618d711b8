"""Llama weights from a GGUF file: dequantised to torch tensors under HF checkpoint names.

The `gguf` package memory-maps the file; F32 tensors asked for in float32 stay views of that (copy-on-write)
mapping. Q8_0, Q4_0, Q4_1, F16 and BF16 are dequantised here, vectorised in numpy; any other type goes through
`gguf.quants.dequantize` (numpy). llama.cpp's converter permutes the rows of q_proj and k_proj so that its rotary
pairs adjacent elements; we undo that so HF-style rotary (rotate_half over the two halves of a head) applies.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.llama_config import LlamaConfig
from models.tokenizer import ChatTokenizer

# blk.N.<GGUF part>.weight -> model.layers.N.<HF part>.weight
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")

# bytes per block and weights per block of the types dequantised here
_BLOCK = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32)}


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor name; ValueError for tensors a Llama model does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported Llama model")


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
    """LlamaConfig from `llama.*` and `tokenizer.ggml.*` metadata; tied embeddings when there is no `output`."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    rot = meta.get("llama.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError("GGUF partial rotary (rope.dimension_count != head dim) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(meta["llama.vocab_size"])
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_decimal(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_decimal(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        tie_word_embeddings=not has_output_tensor,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(eos)),
    )


def _decimal(value: float) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal that float32
    value stands for (1e-05), the number the model's authors wrote."""
    return float(str(np.float32(value)))


def matrix_types(path: Path) -> set[str]:
    """The GGUF types of the file's matrices (e.g. {"Q4_1", "Q8_0"}), read from its header."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(path, "r").tensors if len(t.shape) == 2}


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
    return meta


def header_from_metadata(meta: dict[str, Any]) -> tuple[LlamaConfig, ChatTokenizer]:
    return (config_from_gguf_metadata(meta, has_output_tensor=bool(meta["appliance.has_output_tensor"])),
            ChatTokenizer.from_gguf_metadata(meta))


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, quantized: str | None = None
              ) -> tuple[LlamaConfig, dict[str, Any], ChatTokenizer, dict[str, Any]]:
    """(config, HF-named tensors, tokenizer, header metadata) of a Llama GGUF file. Without `quantized` every tensor is dequantised
    to `dtype`; with "int8" / "int4" every matrix stays quantized (models/quant.py: Q8_0 / Q4_x blocks are
    requantized a row chunk at a time, float matrices quantized) and only norms are floats."""
    import gguf

    # "c": copy-on-write map, so the arrays are writable (torch wants that) while the file stays untouched.
    reader = gguf.GGUFReader(path, "c")
    meta = header_metadata(reader)
    config, tokenizer = header_from_metadata(meta)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        if quantized and len(shape) == 2:
            tensors[name] = _quantized_matrix(t.data, t.tensor_type.name, shape, quantized, name, config)
            continue
        w = dequantize(t.data, t.tensor_type.name, shape)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary_rows(w, config.num_key_value_heads)
        tensors[name] = w if w.dtype == dtype else w.to(dtype)
    return config, tensors, tokenizer, meta


def _rotary_row_order(name: str, config: LlamaConfig) -> torch.Tensor | None:
    """Row index that undoes llama.cpp's q/k permutation (None for other matrices)."""
    heads = (config.num_attention_heads if name.endswith("q_proj.weight")
             else config.num_key_value_heads if name.endswith("k_proj.weight") else None)
    if heads is None:
        return None
    rows = heads * config.head_dim
    return unpermute_rotary_rows(torch.arange(rows), heads)


def _quantized_matrix(raw: np.ndarray, type_name: str, shape: tuple[int, int], fmt: str, name: str,
                      config: LlamaConfig):
    from models import quant

    if name in quant.HEAD_NAMES:  # bfloat16, a row chunk at a time (see quant.HEAD_NAMES)
        rows = np.asarray(raw).reshape(shape[0], -1)
        return torch.cat([dequantize(rows[i:i + quant.ROW_CHUNK], type_name, (min(quant.ROW_CHUNK, shape[0] - i),
                                                                                shape[1])).to(torch.bfloat16)
                          for i in range(0, shape[0], quant.ROW_CHUNK)])
    if type_name in _BLOCK:
        m = quant.from_gguf_blocks(raw, type_name, shape, fmt, _dequantize_blocks)
    else:
        m = quant.quantize(dequantize(raw, type_name, shape), fmt)
    order = _rotary_row_order(name, config)
    return m if order is None else quant.permute_rows(m, order)
