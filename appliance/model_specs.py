"""What a worker is told to serve: one configured model's ModelSpec (plain values: it crosses the process boundary),
its weights where `appliance models deploy` put them."""
from __future__ import annotations

import logging
from pathlib import Path

from .model_store import ModelStore, ModelStoreError
from .workers.protocol import ModelSpec

log = logging.getLogger(__name__)


def model_spec(m, engine, device: str, state_dir: Path, version: str | None = None, candidate: bool = False):
    """What a worker needs to serve one configured model (plain values: it crosses the process boundary). A model
    deployed with `appliance models deploy` serves its `current` version (or `version`; or, with `candidate`, the
    version a deploy in progress checks, if any), from the version's own folder; one whose `current` points nowhere
    is refused (Failed, with what to do)."""
    path, refused, label = str(m.resolved_path), "", m.version
    store = ModelStore(state_dir)
    if version is None and candidate:
        version = store.candidate_version(m.name)
    if version is not None or store.deployed(m.name):
        try:
            version = version or store.current_version(m.name)
            path = str(store.version_path(m.name, version, m.kind))
            label = m.version or version
        except ModelStoreError as e:
            refused = str(e)
            log.error("%s", refused)
    if m.kind == "tensor":
        delay_ms = m.max_queue_delay_ms if m.max_queue_delay_ms is not None else engine.max_queue_delay_ms
        # The YAML's device as written: "auto" resolves per backend in the worker (ONNX Runtime uses CUDA only when
        # its package has the provider), not once for all models.
        settings = {"backend": m.backend, "device": engine.device, "max_samples": m.max_samples,
                    "tensorrt_cache_dir": str(state_dir / "tensorrt"), "tensorrt_fp16": engine.tensorrt_fp16,
                    "max_batch_size": m.max_batch_size or engine.max_batch_size,
                    "max_queue_delay_s": delay_ms / 1000.0, "max_queue_size": engine.max_queue_size}
    else:
        settings = {"kv_slots": engine.kv_slots, "max_seq_len": engine.max_seq_len,
                    "max_new_tokens": engine.max_new_tokens, "slot_policy": engine.slot_policy,
                    "prefill_chunk": engine.prefill_chunk, "dtype": engine.dtype, "device": device,
                    "seed": engine.seed, "max_text_chars": m.max_text_chars, "system_prompt": m.system_prompt,
                    "top_p": m.top_p, "speculation": m.speculation,
                    "speculation_draft_min": m.speculation_draft_min,
                    "speculation_draft_max": m.speculation_draft_max,
                    "speculation_draft_model": (str(m.speculation_draft_model) if m.speculation_draft_model
                                                else None), "max_queue_size": engine.max_queue_size, "kernels": engine.kernels,
                    "weights": engine.weights, "activations": engine.activations,
                    "quant_kernels": engine.quant_kernels, "kv_dtype": engine.kv_dtype,
                    "weight_cache_dir": str(state_dir / "cache" / "weights" / m.name),
                    "cpu_kernel_dir": str(state_dir / "cache" / "kernels"),
                    "compile": engine.compile, "compile_cache_dir": str(state_dir / "cache" / "inductor"),
                    "prefix_cache_entries": engine.prefix_cache_entries, "park_memory_mb": engine.park_memory_mb,
                    "conversation_dir": str(state_dir / "conversations" / m.name),
                    "conversation_ttl_s": engine.conversation_ttl_s}
    return ModelSpec(name=m.name, kind=m.kind, path=path, version_label=label, settings=settings,
                     refused=refused)
