"""Loading one generative model: the weights, the tokenizer and the KV cache, checked against the memory free.

Weights load in a short-lived thread, never in a pooled one (see in_fresh_thread: an idle OpenMP team in another
long-lived thread makes the engine's matmuls ~50% slower on a 2-core CPU).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from appliance.engine.llm_settings import COMPILE, DTYPES, MEMORY_HEADROOM, WEIGHTS, GenerativeSettings
from appliance.engine.slots import POLICIES
from appliance.engine.thread_reply import Reply
from appliance.errors import ApplianceError, EngineFailure

log = logging.getLogger(__name__)

BACKGROUND_COMPILE_DELAY_S = 1.0  # engine.compile: auto starts compiling this long after Ready
BACKGROUND_COMPILE_NICE = 19  # ... at the lowest priority: it takes the CPU only when the models leave it idle


@dataclass
class LoadedEngine:
    """What one load produced; swapped whole by a reload."""
    model: Any  # models.llama.LlamaModel
    cache: Any  # models.llama.KVCache
    tokenizer: Any  # models.tokenizer.ChatTokenizer
    version: str
    backend: str
    max_seq_len: int
    compiled_decode: Any = None  # models.compiled_decode.CompiledDecode, ready once compiled; None: eager decode


def load_engine(name: str, path: Path, settings: GenerativeSettings, version_label: str | None,
                current: LoadedEngine | None) -> LoadedEngine:
    """Load the model at path (runs in a load thread). The current engine's cache is reused when its shape fits."""
    import torch

    from models.llama import KVCache, LlamaModel
    from models.weights import load_weights

    s = settings
    if s.slot_policy not in POLICIES:
        raise EngineFailure(f"slot_policy must be one of {', '.join(POLICIES)}")
    if s.dtype not in DTYPES:
        raise EngineFailure(f"dtype must be one of {', '.join(DTYPES)}")
    if s.weights not in WEIGHTS:
        raise EngineFailure(f"weights must be one of {', '.join(WEIGHTS)}")
    if s.compile not in COMPILE:
        raise EngineFailure(f"compile must be one of {', '.join(COMPILE)}")
    if min(s.kv_slots, s.max_seq_len, s.max_new_tokens, s.prefill_chunk, s.max_text_chars) < 1:
        raise EngineFailure("kv_slots, max_seq_len, max_new_tokens, prefill_chunk and max_text_chars must be "
                            "positive")
    device = s.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineFailure("device cuda was asked for but no GPU is available")
    cache_dir = Path(s.weight_cache_dir) if s.weight_cache_dir else None
    cpu_kernels = cpu_quant_kernels(s, device)
    quantized, dtype_name = weight_format(s.weights, s.dtype, Path(path), device, cache_dir,
                                          fast_quantized=cpu_kernels is not None or torch_quantized_ops_are_fast())
    dtype = getattr(torch, dtype_name)
    kv_dtype = getattr(torch, s.kv_dtype if s.kv_dtype != "auto" else "bfloat16" if quantized else dtype_name)
    if s.threads > 0:
        torch.set_num_threads(s.threads)

    loaded = load_weights(path, dtype, quantized, cache_dir)
    config = loaded.config
    max_seq_len = s.max_seq_len
    if max_seq_len > config.max_position_embeddings:
        log.warning("model %s: max_seq_len %d exceeds the model's %d positions; using %d", name,
                    max_seq_len, config.max_position_embeddings, config.max_position_embeddings)
        max_seq_len = config.max_position_embeddings
    model = LlamaModel(config, loaded.tensors, dtype=dtype, device=device, kernels=s.kernels,
                       cpu_kernels=cpu_kernels if quantized else None)
    del loaded.tensors
    cache = None
    if current is not None and _same_cache_shape(current.cache, config, s.kv_slots, max_seq_len, kv_dtype, device):
        cache = current.cache  # every slot is dropped at the swap; no need for a second cache
    if cache is None:
        need = KVCache.nbytes_for(config, s.kv_slots, max_seq_len, kv_dtype)
        available = _available_memory(device)
        if available is not None and need > MEMORY_HEADROOM * available:
            raise EngineFailure(
                f"the KV cache for kv_slots={s.kv_slots} x max_seq_len={max_seq_len} needs "
                f"{need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is available; "
                "lower kv_slots or max_seq_len")
        cache = KVCache(config, s.kv_slots, max_seq_len, kv_dtype, device)
    backend = ("torch-cuda" if device.startswith("cuda") else "torch-cpu") + (f"-{quantized}" if quantized else "")
    if quantized and cpu_kernels is not None:
        backend += "+avx2"
    compiled = None
    if s.compile != "off" and device == "cpu":
        from models.compiled_decode import CompiledDecode
        compiled = CompiledDecode(model, cache, Path(s.compile_cache_dir) if s.compile_cache_dir else None)
        if s.compile == "on":
            compile_decode(name, compiled)  # auto: compile_in_background, once the model is Ready
    return LoadedEngine(model, cache, loaded.tokenizer, version_label or loaded.version, backend, max_seq_len,
                        compiled)


