"""Prints, as JSON, what a process sees of this machine's CPU and memory and what the appliance chooses from it:
torch's CPU capability, whether our AVX2 kernels may run, the weight paths `weights: auto` chooses among for the demo
language model (the loader's own appliance.engine.llm.weight_plan.cpu_paths: an import that fails fails the run, never a
fallback of its own), and the memory figures the KV-cache check reads. tests/test_systemd_unit.py runs it in a plain shell and
under a /proc mounted with the unit's own ProtectProc= / ProcSubset= values, and compares.

    python tests/cpu_view.py CACHE_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from core.config.builtin import resolve_builtin
from appliance.engine.llm.settings import GenerativeSettings
from appliance.engine.llm.weight_plan import cpu_paths


def weights_choice(cache: Path) -> dict:
    """The paths the loader chooses among for the demo model's `weights: auto` on this CPU (its own function: the
    kernels' ISAs from cpuid, the file's tensor types); a first load measures them and keeps the fastest."""
    settings = GenerativeSettings(cpu_kernel_dir=str(cache / "kernels"), weight_cache_dir=str(cache / "weights"))
    options = cpu_paths(resolve_builtin("smollm2"), settings)
    isas = options.cpu.isas if options.cpu is not None else []
    return {"avx2": "avx2" in isas, "weights": sorted(str(p) for p in options.paths),
            "cpu_kernels": any(p.quantized and p.kernels != "torch" for p in options.paths)}


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
