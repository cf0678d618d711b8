"""Load a Llama-family language model's weights, config and tokenizer from disk: an HF safetensors directory or
a GGUF file.

safetensors are memory-mapped: when the file's dtype is the one asked for, every tensor is a view of the map (the
page cache holds the weights, no private copy); another dtype costs one cast copy.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loader import weight_cache
from loader.file_digest import content_digest
from models import quant
from models.gguf_loader import gguf_metadata, header_from_metadata, load_gguf
from models.llama_config import LlamaConfig
from models.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedWeights:
    config: LlamaConfig
    tensors: dict  # HF checkpoint names -> tensor (or quant.BlockMatrix); no "lm_head.weight" when tied
    tokenizer: ChatTokenizer
    version: str  # 12 hex digits of the files' content digest (loader/file_digest.py)
    source_format: str  # "safetensors" | "gguf"


def load_weights(path: Path, dtype: torch.dtype = torch.float32, quantized: str | None = None,
                 cache_dir: Path | None = None) -> LoadedWeights:
    """A directory (config.json, *.safetensors [+ model.safetensors.index.json], tokenizer.json
    [+ tokenizer_config.json, chat_template.jinja, generation_config.json]) or a .gguf file.

    quantized (quant.FORMATS: "blocks" | "int8" | "int4"): every matrix is kept quantized in GGUF blocks
    (models/quant.py), norms in float32; with `cache_dir` the quantized tensors are cached there in the kernels'
    layout (loader/weight_cache.py), keyed by the files' full content digest (computed once, remembered in
    cache_dir while the files' size, mtime and inode agree), and a second load maps them read-only."""
    path = Path(path)
    if quantized is not None and quantized not in quant.FORMATS:
        raise ValueError(f"weights format {quantized!r} is not one of {', '.join(quant.FORMATS)}")
    if path.is_file() and path.suffix == ".gguf":
        digest = content_digest([path], cache_dir)
        version = digest[:12]
        cached = _cached(cache_dir, digest, quantized)
        if cached is not None:
            cache_file = weight_cache.cache_path(cache_dir, digest, quantized)
            meta = weight_cache.load_meta(cache_file)
            if meta is None:  # a cache written before the metadata was kept beside it
                meta = gguf_metadata(path)
                weight_cache.save_meta(cache_file, meta)
            config, tokenizer = header_from_metadata(meta)
            _check_tensors(config, cached)
            return LoadedWeights(config, cached, tokenizer, version, "gguf")
        config, tensors, tokenizer, meta = load_gguf(path, torch.float32 if quantized else dtype, quantized)
        _check_tensors(config, tensors)
        _store(cache_dir, digest, quantized, tensors, meta)
        return LoadedWeights(config, tensors, tokenizer, version, "gguf")
    if not path.is_dir():
        raise ValueError(f"model path {path.name!r} is neither a directory nor a .gguf file")
    loaded = _load_safetensors_dir(path, dtype, quantized, cache_dir)
    return loaded


def _cached(cache_dir: Path | None, digest: str, quantized: str | None) -> dict | None:
    if cache_dir is None or quantized is None:
        return None
    return weight_cache.load(weight_cache.cache_path(cache_dir, digest, quantized))


def _store(cache_dir: Path | None, digest: str, quantized: str | None, tensors: dict,
           meta: dict | None = None) -> None:
    if cache_dir is None or quantized is None:
        return
    try:
        weight_cache.save(weight_cache.cache_path(cache_dir, digest, quantized), tensors, meta)
    except OSError as exc:  # a full or read-only disk costs the next start time, not this one its model
        log.warning("could not cache quantized weights in %s: %s", cache_dir, exc)


def _quantize_matrices(tensors: dict, quantized: str) -> dict:
    """Float matrices (an HF directory's) quantized a row chunk at a time from the file's map: int4 -> Q4_1,
    int8 and blocks -> Q8_0, the embeddings / lm_head Q8_0 (quant.HEAD_NAMES); a matrix whose inputs are not a
    multiple of 32 stays float."""
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or t.shape[1] % quant.GROUP:
            out[name] = t.float()
            continue
        out[name] = quant.quantize(t, "int4" if quantized == "int4" and name not in quant.HEAD_NAMES else "int8")
    return out


def _load_safetensors_dir(directory: Path, dtype: torch.dtype, quantized: str | None = None,
                          cache_dir: Path | None = None) -> LoadedWeights:
    hf = _read_json(directory / "config.json")
    if hf is None:
        raise ValueError("model directory has no config.json")
    config = LlamaConfig.from_hf_dict(hf)  # ValueError for a model_type or option it cannot run
    generation = _read_json(directory / "generation_config.json") or {}
    eos_ids = set(config.eos_token_ids) | set(_id_list(generation.get("eos_token_id")))
    if not (directory / "tokenizer.json").exists():
        raise ValueError("model directory has no tokenizer.json")
    tokenizer = ChatTokenizer.from_directory(directory, extra_eos_ids=eos_ids)
    config.eos_token_ids = sorted(tokenizer.eos_token_ids)  # one set of stop ids, wherever each was declared
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id

    files = _safetensors_files(directory)
    extras = [directory / n for n in ("config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", "chat_template.jinja",
                                      "model.safetensors.index.json") if (directory / n).exists()]
    digest = content_digest(files + extras, cache_dir)
    version = digest[:12]
    cached = _cached(cache_dir, digest, quantized)
    if cached is not None:
        _check_tensors(config, cached)
        return LoadedWeights(config, cached, tokenizer, version, "safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith("rotary_emb.inv_freq"):  # old checkpoints store the rotary table; we compute it
                    continue
                t = st.get_tensor(name)  # a view of the file's memory map
                if quantized is None:
                    tensors[name] = t if t.dtype == dtype or not t.is_floating_point() else t.to(dtype)
                else:
                    tensors[name] = t
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    _check_tensors(config, tensors)
    if quantized is not None:
        tensors = _quantize_matrices(tensors, quantized)
        _store(cache_dir, digest, quantized, tensors)
    return LoadedWeights(config, tensors, tokenizer, version, "safetensors")


def _safetensors_files(directory: Path) -> list[Path]:
    index = _read_json(directory / "model.safetensors.index.json")
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        raise ValueError("model directory lacks its .safetensors weight files")
    return files


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `config` has, with its shape (per architecture: models/llama_config.py)."""
    return config.tensor_shapes()


def _check_tensors(config: LlamaConfig, tensors: dict[str, torch.Tensor]) -> None:
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
