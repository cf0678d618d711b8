"""Which implementation an op runs: the Triton kernel or its torch twin.

"auto": Triton when the tensors are on a CUDA device and triton is installed, else the twin. "torch": always the twin.
"triton": always the kernel; on CPU tensors only when the Triton interpreter is on (TRITON_INTERPRET=1, which must be
set before the first kernel module is imported), otherwise a clear KernelUnavailable. Nothing here imports triton or
touches CUDA: importing `kernels` works on any machine.
"""
from __future__ import annotations

import importlib.util
import os

import torch

KERNEL_BACKENDS = ("auto", "triton", "torch")


class KernelUnavailable(RuntimeError):
    """The Triton path was forced where it cannot run."""


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(backend: str, device: torch.device) -> bool:
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "torch":
        return False
    if not triton_installed():
        if backend == "triton":
            raise KernelUnavailable("kernel backend 'triton' was asked for, but triton is not installed")
        return False
    if device.type == "cuda":
        return True
    if backend == "triton":
        if interpreter_on():
            return True
        raise KernelUnavailable("kernel backend 'triton' on CPU tensors needs the Triton interpreter "
                                "(TRITON_INTERPRET=1 before the first kernel is imported)")
    return False


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Kernels multiply in fp32 for fp32 inputs, and always under the interpreter: its tl.dot on bf16 returns
    garbage (measured, FIELD-NOTES). On a GPU fp16/bf16 operands go to the tensor cores with fp32 accumulation."""
    return dtype == torch.float32 or interpreter_on()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
