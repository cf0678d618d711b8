"""How one generative model's weights are held and multiplied on this machine (`engine.weights`,
`engine.activations`, `engine.quant_kernels`), and the Backend text that says so.

On a CPU, the settings allow a set of paths (loader/path_choice.py): with `auto` several. Where more than one is
left, the choice is measured on this CPU at the first load of the file (or by `appliance models prepare`) and
recorded beside the weight cache (loader/path_build.py); later loads read the record. Backend then names the
weights, the kernels, how the path was chosen with its figures, and why anything faster was not available (no
compiler, a CPU without the instructions, a file type without a kernel), so an installed box never falls back in
silence.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from appliance.engine.llm.settings import GenerativeSettings
from core.errors import EngineFailure

log = logging.getLogger(__name__)

DENSE_TYPES = ("F32", "F16", "BF16")
HEAD_GGUF_NAMES = ("token_embd.weight", "output.weight")


@dataclass
class WeightPlan:
    model: Any  # models.llama.LlamaModel
    config: Any
    tokenizer: Any
    version: str
    backend: str  # "<device> <weight format>: <how>" (see weight_format_of in appliance/metrics.py)
    weight_format: str  # e.g. "Q4_K+Q6_K/int8", "Q4_1/torch-int4", "float32"
    quantized: bool
    compute_dtype: str
    record: Any = None  # loader.path_choice.Record when the path was measured


@dataclass
class CpuPaths:
    paths: list  # loader.path_choice.PathName: the paths the settings allow on this CPU (several: measured)
    notes: list[str]  # what Backend says about anything faster that is unavailable
    cpu: Any  # kernels.cpu_isa.CpuInfo, or None where our kernels cannot run
    types: dict[str, str]  # GGUF tensor name -> its type
    weights: str  # the `weights` setting, `auto` narrowed to the file's dtype for a float file


def cpu_paths(path: Path, s: GenerativeSettings) -> CpuPaths:
    """The paths plan_weights chooses among on this CPU (cpuid, the file's tensor types, the settings), without
    loading anything: what tests/cpu_view.py reports for a process under the unit's sandbox."""
    from kernels import cpu_isa
    from loader import path_choice
    from models import quant

    cache_dir = Path(s.weight_cache_dir) if s.weight_cache_dir else None
    compute = s.dtype if s.dtype != "auto" else "float32"
    types: dict[str, str] = {}
    if path.is_file() and path.suffix == ".gguf":
        from loader.weight_cache import gguf_tensor_types
        types = gguf_tensor_types(path, cache_dir)
    notes: list[str] = []
    without_kernel = sorted(set(types.values()) - set(quant.BLOCK_TYPES) - set(DENSE_TYPES))
    if without_kernel:
        notes.append(f"no kernel for {', '.join(without_kernel)}: those matrices requantized to Q8_0")
    layer_types = {t for n, t in types.items() if n not in HEAD_GGUF_NAMES}
    cpu, isas, why = cpu_isa.usable_isas(Path(s.cpu_kernel_dir) if s.cpu_kernel_dir else None)
    if why:
        notes.append(f"our kernels unavailable: {why}")
    elif cpu is not None and s.quant_kernels not in isas and cpu.stands_in(s.quant_kernels):
        isas = [*isas, s.quant_kernels]  # named by the configuration: the avxvnni kernels, EVEX-encoded
        notes.append(cpu.stand_in_text(s.quant_kernels))
    weights = s.weights
    if weights == "auto" and not (set(types.values()) & set(quant.BLOCK_TYPES) or without_kernel):
        weights = compute  # a float file (or an HF directory): its dtype, nothing to measure
    dense_ok = [s.dtype] if s.dtype != "auto" else ["float32", "bfloat16"]
    paths = [p for p in path_choice.candidates(weights, s.activations, s.quant_kernels, isas, layer_types,
                                               quant.FOUR_BIT)
             if p.quantized or p.weights in dense_ok or weights == p.weights]
    return CpuPaths(paths, notes, cpu, types, weights)


def plan_weights(path: Path, s: GenerativeSettings, device: str, measure: Callable | None = None,
                 remeasure: bool = False, kl: Callable | None = None) -> WeightPlan:
    """Load the model's weights along the path the settings (and, for auto, this CPU's measurements) give."""
    import torch

    from loader import path_build, path_choice
    from models import quant
    from models.llama import LlamaModel
    from loader.weights import load_weights

    cache_dir = Path(s.weight_cache_dir) if s.weight_cache_dir else None
    kernel_dir = Path(s.cpu_kernel_dir) if s.cpu_kernel_dir else None
    if device.startswith("cuda"):
        if s.weights in quant.FORMATS:
            raise EngineFailure(f"weights: {s.weights} runs on the CPU only; use bfloat16 (or auto) on a GPU")
        compute = s.weights if s.weights in ("float32", "bfloat16") else s.dtype if s.dtype != "auto" else "bfloat16"
        loaded = load_weights(path, getattr(torch, compute))
        model = LlamaModel(loaded.config, loaded.tensors, dtype=getattr(torch, compute), device=device,
                           kernels=s.kernels)
        return WeightPlan(model, loaded.config, loaded.tokenizer, loaded.version, f"cuda {compute}: dense weights",
                          compute, False, compute)

    compute = s.dtype if s.dtype != "auto" else "float32"
    options = cpu_paths(path, s)
    paths, notes, cpu, types, weights = options.paths, options.notes, options.cpu, options.types, options.weights
    if not paths:
        raise EngineFailure(f"no way to run this model with weights: {s.weights}, activations: {s.activations}, "
                            f"quant_kernels: {s.quant_kernels} here" + (f" ({'; '.join(notes)})" if notes else ""))
    setting = f"{weights}/{s.activations}/{s.quant_kernels}/{s.dtype}"
    fmt = next((p.weights for p in paths if p.quantized), None)
    record = None
    if len(paths) == 1:
        chosen, how = paths[0], "engine settings"
    else:
        digest = _digest(path, cache_dir)
        threads = torch.get_num_threads()
        if cpu is not None and cache_dir is not None and not remeasure:
            record = path_choice.load_record(path_choice.record_path(cache_dir, digest, cpu.key()))
            if record is not None and not record.matches(digest, cpu.key(), setting, s.kv_slots, threads,
                                                         path_build.versions()):
                record = None
        if record is None:
            blocks = load_weights(path, torch.float32, fmt, cache_dir)
            inputs = path_build.Inputs(path, digest, blocks.config, blocks.tensors, fmt, blocks.tokenizer,
                                       s.kv_slots, threads, kernel_dir)
            record = path_build.decide(inputs, paths, setting, cpu, measure=measure or path_choice.measure, kl=kl,
                                       dense_loader=lambda dtype: load_weights(path, dtype).tensors,
                                       record_dir=cache_dir)
            del blocks, inputs
        chosen = path_choice.PathName.parse(record.chosen)
        how = f"auto, {record.summary()}"
        for reason in sorted(set(record.unavailable.values())):  # e.g. one ISA's library failed to build
            if not any(reason in n for n in notes):
                notes.append(f"unavailable here: {reason}")
    if chosen.quantized:
        loaded = load_weights(path, torch.float32, chosen.weights, cache_dir)
        kernels = path_build.kernels_for(chosen, kernel_dir)
        model = LlamaModel(loaded.config, loaded.tensors, cpu_kernels=kernels)
        label = f"{quant.describe(loaded.tensors)}/{chosen.activations if kernels else 'torch-int4'}"
        engine = str(chosen) if kernels else f"{chosen} (torch's int4 op)"
        config, tokenizer, version = loaded.config, loaded.tokenizer, loaded.version
        compute = "float32"
    else:
        dense = load_weights(path, getattr(torch, chosen.weights))
        model = LlamaModel(dense.config, dense.tensors, dtype=getattr(torch, chosen.weights))
        label = chosen.weights
        engine = f"{chosen} dense" + (f" (the file's {'+'.join(sorted(set(types.values())))} dequantised)"
                                      if types else "")
        config, tokenizer, version = dense.config, dense.tokenizer, dense.version
        compute = chosen.weights
    backend = f"cpu {label}: {engine} ({how})" + "".join(f"; {n}" for n in notes)
    return WeightPlan(model, config, tokenizer, version, backend, label, chosen.quantized, compute, record)


def _digest(path: Path, cache_dir: Path | None) -> str:
    from loader.file_digest import content_digest
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return content_digest(files, cache_dir)
