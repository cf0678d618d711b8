"""Shared helpers of the kernel tests: dtypes the interpreter runs, and tolerances per dtype.

bf16: the Triton interpreter rounds bf16 its own way (differences of one bf16 ulp were seen against torch), so bf16
is compared at a few ulps; on a GPU bench/gpu_kernels.py checks the same ops natively.
"""
import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Max abs error relative to the reference's scale (at least 1)."""
    assert got.shape == want.shape, what
    assert torch.isfinite(got.float()).all(), f"{what}: non-finite values"
    scale = max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:g} > {TOL[dtype] * scale:g} ({dtype})"


dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
