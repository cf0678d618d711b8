"""Loading one generative model: the weights, the tokenizer and the KV cache, checked against the memory free.

Weights load in a short-lived thread, never in a pooled one (see in_fresh_thread: an idle OpenMP team in another
long-lived thread makes the engine's matmuls ~50% slower on a 2-core CPU).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from appliance.engine.llm_settings import DTYPES, MEMORY_HEADROOM, GenerativeSettings
from appliance.engine.slots import POLICIES
from appliance.engine.thread_reply import Reply
from appliance.errors import ApplianceError, EngineFailure

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    """What one load produced; swapped whole by a reload."""
    model: Any  # models.llama.LlamaModel
    cache: Any  # models.llama.KVCache
    tokenizer: Any  # models.tokenizer.ChatTokenizer
    version: str
    backend: str
    max_seq_len: int


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
    if min(s.kv_slots, s.max_seq_len, s.max_new_tokens, s.prefill_chunk, s.max_text_chars) < 1:
        raise EngineFailure("kv_slots, max_seq_len, max_new_tokens, prefill_chunk and max_text_chars must be "
                            "positive")
    device = s.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineFailure("device cuda was asked for but no GPU is available")
    # fp32 on CPU: greedy output stays that of the reference (bf16 diverges within a few tokens) and batch-1
    # decode is no faster in bf16 here; see bench/generate.py.
    dtype_name = s.dtype if s.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    if s.threads > 0:
        torch.set_num_threads(s.threads)

    loaded = load_weights(path, dtype)
    config = loaded.config
    max_seq_len = s.max_seq_len
    if max_seq_len > config.max_position_embeddings:
        log.warning("model %s: max_seq_len %d exceeds the model's %d positions; using %d", name,
                    max_seq_len, config.max_position_embeddings, config.max_position_embeddings)
        max_seq_len = config.max_position_embeddings
    model = LlamaModel(config, loaded.tensors, dtype=dtype, device=device, kernels=s.kernels)
    del loaded.tensors
    cache = None
    if current is not None and _same_cache_shape(current.cache, config, s.kv_slots, max_seq_len, dtype, device):
        cache = current.cache  # every slot is dropped at the swap; no need for a second cache
    if cache is None:
        need = KVCache.nbytes_for(config, s.kv_slots, max_seq_len, dtype)
        available = _available_memory(device)
        if available is not None and need > MEMORY_HEADROOM * available:
            raise EngineFailure(
                f"the KV cache for kv_slots={s.kv_slots} x max_seq_len={max_seq_len} needs "
                f"{need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is available; "
                "lower kv_slots or max_seq_len")
        cache = KVCache(config, s.kv_slots, max_seq_len, dtype, device)
    backend = "torch-cuda" if device.startswith("cuda") else "torch-cpu"
    return LoadedEngine(model, cache, loaded.tokenizer, version_label or loaded.version, backend, max_seq_len)


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
