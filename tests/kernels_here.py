"""Our CPU kernels as the tests get them: a skip only where this CPU lacks the instructions (the skip names them);
anything else that keeps them from running here (no compiler, a library that does not compile or load, torch
operators that do not build) fails the test, so a broken build never passes as a skip."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels import cpu_build, cpu_isa, cpu_quant


def cpu_here(build_dir: Path | None = None) -> cpu_isa.CpuInfo:
    """This CPU from cpuid; a skip on a CPU that is not x86-64, a failure where the cpuid probe does not build."""
    try:
        return cpu_isa.cpu_info(build_dir)
    except cpu_build.KernelsUnavailable as exc:
        if "x86-64" in str(exc):
            pytest.skip(str(exc))
        pytest.fail(f"our kernels' cpuid probe cannot run here: {exc}")


def runnable_isas(build_dir: Path | None = None) -> list[str]:
    """The ISAs this CPU runs (the avxvnni stand-in included), fastest first; a skip naming what the CPU lacks when
    it runs none, or when APPLIANCE_CPU_KERNELS=0 switches them off."""
    info = cpu_here(build_dir)
    _info, _isas, why = cpu_isa.usable_isas(build_dir)
    if why is not None:
        pytest.skip(f"{info.described}: {why}")
    return [isa for isa in cpu_build.ISAS if isa in info.isas or info.stands_in(isa)]


def runnable_kernels(activations: str = "int8", build_dir: Path | None = None,
                     torch_ops: bool = False) -> dict[str, cpu_quant.CpuKernels]:
    """Every ISA's kernels this CPU runs, by ISA; with torch_ops, their torch operators must have built too."""
    out = {}
    for isa in runnable_isas(build_dir):
        try:
            out[isa] = cpu_quant.kernels(isa, activations, build_dir)
        except cpu_build.KernelsUnavailable as exc:
            pytest.fail(f"our {isa} kernels, which this CPU runs, are not available: {exc}")
    if torch_ops:
        require_torch_ops(next(iter(out.values())))
    return out


def best_kernels(activations: str = "int8", build_dir: Path | None = None,
                 torch_ops: bool = False) -> cpu_quant.CpuKernels:
    """The kernels of the fastest ISA this CPU runs (cpu_quant.best's choice)."""
    runnable_isas(build_dir)  # skips where the CPU runs none
    isa = cpu_here(build_dir).isas[0]
    try:
        kern = cpu_quant.kernels(isa, activations, build_dir)
    except cpu_build.KernelsUnavailable as exc:
        pytest.fail(f"our {isa} kernels, which this CPU runs, are not available: {exc}")
    if torch_ops:
        require_torch_ops(kern)
    return kern


def require_torch_ops(kern: cpu_quant.CpuKernels) -> None:
    if not kern.op:
        pytest.fail("our kernels' torch operators (kernels/cpu/quant_op.cpp) did not build; the log says why")
