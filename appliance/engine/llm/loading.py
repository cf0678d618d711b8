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

from appliance.cgroup_memory import memory_cgroup
from appliance.engine.llm.settings import (ACTIVATIONS, COMPILE, DTYPES, MEMORY_HEADROOM, QUANT_KERNELS, WEIGHTS,
                                           GenerativeSettings)
from appliance.engine.llm.slots import POLICIES
from appliance.engine.llm.thread_reply import Reply
from appliance.engine.llm.weight_plan import plan_weights
from core.errors import ApplianceError, EngineFailure

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
    compiled_decode: Any = None  # loader.compiled_decode.CompiledDecode, ready once compiled; None: eager decode
    weight_format: str = ""  # e.g. "Q4_1+Q8_0/int8" (appliance_model_info's weight_format label)
    path_record: Any = None  # loader.path_choice.Record when the path was measured
    draft: Any = None  # draft_model.DraftModel (speculation: draft), loaded with the target, its slots mirroring


def load_engine(name: str, path: Path, settings: GenerativeSettings, version_label: str | None,
                current: LoadedEngine | None, measure: Callable | None = None,
                remeasure: bool = False, kl: Callable | None = None) -> LoadedEngine:
    """Load the model at path (runs in a load thread). The current engine's cache is reused when its shape fits.
    measure / kl: path_choice.measure's and path_build.kl_to_exact's stand-ins (tests force timings and accuracy
    through them); remeasure: measure the weight paths again even where a record of them exists (`appliance models
    prepare`)."""
    import torch

    from models.llama import KVCache

    s = settings
    check_settings(s)
    device = s.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineFailure("device cuda was asked for but no GPU is available")
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    plan = plan_weights(Path(path), s, device, measure, remeasure, kl)
    model, config, tokenizer, version = plan.model, plan.config, plan.tokenizer, plan.version
    kv_dtype = getattr(torch, s.kv_dtype if s.kv_dtype != "auto" else "bfloat16" if plan.quantized
                       else plan.compute_dtype)
    max_seq_len = s.max_seq_len
    if max_seq_len > config.max_position_embeddings:
        log.warning("model %s: max_seq_len %d exceeds the model's %d positions; using %d", name,
                    max_seq_len, config.max_position_embeddings, config.max_position_embeddings)
        max_seq_len = config.max_position_embeddings
    cache = None
    if current is not None and _same_cache_shape(current.cache, config, s.kv_slots, max_seq_len, kv_dtype, device):
        cache = current.cache  # every slot is dropped at the swap; no need for a second cache
    backend = plan.backend
    if cache is None:
        need = KVCache.nbytes_for(config, s.kv_slots, max_seq_len, kv_dtype)
        available, bound = _available_memory(device)
        if available is not None and need > MEMORY_HEADROOM * available:
            raise EngineFailure(
                f"the KV cache for kv_slots={s.kv_slots} x max_seq_len={max_seq_len} needs "
                f"{need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is available, bounded by "
                f"{bound}; lower kv_slots or max_seq_len")
        if available is not None:
            log.info("model %s: KV cache %.2f GiB of %.2f GiB free, bounded by %s", name, need / 2**30,
                     available / 2**30, bound)
            backend += f"; KV cache {need / 2**30:.2f} GiB, memory bounded by {bound}"
        cache = KVCache(config, s.kv_slots, max_seq_len, kv_dtype, device)
    draft = None
    if s.speculation == "draft":
        if device.startswith("cuda") and model.use_kernels():
            log.warning("model %s: speculation is verified by the eager forward only; no draft model on this device",
                        name)
        else:
            draft = load_draft(name, s, device, plan, max_seq_len, measure, remeasure, kl)
            backend += f"; draft model {draft.backend}"
    log.info("model %s: %s", name, backend)
    compiled = None
    if s.compile != "off" and device == "cpu":
        from loader.compiled_decode import CompiledDecode
        compiled = CompiledDecode(model, cache, Path(s.compile_cache_dir) if s.compile_cache_dir else None)
        if s.compile == "on" or compiled.prepared:
            # on, or compiled on this box before (a start after the first, or `appliance models prepare`): the
            # package loads in milliseconds, before Ready, so the box never serves eager decode while a compile
            # takes a core
            compile_decode(name, compiled)
    return LoadedEngine(model, cache, tokenizer, version_label or version, backend, max_seq_len, compiled,
                        plan.weight_format, plan.record, draft.drafter if draft is not None else None)


