"""Weights kept quantized (models/quant.py): against the dequantised fp32 path on the same GGUF file, the on-disk
cache of quantized weights, and a KV cache whose untouched pages cost nothing.

Tolerances, measured on SmolLM2-135M Q4_1 over 600 teacher-forced tokens of this project's README:
- int4 multiplies by the file's own 4-bit numbers (exact); the differences come from the bfloat16 embeddings and
  lm_head (their file type is Q8_0): max |logit difference| 0.25, top-1 agreement 99.7%. Asserted: < 1.0, >= 99%.
- int8 requantizes each Q4_1 row (32-value groups with their own scales) to one scale per row, which is lossy:
  96.5% agreement. Asserted: >= 95%; its 20-token greedy answer to the reference prompt is still the same.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kernels import cpu_quant
from models import gguf_loader, quant, weight_cache
from models.llama import KVCache, LlamaModel
from models.weights import load_weights
from test_gguf import smollm2_path, write_tiny_gguf

REFERENCE_PROMPT = "<|im_start|>user\nWhat is a centrifugal pump?<|im_end|>\n<|im_start|>assistant\n"
REFERENCE_ANSWER = ("A centrifugal pump is a type of mechanical pump that uses centrifugal force to remove air from "
                    "a gas or")  # llama.cpp (Q4_1, F16, F32) and HF fp32 give these 20 tokens
TEXT_TOKENS = 520


@pytest.fixture(scope="module")
def fp32():
    w = load_weights(smollm2_path(), torch.float32)
    return w, LlamaModel(w.config, w.tensors)


@pytest.fixture(scope="module")
def text_ids(fp32):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    ids = fp32[0].tokenizer.encode(text[2000:12000])[:TEXT_TOKENS]
    assert len(ids) == TEXT_TOKENS
    return ids


@pytest.fixture(scope="module")
def fp32_logits(fp32, text_ids):
    return teacher_forced(fp32[1], text_ids, torch.float32)


def teacher_forced(model: LlamaModel, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    cache = KVCache(model.config, 1, len(ids) + 8, kv_dtype)
    return model.forward(cache, torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), torch.tensor([len(ids)]),
                         all_logits=True)[0]


def greedy(model: LlamaModel, ids: list[int], n: int, kv_dtype: torch.dtype) -> list[int]:
    cache = KVCache(model.config, 1, 128, kv_dtype)
    logits = model.forward(cache, torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), torch.tensor([len(ids)]))
    out, pos = [], len(ids)
    for _ in range(n):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = model.forward(cache, torch.tensor([[token]]), torch.tensor([0]), torch.tensor([pos]),
                               torch.tensor([1]))
        pos += 1
    return out


@pytest.mark.parametrize("ops", ["torch", "avx2"])
@pytest.mark.parametrize("fmt, min_agreement, max_logit_diff", [("int4", 0.99, 1.0), ("int8", 0.95, 4.0)])
def test_quantized_against_dequantised_fp32(fp32, text_ids, fp32_logits, fmt, min_agreement, max_logit_diff, ops):
    """ops: torch's int4/int8 weight ops, or our AVX2 kernels (kernels/cpu/quant_matmul.c; their lm_head multiplies
    int8 rows before the fp32 refinement)."""
    kernels = None
    if ops == "avx2":
        kernels = cpu_quant.library()
        if kernels is None:
            pytest.skip("our AVX2 kernels are not available here (no AVX2 or no C compiler; see the log)")
    w = load_weights(smollm2_path(), torch.float32, fmt)
    matrices = [t for n, t in w.tensors.items() if n not in quant.HEAD_NAMES and not isinstance(t, torch.Tensor)]
    assert len(matrices) == 7 * w.config.num_hidden_layers  # every layer matrix stayed quantized
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for n, t in w.tensors.items()
               if n in quant.HEAD_NAMES)
    model = LlamaModel(w.config, w.tensors, cpu_kernels=kernels)
    logits = teacher_forced(model, text_ids, torch.bfloat16)
    agreement = (logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item()
    diff = (logits - fp32_logits).abs().max().item()
    print(f"{fmt} ({ops}): top-1 agreement {agreement:.4f} over {len(text_ids)} tokens, max |logit diff| {diff:.3f}")
    assert agreement >= min_agreement and diff < max_logit_diff
    ids = fp32[0].tokenizer.encode(REFERENCE_PROMPT)
    assert fp32[0].tokenizer.decode(greedy(model, ids, 20, torch.bfloat16)) == REFERENCE_ANSWER


def test_fp32_path_gives_the_reference_answer(fp32):
    ids = fp32[0].tokenizer.encode(REFERENCE_PROMPT)
    assert fp32[0].tokenizer.decode(greedy(fp32[1], ids, 20, torch.float32)) == REFERENCE_ANSWER


def test_int4_from_q4_blocks_is_exact(tmp_path):
    """Q4_0 / Q4_1 blocks become int4 groups with the file's own numbers: dequantising both gives the same floats."""
    _config, _hf, raw = write_tiny_gguf(tmp_path / "t.gguf", tied=False)
    exact = load_weights(tmp_path / "t.gguf", torch.float32)
    kept = load_weights(tmp_path / "t.gguf", torch.float32, "int4")
    checked = 0
    for name, (_data, qtype) in raw.items():
        if qtype.name in ("Q4_0", "Q4_1") and name not in quant.HEAD_NAMES:
            assert torch.allclose(quant.dequantize(kept.tensors[name]), exact.tensors[name], atol=1e-6), name
            checked += 1
    assert checked > 0


