"""The settings of one generative model's engine, read from the YAML once by the serve process and sent to its
worker (plain values only: they cross the process boundary)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_PROMPT_BYTES = 16 * 1024
MAX_TEMPERATURE = 2.0
MEMORY_HEADROOM = 0.8  # the KV cache may take at most this share of the memory available at load
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4", "blocks")
ACTIVATIONS = ("auto", "int8", "float32")  # our quantized kernels' activations (kernels/cpu/quant_kernels.h)
QUANT_KERNELS = ("auto", "amx", "avx512vnni", "avxvnni", "avx2", "torch")  # who multiplies quantized weights on a CPU
COMPILE = ("auto", "on", "off")


@dataclass
class GenerativeSettings:
    kv_slots: int = 4
    max_seq_len: int = 2048
    max_new_tokens: int = 512
    slot_policy: str = "evict_lru"  # evict_lru | reject
    prefill_chunk: int = 256
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    seed: int = 0
    max_text_chars: int = 1024
    system_prompt: str | None = None
    top_p: float = 0.95
    max_queue_size: int = 64
    kernels: str = "auto"  # auto: fused Triton kernels for decode on CUDA, eager torch elsewhere | triton | torch
    weights: str = "auto"  # auto (measured, see weight_plan) | float32 | bfloat16 | int8 | int4 | blocks
    activations: str = "auto"  # auto (measured) | int8 (per block of 32) | float32 (exact)
    quant_kernels: str = "auto"  # auto (measured) | amx | avx512vnni | avxvnni | avx2 | torch
    kv_dtype: str = "auto"  # auto (bfloat16 with quantized weights, else the compute dtype) | float32 | bfloat16
    weight_cache_dir: str | None = None  # quantized weights cached here (loader/weight_cache.py)
    cpu_kernel_dir: str | None = None  # our quantized matmuls built here (kernels/cpu_quant.py)
    compile: str = "off"  # the CPU decode step compiled: auto (in the background after load) | on (before) | off
    compile_cache_dir: str | None = None  # Inductor's artefacts (loader/compiled_decode.py)
    prefix_cache_entries: int = 8  # shared prompt prefixes kept in host memory (0: none)
    park_memory_mb: int = 256  # host memory for evicted sessions' conversations (slots.SlotManager parking)
    conversation_dir: str | None = None  # Converse conversations kept here across restarts (conversation_files)
    conversation_ttl_s: float = 86400.0
    speculation: str = "off"  # off | lookup | draft (appliance/engine/llm/speculation.py, draft_model.py)
    speculation_draft_model: str | None = None  # draft: the draft model's file (the target's tokenizer)
    speculation_draft_min: int = 1
    speculation_draft_max: int = 8
    # Forced stretches of a grammar fed as prefill (not a YAML key: off only for bench/tasks.py's comparison)
    jump_forward: bool = True