@dataclass
class LoadedDraft:
    drafter: Any  # draft_model.DraftModel
    backend: str  # its weights and KV cache, for the target's Backend text


def load_draft(name: str, s: GenerativeSettings, device: str, target: Any, max_seq_len: int,
               measure: Callable | None, remeasure: bool, kl: Callable | None) -> LoadedDraft:
    """The draft model of `speculation: draft`, along the target's loader path (plan_weights: the same settings,
    the same weight cache), with a KV cache of its own of the target's kv_slots x max_seq_len. Refused when its
    tokenizer is not the target's (check-config says so first, naming the YAML line)."""
    import torch

    from appliance.engine.llm.draft_model import DraftModel
    from models.llama import KVCache

    path = Path(s.speculation_draft_model) if s.speculation_draft_model else None
    if path is None or not path.exists():
        raise EngineFailure("speculation: draft needs speculation_draft_model, an existing model file")
    plan = plan_weights(path, s, device, measure, remeasure, kl)
    why = tokenizer_difference(target.tokenizer, target.config, plan.tokenizer, plan.config)
    if why:
        raise EngineFailure(f"the draft model's tokenizer is not the target's ({why})")
    positions = min(max_seq_len, plan.config.max_position_embeddings)  # drafts past it: none (draft_model.fill)
    kv_dtype = getattr(torch, s.kv_dtype if s.kv_dtype != "auto" else "bfloat16" if plan.quantized
                       else plan.compute_dtype)
    need = KVCache.nbytes_for(plan.config, s.kv_slots, positions, kv_dtype)
    available, bound = _available_memory(device)
    if available is not None and need > MEMORY_HEADROOM * available:
        raise EngineFailure(f"the draft model's KV cache needs {need / 2**30:.2f} GiB but only "
                            f"{available / 2**30:.2f} GiB of memory is available, bounded by {bound}")
    cache = KVCache(plan.config, s.kv_slots, positions, kv_dtype, device)
    log.info("model %s: draft model %s", name, plan.backend)
    return LoadedDraft(DraftModel(plan.model, cache), f"{plan.weight_format}, KV cache {need / 2**30:.2f} GiB")


def tokenizer_difference(a: Any, a_config: Any, b: Any, b_config: Any) -> str | None:
    """Why two models' tokenizers differ (vocabulary size, a token's text), or None when they are the same: a draft
    model's token ids must mean what the target's mean."""
    if a_config.vocab_size != b_config.vocab_size:
        return f"vocabulary of {b_config.vocab_size} tokens, the target's {a_config.vocab_size}"
    va, vb = a.tokenizer.get_vocab(with_added_tokens=True), b.tokenizer.get_vocab(with_added_tokens=True)
    if va != vb:
        ids_a = {i: t for t, i in va.items()}
        ids_b = {i: t for t, i in vb.items()}
        first = min(i for i in set(ids_a) | set(ids_b) if ids_a.get(i) != ids_b.get(i))
        return f"token {first} differs"
    return None


