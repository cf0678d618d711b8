"""Which path runs: the twin on CPU, the kernel on CUDA or when forced under the interpreter; importing kernels
never imports triton."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.dispatch import KernelUnavailable, use_triton

ROOT = Path(__file__).resolve().parents[1]


def test_auto_on_cpu_runs_the_twins_and_never_imports_triton():
    code = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch, kernels
x = torch.randn(2, 64); r = torch.randn(2, 64)
kernels.add_rms_norm(x, r, torch.ones(64), 1e-5)
kernels.silu_mul(torch.randn(2, 8))
kc = torch.zeros(2, 1, 8, 64)
kernels.decode_attention(torch.randn(1, 2, 64), kc, kc, torch.tensor([1]), torch.tensor([3]))
kernels.group_matmul(x, kernels.pack_int4(torch.zeros(4, 64, dtype=torch.uint8)), torch.ones(4, 2), bits=4, group=32)
print("triton" in sys.modules, torch.cuda.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailable, match="TRITON_INTERPRET=1"):
        kernels.silu_mul(torch.randn(2, 8), backend="triton")
    assert use_triton("auto", torch.device("cpu")) is False
    assert use_triton("auto", torch.device("cuda", 0)) is True  # a CUDA tensor takes the kernel
    assert use_triton("torch", torch.device("cuda", 0)) is False  # the YAML can force the twin anywhere
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", torch.device("cpu")) is True


def test_without_triton_installed(monkeypatch):
    monkeypatch.setattr("kernels.dispatch.triton_installed", lambda: False)
    assert use_triton("auto", torch.device("cuda", 0)) is False
    with pytest.raises(KernelUnavailable, match="not installed"):
        use_triton("triton", torch.device("cuda", 0))


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'cuda'.*auto, triton, torch"):
        kernels.silu_mul(torch.randn(2, 8), backend="cuda")


def test_layering_models_and_kernels_import_nothing_from_appliance_and_kernels_nothing_from_models():
    """kernels/ <- models/ <- appliance/: the engine's layers, checked on every import statement (ast). (The
    scripts under models/te_classifier/ that train and evaluate the classifier are not engine modules.)"""
    import ast

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        return names

    for package, forbidden in (("models", {"appliance", "uaserver"}), ("kernels", {"appliance", "uaserver", "models"})):
        for path in sorted((ROOT / package).glob("*.py")):
            assert not imported(path) & forbidden, f"{path.relative_to(ROOT)} imports {imported(path) & forbidden}"