def test_quantized_linear_matches_its_dequantised_weights():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(5, 64)
    for fmt in quant.FORMATS:
        m = quant.quantize(w, fmt)
        ref = x @ quant.dequantize(m).t()
        assert torch.allclose(quant.linear_for(m)(x), ref, atol=1e-3, rtol=1e-3), fmt
        assert ((quant.dequantize(m) - w).norm() / w.norm()).item() < (0.01 if fmt == "int8" else 0.12)


def test_second_load_maps_the_cache_and_a_changed_file_invalidates_it(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    write_tiny_gguf(model, tied=True)
    cache_dir = tmp_path / "cache"
    first = load_weights(model, torch.float32, "int4", cache_dir)
    files = list(cache_dir.glob("*.safetensors"))
    assert len(files) == 1

    calls = []
    real = quant.from_gguf_blocks
    monkeypatch.setattr(quant, "from_gguf_blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    header_reads = []
    real_header = gguf_loader.header_metadata
    monkeypatch.setattr(gguf_loader, "header_metadata", lambda r: header_reads.append(1) or real_header(r))
    second = load_weights(model, torch.float32, "int4", cache_dir)
    assert calls == []  # nothing dequantised or requantized: the tensors are views of the cache file's map
    assert header_reads == []  # nor the GGUF header parsed: config and tokenizer come from the saved metadata
    assert second.tokenizer.encode("pump") == first.tokenizer.encode("pump") and second.config == first.config
    assert set(second.tensors) == set(first.tensors)
    for name, t in first.tensors.items():
        a, b = (quant.dequantize(t), quant.dequantize(second.tensors[name])) if not isinstance(t, torch.Tensor) \
            else (t, second.tensors[name])
        assert torch.equal(a, b), name
    x = torch.tensor([[1, 2, 3]])
    m1, m2 = LlamaModel(first.config, first.tensors), LlamaModel(second.config, second.tensors)
    c1, c2 = KVCache(first.config, 1, 16, torch.float32), KVCache(first.config, 1, 16, torch.float32)
    args = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]))
    assert torch.equal(m1.forward(c1, x, *args), m2.forward(c2, x, *args))

    # another model file (retrained: other bytes, same name) has another key: rebuilt, not the stale cache
    shutil.copy(model, tmp_path / "old.gguf")
    write_tiny_gguf(model, tied=False)
    third = load_weights(model, torch.float32, "int4", cache_dir)
    assert calls, "a changed model file must be quantized again"
    assert "lm_head.weight" in third.tensors
    assert len(list(cache_dir.glob("*.safetensors"))) == 2


def test_torn_cache_file_is_rebuilt(tmp_path):
    model = tmp_path / "m.gguf"
    write_tiny_gguf(model, tied=True)
    load_weights(model, torch.float32, "int8", tmp_path / "cache")
    (cache_file,) = (tmp_path / "cache").glob("*.safetensors")
    with open(cache_file, "r+b") as f:
        f.truncate(os.path.getsize(cache_file) // 2)
    again = load_weights(model, torch.float32, "int8", tmp_path / "cache")
    assert isinstance(again.tensors["model.layers.0.mlp.down_proj.weight"], quant.Int8Rows)
    assert weight_cache.load(cache_file) is not None  # rewritten whole


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_kv_cache_pages_cost_nothing_until_written():
    from models.llama_config import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2)
    before = _rss_bytes()
    cache = KVCache(cfg, 8, 8192, torch.float32)  # 2 x 8 layers x 8 slots x 2 x 8193 x 16 x 4 bytes = 134 MB
    size = cache.kv.numel() * cache.kv.element_size()
    assert size > 130e6
    assert _rss_bytes() - before < 0.05 * size
    cache.kv[:, :, 0, :, :64] = 1.0  # one slot's first 64 positions
    assert float(cache.kv[0, 0, 1].abs().sum()) == 0.0  # and the rest reads as zeros
    assert _rss_bytes() - before < 0.2 * size


def test_auto_format_reads_the_gguf_header_once_per_file(tmp_path, monkeypatch):
    """engine.weights: auto needs the file's matrix types; a cached start takes them from the cache directory."""
    from models.weight_cache import gguf_matrix_types
    model = tmp_path / "m.gguf"
    _config, hf_weights, raw = write_tiny_gguf(model, tied=True)
    first = gguf_matrix_types(model, tmp_path / "cache")
    assert first == {qtype.name for name, (_data, qtype) in raw.items() if hf_weights[name].dim() == 2}
    monkeypatch.setattr(gguf_loader, "matrix_types", lambda p: (_ for _ in ()).throw(AssertionError("parsed")))
    assert gguf_matrix_types(model, tmp_path / "cache") == first
