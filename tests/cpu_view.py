"""Prints, as JSON, what a process sees of this machine's CPU and memory and what the appliance chooses from it:
torch's CPU capability, whether our AVX2 kernels may run, the weight format(s) `weights: auto` may give the demo
language model, and the memory figures the KV-cache check reads. tests/test_systemd_unit.py runs it in a plain shell and
under a /proc mounted with the unit's own ProtectProc= / ProcSubset= values, and compares.

    python tests/cpu_view.py CACHE_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from appliance.config.builtin import resolve_builtin
from appliance.engine.llm_settings import GenerativeSettings


def weights_choice(cache: Path) -> dict:
    """What the loader may choose for the demo model's `weights: auto` on this CPU, and from which CPU facts."""
    settings = GenerativeSettings(cpu_kernel_dir=str(cache / "kernels"), weight_cache_dir=str(cache / "weights"))
    path = resolve_builtin("smollm2")
    try:  # a single choice from torch's capability and our AVX2 kernels
        from appliance.engine.llm_loading import cpu_quant_kernels, torch_quantized_ops_are_fast, weight_format
        from kernels.cpu_quant import cpu_has_avx2
    except ImportError:  # the paths this CPU allows (cpuid), among which a first load measures and chooses
        return paths_choice(path, settings)
    kernels = cpu_quant_kernels(settings, "cpu")
    fast = kernels is not None or torch_quantized_ops_are_fast()
    quantized, compute = weight_format("auto", "auto", path, "cpu", Path(settings.weight_cache_dir),
                                       fast_quantized=fast)
    return {"avx2": cpu_has_avx2(), "weights": quantized or compute, "cpu_kernels": kernels is not None}


def paths_choice(path: Path, s: GenerativeSettings) -> dict:
    from appliance.engine.weight_plan import HEAD_GGUF_NAMES
    from kernels import cpu_quant
    from models import path_choice, quant
    from models.weight_cache import gguf_tensor_types
    types = gguf_tensor_types(path, Path(s.weight_cache_dir))
    try:
        isas = cpu_quant.cpu_info(Path(s.cpu_kernel_dir)).isas
    except cpu_quant.KernelsUnavailable:
        isas = []
    layers = {t for name, t in types.items() if name not in HEAD_GGUF_NAMES}
    paths = path_choice.candidates("auto", s.activations, s.quant_kernels, isas, layers, quant.FOUR_BIT)
    return {"avx2": "avx2" in isas, "weights": sorted(str(p) for p in paths), "cpu_kernels": bool(isas)}


def meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("MemTotal:",
                                                                                                "MemAvailable:"))}
    except OSError:
        return {}


def main(cache: Path) -> None:
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), **weights_choice(cache),
                      "cpuinfo_readable": Path("/proc/cpuinfo").exists(), "meminfo": meminfo()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
