"""Prints, as JSON, what a process sees of this machine's CPU and memory and what the appliance chooses from it:
torch's CPU capability, whether our AVX2 kernels may run, the weight format `weights: auto` gives the demo language
model, and the memory figures the KV-cache check reads. tests/test_systemd_unit.py runs it in a plain shell and
under a /proc mounted with the unit's own ProtectProc= / ProcSubset= values, and compares.

    python tests/cpu_view.py CACHE_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from appliance.config.builtin import resolve_builtin
from appliance.engine.llm_loading import cpu_quant_kernels, torch_quantized_ops_are_fast, weight_format
from appliance.engine.llm_settings import GenerativeSettings
from kernels.cpu_quant import cpu_has_avx2


def meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("MemTotal:",
                                                                                                "MemAvailable:"))}
    except OSError:
        return {}


def main(cache: Path) -> None:
    # the choice load_engine makes for a CPU model: our kernels where torch's quantized ops are slow, then the format
    kernels = cpu_quant_kernels(GenerativeSettings(cpu_kernel_dir=str(cache / "kernels")), "cpu")
    fast = kernels is not None or torch_quantized_ops_are_fast()
    quantized, compute = weight_format("auto", "auto", resolve_builtin("smollm2"), "cpu", cache / "weights",
                                       fast_quantized=fast)
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "avx2": cpu_has_avx2(),
                      "weights": quantized or compute, "cpu_kernels": kernels is not None,
                      "cpuinfo_readable": Path("/proc/cpuinfo").exists(), "meminfo": meminfo()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