def compile_in_background(name: str, engine: LoadedEngine) -> None:
    """engine.compile: auto: compile the decode step in a short-lived thread of its own (see in_fresh_thread) after
    a pause that lets Ready reach the serve process; the engine decodes eagerly until it is done."""
    compiled = engine.compiled_decode
    if compiled is None or compiled.ready:
        return

    def body() -> None:
        try:  # the compiler's CPU time after the models it would slow (Linux: a thread's own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_COMPILE_NICE)
        except OSError:
            pass
        time.sleep(BACKGROUND_COMPILE_DELAY_S)
        compile_decode(name, compiled)
    threading.Thread(target=body, name=f"compile-{name}", daemon=True).start()


def compile_decode(name: str, compiled: Any) -> None:
    """Compile the decode step; where torch cannot, say why and leave decode eager."""
    from models.compiled_decode import CompileUnavailable
    log.info("model %s: compiling the decode step", name)
    try:
        compiled.compile()
    except CompileUnavailable as exc:
        log.warning("model %s: decode stays eager: %s", name, exc)
    else:
        log.info("model %s: decode step compiled in %.1f s", name, compiled.compile_seconds)


def weight_format(weights: str, dtype: str, path: Path, device: str, cache_dir: Path | None = None,
                  fast_quantized: bool = True) -> tuple[str | None, str]:
    """(quantized format or None, compute dtype) for `engine.weights` / `engine.dtype` on this file and device.

    auto keeps a GGUF file's quantization on a CPU where quantized matmuls are fast (fast_quantized: torch's ops on
    AVX-512, our kernels on AVX2): Q4_0 / Q4_1 run as int4 (the file's own numbers, exactly), Q8_0 as int8. Float
    files, GPUs and CPUs without either take `dtype` (auto: float32 on CPU, where bf16 greedy output diverges from
    the reference within a few tokens; bfloat16 on CUDA). On an AVX2-only EPYC torch's own int4 / int8 weight ops
    took 123 / 69 ms per SmolLM2 decode step at 1 sequence and ~1 s at 8, against 48 and 64 ms for fp32; with our
    AVX2 kernels int4 generated 35.5 / 112.1 tokens/s at 1 / 8 sequences against fp32's 20.5 / 100.3
    (bench/generate.py, one run)."""
    on_gpu = device.startswith("cuda")
    compute = dtype if dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    if weights in ("float32", "bfloat16"):
        return None, weights
    if weights in ("int8", "int4"):
        if on_gpu:
            raise EngineFailure(f"weights: {weights} runs on the CPU only; use bfloat16 (or auto) on a GPU")
        return weights, "float32"
    if on_gpu or not (path.is_file() and path.suffix == ".gguf") or not fast_quantized:
        return None, compute
    from models.weight_cache import gguf_matrix_types
    types = gguf_matrix_types(path, cache_dir)
    if types & {"Q4_0", "Q4_1"}:
        return "int4", "float32"
    if "Q8_0" in types:
        return "int8", "float32"
    return None, compute


def torch_quantized_ops_are_fast() -> bool:
    """torch's CPU int4 / int8 weight matmuls have vectorised kernels for AVX-512 (and newer), not for AVX2."""
    import torch
    capability = torch.backends.cpu.get_cpu_capability()
    return capability.startswith("AVX512") or "AMX" in capability


def cpu_quant_kernels(settings: GenerativeSettings, device: str):
    """Our AVX2 quantized matmuls (kernels.cpu_quant), on a CPU where torch's own are slow, or None."""
    if device.startswith("cuda") or torch_quantized_ops_are_fast():
        return None
    from kernels import cpu_quant
    return cpu_quant.library(Path(settings.cpu_kernel_dir) if settings.cpu_kernel_dir else None)


async def in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn in a thread that ends with it. Not asyncio.to_thread: a pooled thread that once ran torch keeps an idle
    OpenMP team alive, and with more OpenMP threads than cores libgomp stops spin-waiting, which made every matmul of
    the engine thread ~50% slower here (20 -> 30 ms per decode step of the 135M model)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def body() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        Reply(loop, future).send(result, error)

    threading.Thread(target=body, name="llm-load", daemon=True).start()
    return await future


def _same_cache_shape(cache: Any, config: Any, n_slots: int, max_seq_len: int, dtype: Any, device: str) -> bool:
    kv = cache.kv
    return (cache.n_slots == n_slots and cache.max_seq_len == max_seq_len and kv.dtype == dtype
            and kv.shape[1] == config.num_hidden_layers and kv.shape[3] == config.num_key_value_heads
            and kv.shape[5] == config.head_dim and str(kv.device).split(":")[0] == device.split(":")[0])


def _available_memory(device: str) -> int | None:
    """Bytes free for a new allocation: MemAvailable on the host, free memory on a GPU."""
    if device.startswith("cuda"):
        import torch
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def load_failure_reason(exc: BaseException) -> str:
    """A reason safe to show a client: our own errors and the loader's ValueErrors (which name files by their
    base name only); anything else only by its type."""
    if isinstance(exc, ApplianceError) or (isinstance(exc, ValueError) and "/" not in str(exc)):
        return str(exc)
    if isinstance(exc, OSError):
        return f"the model files could not be read ({type(exc).__name__})"
    return f"loading failed ({type(exc).__name__})"
