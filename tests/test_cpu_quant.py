"""Our AVX2 quantized matmuls (kernels/cpu/quant_matmul.c through kernels/cpu_quant.py) against the same matrices
dequantised to fp32, and how the library is built, cached and refused."""
from __future__ import annotations

import subprocess

import pytest
import torch

from appliance.engine.llm_loading import cpu_quant_kernels, weight_format
from appliance.engine.llm_settings import GenerativeSettings
from kernels import cpu_quant
from models import quant


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    built = cpu_quant.library(tmp_path_factory.mktemp("kernels"))
    if built is None:
        pytest.skip("our AVX2 kernels are not available here: the CPU has no AVX2 or there is no C compiler")
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16, 19])
@pytest.mark.parametrize("n, k", [(96, 64), (33, 32), (7, 160)])
def test_kernels_match_the_dequantised_matmul(lib, rows, n, k):
    """Row tiles of 1-6 rows and how rows split into them, panels of 8 outputs one and four at a time and a last
    partial panel (odd output counts), one and several blocks."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g) * 3
    for fmt in quant.FORMATS:
        m = quant.quantize(w, fmt)
        ref = x.double() @ quant.dequantize(m).double().t()
        out = quant.linear_for(m, lib)(x).double()
        assert out.shape == (rows, n)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), (fmt, (out - ref).abs().max().item())
        if n % 16 == 0:  # torch's int4 packing wants N in 16s; where it runs, the same numbers within fp32 rounding
            torch_ops = quant.linear_for(m)(x).double()
            assert torch.allclose(out, torch_ops, rtol=1e-4, atol=1e-3), fmt


def test_int4_blocks_keep_q4_0_and_q4_1_numbers(lib):
    """Q4_1 (w = d q + m) and Q4_0 (m = -8 d, zero 0 in our int4 form) blocks, bias added after."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (40, 96), generator=g, dtype=torch.uint8)
    scale = torch.rand(40, 3, generator=g) * 0.1
    for zero in (torch.zeros(40, 3), torch.randn(40, 3, generator=g) * 0.05):
        m = quant.Int4Groups(q, scale, zero)
        x = torch.randn(3, 96, generator=g)
        bias = torch.randn(40, generator=g)
        ref = x @ quant.dequantize(m).t() + bias
        assert torch.allclose(quant.linear_for(m, lib)(x, bias), ref, rtol=1e-5, atol=1e-4)


def test_a_batch_gives_each_row_what_it_gives_alone(lib):
    """Rows do not interact: the tile a row falls in does not change its sums' order (batch invariance)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(76, 128, generator=g)  # 9 whole panels and a partial one
    x = torch.randn(13, 128, generator=g)  # tiles of 5, 4 and 4 rows; alone, a row is a 1x4 tile
    for fmt in quant.FORMATS:
        linear = quant.linear_for(quant.quantize(w, fmt), lib)
        together = linear(x)
        for i in range(13):
            assert torch.equal(linear(x[i:i + 1])[0], together[i]), (fmt, i)


def test_the_library_is_built_once_per_directory_and_reused(tmp_path):
    first = cpu_quant.library(tmp_path)
    if first is None:
        pytest.skip("our AVX2 kernels are not available here")
    built = list(tmp_path.glob("quant_matmul-*.so"))
    assert len(built) == 1 and cpu_quant.library(tmp_path) is first
    cpu_quant._loaded.clear()  # a new process: the built file is loaded, not compiled again
    mtime = built[0].stat().st_mtime_ns
    assert cpu_quant.library(tmp_path) is not None and built[0].stat().st_mtime_ns == mtime


def test_no_compiler_means_torch_ops_and_a_logged_reason(tmp_path, monkeypatch, caplog):
    if not cpu_quant.cpu_has_avx2():
        pytest.skip("no AVX2: the compiler is never looked for")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # and no gcc either
    with caplog.at_level("WARNING"):
        assert cpu_quant.library(tmp_path / "build") is None
    assert "no C compiler" in caplog.text
    monkeypatch.setenv("APPLIANCE_CPU_KERNELS", "0")
    assert cpu_quant.library(tmp_path / "other") is None


def test_kernels_are_not_used_on_a_gpu_or_with_fast_torch_ops(monkeypatch, tmp_path):
    settings = GenerativeSettings(cpu_kernel_dir=str(tmp_path))
    assert cpu_quant_kernels(settings, "cuda:0") is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_quant_kernels(settings, "cpu") is None


def test_auto_keeps_a_q4_file_quantized_only_where_quantized_matmuls_are_fast(tmp_path):
    from test_gguf import write_tiny_gguf
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, tied=False)
    assert weight_format("auto", "auto", path, "cpu", tmp_path / "c", fast_quantized=True) == ("int4", "float32")
    assert weight_format("auto", "auto", path, "cpu", tmp_path / "c", fast_quantized=False) == (None, "float32")


def test_a_library_shipped_beside_the_source_needs_no_compiler(tmp_path, monkeypatch):
    """The Debian package builds it at package time (python -m kernels.cpu_quant); the box may have no cc."""
    if not cpu_quant.cpu_has_avx2():
        pytest.skip("no AVX2: the library is never looked for")
    source = tmp_path / "src" / "quant_matmul.c"
    source.parent.mkdir()
    source.write_bytes(cpu_quant.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_quant, "SOURCE", source)
    try:
        shipped = cpu_quant.build(source.parent)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no C compiler here to make the package's library")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler from here on
    lib = cpu_quant.library(tmp_path / "state-cache")
    assert lib is not None and lib._name == str(shipped) and not (tmp_path / "state-cache").exists()