def prepare_model(name: str, path: Path, settings: GenerativeSettings) -> LoadedEngine:
    """`appliance models prepare NAME` (and the package's postinst): measure the weight paths on this CPU, lay the
    chosen weights out in the weight cache and compile the decode step into its package, so that every start
    after this one serves at full speed from Ready."""
    from dataclasses import replace
    engine = load_engine(name, path, replace(settings, compile="off"), None, None, remeasure=True)
    if settings.compile != "off" and engine.model.device.type == "cpu":
        from loader.compiled_decode import CompiledDecode
        engine.compiled_decode = CompiledDecode(engine.model, engine.cache,
                                                Path(settings.compile_cache_dir) if settings.compile_cache_dir
                                                else None)
        compile_decode(name, engine.compiled_decode)
    return engine


def check_settings(s: GenerativeSettings) -> None:
    for key, allowed in (("slot_policy", POLICIES), ("dtype", DTYPES), ("weights", WEIGHTS),
                         ("activations", ACTIVATIONS), ("quant_kernels", QUANT_KERNELS), ("compile", COMPILE)):
        if getattr(s, key) not in allowed:
            raise EngineFailure(f"{key} must be one of {', '.join(allowed)}")
    if min(s.kv_slots, s.max_seq_len, s.max_new_tokens, s.prefill_chunk, s.max_text_chars) < 1:
        raise EngineFailure("kv_slots, max_seq_len, max_new_tokens, prefill_chunk and max_text_chars must be "
                            "positive")


def compile_in_background(name: str, engine: LoadedEngine) -> threading.Thread | None:
    """engine.compile: auto at the first start of a model on a box that was never prepared (`appliance models
    prepare`): compile the decode step in a short-lived thread of its own (see in_fresh_thread) after a pause that
    lets Ready reach the serve process; the engine decodes eagerly until it is done. Every later start loads the
    package it wrote before Ready (load_engine)."""
    compiled = engine.compiled_decode
    if compiled is None or compiled.ready:
        return None

    def body() -> None:
        try:  # the compiler's CPU time after the models it would slow (Linux: a thread's own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_COMPILE_NICE)
        except OSError:
            pass
        time.sleep(BACKGROUND_COMPILE_DELAY_S)
        compile_decode(name, compiled)
    thread = threading.Thread(target=body, name=f"compile-{name}", daemon=True)
    thread.start()
    return thread


def compile_decode(name: str, compiled: Any) -> None:
    """Compile the decode step (or load its package); where torch cannot, say why and leave decode eager."""
    from loader.compiled_decode import CompileUnavailable
    log.info("model %s: compiling the decode step", name)
    try:
        compiled.compile()
    except CompileUnavailable as exc:
        log.warning("model %s: decode stays eager: %s", name, exc)
        return
    log.info("model %s: decode step compiled in %.1f s (%s)", name, compiled.compile_seconds,
             "its package built now" if compiled.built else "its package loaded")


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


def _available_memory(device: str) -> tuple[int | None, str]:
    """Bytes free for a new allocation and what bounds them: on a GPU its free memory; on the host the smaller of
    MemAvailable and what the process's cgroup still allows (systemd's MemoryMax=, a pod's memory limit: a box
    with 32 GB and a service capped at 8 GB has 8 to give, and the cgroup's OOM killer takes the rest)."""
    if device.startswith("cuda"):
        import torch
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "the GPU's free memory"
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = memory_cgroup()
    cap = cgroup.limit() if cgroup is not None else None
    if cap is not None:
        log.info("memory: %s at %s, %.2f GiB free under it; MemAvailable %s", cap.describe(), cap.cgroup,
                 cap.available / 2**30, f"{host / 2**30:.2f} GiB" if host is not None else "unreadable")
        if host is None or cap.available < host:
            return cap.available, cap.describe()
    return host, "the host's MemAvailable"


def load_failure_reason(exc: BaseException) -> str:
    """A reason safe to show a client: our own errors and the loader's ValueErrors (which name files by their
    base name only); anything else only by its type."""
    if isinstance(exc, ApplianceError) or (isinstance(exc, ValueError) and "/" not in str(exc)):
        return str(exc)
    if isinstance(exc, OSError):
        return f"the model files could not be read ({type(exc).__name__})"
    return f"loading failed ({type(exc).__name__})"
