"""Our CPU quantized matmuls (kernels/cpu/quant_*.c through kernels/cpu_quant.py) and their weight layout
(kernels/cpu_layout.py): every GGUF block type laid out and read back exactly as gguf dequantizes it, each ISA's
kernels against the matmul they stand for, the same bits from every ISA, batch invariance, and how the libraries
are found, built, cached and refused."""
from __future__ import annotations

import shutil
import subprocess

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_build, cpu_isa, cpu_layout, cpu_quant
from kernels.cpu_layout import random_blocks
from kernels_here import best_kernels, cpu_here, runnable_isas, runnable_kernels
from models import quant

TYPES = list(cpu_layout.FORMATS)


def gguf_dequantized(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(n, k).astype(np.float32)


@pytest.fixture(scope="module")
def isas(tmp_path_factory):
    """Every ISA's kernels this CPU runs (int8 mode); a skip only where it runs none (kernels_here)."""
    return runnable_kernels("int8", tmp_path_factory.mktemp("kernels"))


# ---- the layout ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k", [(16, 256), (37, 512), (5, 256)])
def test_layout_reads_back_gguf_numbers_exactly(name, n, k):
    """Random blocks of every type, laid out for the kernels: numpy's reading of the layout, the kernels' own
    (rows()), and unpack/pack all give gguf's dequantization to the bit (sign of zero aside)."""
    raw = random_blocks(name, n, k, seed=n + k)
    ref = gguf_dequantized(raw, name, n, k)
    data = cpu_layout.from_gguf(raw, name, n, k)
    assert data.shape == (-(-n // 16), k // cpu_layout.FORMATS[name].super_block,
                          cpu_layout.FORMATS[name].record_bytes)
    np.testing.assert_array_equal(cpu_layout.dequantize(data, name, n, k), ref)
    np.testing.assert_array_equal(cpu_layout.pack(cpu_layout.unpack(data, name, n, k), name, n, k), data)
    rows = np.array([0, n - 1, n // 2, 3 % n])
    np.testing.assert_array_equal(cpu_layout.panel_rows(data, name, n, k, rows), ref[rows])
    m = quant.BlockMatrix.from_layout(name, (n, k), data)
    np.testing.assert_array_equal(m.dequantize().numpy(), ref)


@pytest.mark.parametrize("name", TYPES)
def test_the_kernels_rows_are_gguf_numbers(isas, name):
    n, k = 40, 512
    raw = random_blocks(name, n, k, seed=7)
    m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(raw, name, n, k))
    ids = torch.tensor([0, 39, 17, 17, 5])
    for kern in isas.values():
        np.testing.assert_array_equal(m.rows(ids, kern).numpy(), gguf_dequantized(raw, name, n, k)[ids.numpy()])


def test_views_for_torch_and_triton_hold_the_same_numbers():
    n, k = 32, 256
    for name in ("Q4_0", "Q4_1", "Q4_K"):
        m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(random_blocks(name, n, k, 3), name, n, k))
        q, scale, zero = m.int4_groups()
        w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
        torch.testing.assert_close(w, m.dequantize(), rtol=1e-6, atol=1e-6)
    m = quant.BlockMatrix.from_layout("Q8_0", (n, k), cpu_layout.from_gguf(random_blocks("Q8_0", n, k, 4), "Q8_0", n, k))
    q, scale = m.int8_blocks()
    torch.testing.assert_close(q.float() * scale.repeat_interleave(32, 1), m.dequantize(), rtol=0, atol=0)


# ---- the kernels ---------------------------------------------------------------------------------------------------

BF16_ROWS = 32  # from this many rows AMX multiplies in bf16 (kernels/cpu/quant_amx.c, BF16_MIN_ROWS)


def bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What AMX's bf16 tiles compute: activations and dequantized weights rounded to bf16, multiplied exactly."""
    return x.bfloat16().double() @ w.bfloat16().double().t()


def int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the int8 mode computes: each activation row quantized per block of 32 (scale amax / 127, rounded to
    nearest even), multiplied exactly (float64) by the dequantized weights."""
    rows, k = x.shape
    xb = x.double().view(rows, k // 32, 32)
    d = (xb.abs().amax(-1) / 127).float().double()
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return (q * d[..., None]).view(rows, k) @ w.double().t()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 13, 35])
def test_kernels_match_the_matmul_they_stand_for(isas, name, rows):
    """Row tiles of 1-4 rows and their remainders, tiles of 1, 2 and 4 vector columns, 16-row AMX tiles with vector
    tiles for the rest, a last partial panel, one and several super-blocks: int8 mode against the int8 reference
    (AMX from 32 rows: its bf16 tiles against the bf16 reference), float32 mode against the exact matmul."""
    for n, k in [(48, 256), (37, 512), (130, 256)]:
        raw = random_blocks(name, n, k, seed=rows * 100 + n)
        m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(raw, name, n, k))
        w = m.dequantize()
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n + rows)) * 2
        exact = x.double() @ w.double().t()
        approx, approx_bf16 = int8_reference(x, w), bf16_reference(x, w)
        for isa, kern in isas.items():
            got8 = quant.linear_for(m, kern)(x).double()
            got32 = quant.linear_for(m, kern.with_activations("float32"))(x).double()
            scale = exact.abs().max()
            assert got8.shape == (rows, n) and got32.shape == (rows, n)
            if isa == "amx" and rows >= BF16_ROWS:
                assert (got8 - approx_bf16).abs().max() <= 2e-6 * scale, (isa, name, n, k)
            else:
                assert (got8 - approx).abs().max() <= 2e-6 * scale, (isa, name, n, k)
            assert (got32 - exact).abs().max() <= 2e-6 * scale, (isa, name, n, k)


@pytest.mark.parametrize("name", TYPES)
def test_every_isa_gives_the_same_bits(isas, name):
    """Integer dot products are exact and the float steps the same: AVX2, AVX-VNNI, AVX-512 VNNI and AMX (its
    16-row tiles and the vector tiles for the rest) agree to the bit in int8 mode below 32 rows (so the measured
    choice among them, made on decode steps, is a matter of speed only; AMX's bf16 tiles from 32 rows are tested
    below)."""
    if len(isas) < 2:
        pytest.skip("one ISA here")
    n, k = 70, 512
    m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(random_blocks(name, n, k, 11), name, n, k))
    x = torch.randn(BF16_ROWS - 1, k, generator=torch.Generator().manual_seed(1))
    outs = {isa: quant.linear_for(m, kern)(x) for isa, kern in isas.items()}
    first = next(iter(outs.values()))
    for isa, y in outs.items():
        assert torch.equal(y, first), isa


@pytest.mark.parametrize("name", TYPES)
def test_amx_tiles_give_the_vector_tiles_bits(isas, name):
    """AMX's 16-row tiles (a panel unpacked while the one before multiplies, four tile products in flight, Q6_K in
    half blocks) against avx512vnni bit for bit: 16 rows and the remainders past them, one panel and many (each
    thread's first and later ones), a last partial panel, block counts that are not a multiple of the four in
    flight, one thread and two."""
    if "amx" not in isas or "avx512vnni" not in isas:
        pytest.skip("no AMX here")
    sb = cpu_layout.FORMATS[name].super_block
    shapes = [(16, 256), (70, 512), (33, 3 * sb if sb > 32 else 576), (200, 7 * sb if sb > 32 else 224)]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n, k in shapes:
                raw = random_blocks(name, n, k, seed=n * 7 + k)
                m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(raw, name, n, k))
                for rows in (16, 17, 31):
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n)) * 3
                    got = quant.linear_for(m, isas["amx"])(x)
                    want = quant.linear_for(m, isas["avx512vnni"])(x)
                    assert torch.equal(got, want), (name, n, k, rows, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", TYPES)
def test_amx_bf16_tiles_for_prefill_rows(isas, name):
    """From 32 rows AMX multiplies in bf16 (weights dequantized per panel, activations rounded, tdpbf16ps): against
    the bf16 reference on shapes that take every edge of its blocking (rows not a multiple of 32 and past the
    256-row block, inputs past the 2,048-input block so the sums go round through y, an odd panel count and a
    partial last panel), one thread and two; and a row's result is the same in any batch of 32 rows or more."""
    if "amx" not in isas:
        pytest.skip("no AMX here")
    sb = cpu_layout.FORMATS[name].super_block
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n, k, rows in [(70, 512, 32), (40, 4096, 45), (16, 2 * sb if sb > 32 else 64, 300), (200, 2304, 64)]:
                raw = random_blocks(name, n, k, seed=n + k + rows)
                m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(raw, name, n, k))
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)) * 3
                got = quant.linear_for(m, isas["amx"])(x)
                want = bf16_reference(x, m.dequantize())
                scale = want.abs().max()
                assert (got.double() - want).abs().max() <= 2e-6 * scale, (name, n, k, rows, t)
                assert torch.equal(quant.linear_for(m, isas["amx"])(x[rows - BF16_ROWS:]), got[rows - BF16_ROWS:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["int8", "float32"])
def test_a_batch_gives_each_row_what_it_gives_alone(isas, mode):
    """A row's result does not depend on the rows batched with it (tiles keep each row's order of sums)."""
    for name in TYPES:
        n, k = 76, 512
        m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(random_blocks(name, n, k, 5), name, n,
                                                                               k))
        x = torch.randn(21, k, generator=torch.Generator().manual_seed(9))
        for kern in isas.values():
            linear = quant.linear_for(m, kern.with_activations(mode))
            together = linear(x)
            for i in range(21):
                assert torch.equal(linear(x[i:i + 1])[0], together[i]), (name, mode, kern.isa, i)


@pytest.mark.parametrize("name", TYPES)
def test_the_many_row_gemm_gives_the_one_row_kernel_s_bits(isas, name):
    """From 8 rows a call unpacks each weight panel once and runs every row tile over that copy (unpack_panel /
    gemm_tile, AVX2's int16 sums); fewer rows keep the vector tiles. Integer sums are exact and the float steps the
    same, in the same order: each of 2-16 rows (every tile height and remainder, both paths) gets the bits the 1-row
    kernel gives it, on a partial last panel, a panel split between threads, one or several super-blocks, and inputs
    past the GEMM's chunk of 32 blocks (its sums carried from one chunk to the next; the last chunk short)."""
    sb = cpu_layout.FORMATS[name].super_block
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n, k in [(37, 2 * sb if sb > 32 else 96), (130, sb if sb > 32 else 576),
                         (21, 9 * sb if sb > 32 else 2080)]:
                raw = random_blocks(name, n, k, seed=n + k + t)
                m = quant.BlockMatrix.from_layout(name, (n, k), cpu_layout.from_gguf(raw, name, n, k))
                x = torch.randn(16, k, generator=torch.Generator().manual_seed(n)) * 3
                for kern in isas.values():
                    linear = quant.linear_for(m, kern)
                    alone = torch.cat([linear(x[i:i + 1]) for i in range(16)])
                    for rows in range(2, 17):
                        assert torch.equal(linear(x[:rows]), alone[:rows]), (name, kern.isa, n, k, rows, t)
    finally:
        torch.set_num_threads(threads)


def test_activations_are_quantized_as_llama_cpp_does(isas):
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)) * 5
    x[1, :32] = 0.0  # an all-zero block: scale 0, q 0
    x[2, 40] = 300.0  # an outlier owning its block
    d_ref = x.view(3, 4, 32).abs().amax(-1) / 127
    inv = torch.where(d_ref != 0, 1.0 / d_ref, torch.zeros_like(d_ref))
    q_ref = torch.round(x.view(3, 4, 32) * inv[..., None]).to(torch.int8).view(3, 128)
    for kern in isas.values():
        q, d, sums = cpu_quant.quantize_activations(kern, x)
        assert torch.equal(d, d_ref) and torch.equal(q, q_ref), kern.isa
        assert torch.equal(sums, q_ref.view(3, 8, 16).sum(-1, dtype=torch.int32))


def test_q8_0_weights_at_the_int8_extremes(isas):
    """AVX2 multiplies Q8_0's signed weights with llama.cpp's sign trick: -128 and 127 against +-127."""
    n, k = 16, 64
    raw = random_blocks("Q8_0", n, k, 13).reshape(-1, 34)
    raw[:, 2:] = np.where(np.arange(32) % 2, 0x80, 0x7F).astype(np.uint8)  # -128, 127, ...
    m = quant.BlockMatrix.from_layout("Q8_0", (n, k), cpu_layout.from_gguf(raw.reshape(n, -1), "Q8_0", n, k))
    x = torch.full((2, k), 1.0)
    x[1] = -1.0
    for kern in isas.values():
        torch.testing.assert_close(quant.linear_for(m, kern)(x).double(), int8_reference(x, m.dequantize()),
                                   rtol=1e-6, atol=1e-6)


# ---- the CPU's features and the libraries ---------------------------------------------------------------------

def test_features_come_from_cpuid_and_agree_with_the_kernel_s_view():
    """cpuid, not /proc/cpuinfo (a hardened unit may hide it); here both are visible, so they must agree."""
    info = cpu_here()
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    names = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
             "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni", "amx_int8": "amx_int8"}
    for ours, linux in names.items():
        assert (ours in info.features) == (linux in flags), ours
    assert info.brand and len(info.key()) == 16


def test_an_isa_the_cpu_lacks_is_refused_with_the_reason(monkeypatch):
    real = cpu_here()
    monkeypatch.setattr(cpu_isa, "_cpu", [cpu_isa.CpuInfo(real.brand, frozenset({"avx2", "fma", "f16c",
                                                                                       "os_avx"}))])
    with pytest.raises(cpu_build.KernelsUnavailable, match="avx512vnni"):
        cpu_quant.kernels("avx512vnni")
    monkeypatch.setattr(cpu_isa, "_cpu", [cpu_isa.CpuInfo(real.brand, frozenset())])
    assert cpu_quant.library() is None


def test_a_library_is_built_once_per_directory_and_reused(tmp_path, isas, monkeypatch):
    monkeypatch.setattr(cpu_build, "default_build_dir", lambda: tmp_path / "user-cache")
    isa = next(iter(isas))
    first = cpu_quant.kernels(isa, "int8", tmp_path)
    built = list(tmp_path.glob(f"quant_{isa}-*.so"))
    if not built:
        pytest.skip("the library ships prebuilt beside its source here")
    mtime = built[0].stat().st_mtime_ns
    again = cpu_quant.kernels(isa, "int8", tmp_path)
    assert again.path == first.path and built[0].stat().st_mtime_ns == mtime
    assert (tmp_path / "user-cache" / built[0].name).exists()  # shared with other state directories


def test_no_compiler_means_no_kernels_and_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path / "src")  # nothing prebuilt there
    (tmp_path / "src").mkdir()
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # and no gcc either
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    with pytest.raises(cpu_build.KernelsUnavailable, match="no C compiler"):
        cpu_isa.cpu_info(tmp_path / "build")
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    monkeypatch.setenv("APPLIANCE_CPU_KERNELS", "0")
    with pytest.raises(cpu_build.KernelsUnavailable, match="switched off"):
        cpu_quant.kernels("avx2")


def test_libraries_shipped_beside_the_sources_need_no_compiler(tmp_path, monkeypatch):
    """The Debian package builds them at package time (python -m kernels.cpu_build); the box may have no cc."""
    shipped = tmp_path / "src"
    shipped.mkdir()
    for f in cpu_build.SOURCE_DIR.iterdir():
        if f.suffix in (".c", ".h", ".cpp"):
            (shipped / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", shipped)
    runnable_isas()  # a skip only where this CPU runs none of them; a library that does not compile fails below
    built = cpu_build.build_all(shipped)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler from here on
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    kern = best_kernels("int8", tmp_path / "state-cache")
    assert kern.path in {str(p) for p in built} and not (tmp_path / "state-cache").exists()


def uncapped_cpu(monkeypatch) -> cpu_isa.CpuInfo:
    """This CPU as cpuid reports it (no APPLIANCE_CPU_ISA cap), read afresh; a skip where our kernels cannot run."""
    monkeypatch.delenv(cpu_isa.ISA_CAP_ENV, raising=False)
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    return cpu_here()


@pytest.mark.parametrize("cap", ["none", "avx2", "avxvnni", "avx512vnni"])
def test_a_cap_hides_instructions_and_never_lends_one(monkeypatch, cap):
    """APPLIANCE_CPU_ISA=<isa> (bench/generate.py --isa, tests) makes our kernels see a CPU whose best is <isa>:
    the real features intersected with that ISA's, so the choice never picks a path the running CPU lacks. The one
    stand-in: capped to avxvnni, a CPU with AVX-512 VNNI but no AVX-VNNI (this EPYC) runs the avxvnni kernels with
    vpdpbusd EVEX-encoded (the same instruction on the same ymm registers), and avx2."""
    real = uncapped_cpu(monkeypatch)
    monkeypatch.setenv(cpu_isa.ISA_CAP_ENV, cap)
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    capped = cpu_isa.cpu_info()
    assert capped.features <= real.features and capped.cap == cap
    order = list(cpu_build.ISAS)
    expected = [isa for isa in cpu_build.ISAS if order.index(isa) >= order.index(cap) and
                (isa in real.isas or (isa == cap and real.stands_in(isa)))] if cap != "none" else []
    assert capped.isas == expected
    assert capped.key() != real.key() or capped.features == real.features
    assert f"seen as {cap}" in capped.described
    for isa in set(cpu_build.ISAS) - set(capped.isas):
        if capped.stands_in(isa):  # not a choice under this cap, but runnable where a configuration names it
            assert cpu_quant.kernels(isa).isa == isa
            continue
        with pytest.raises(cpu_build.KernelsUnavailable, match=f"lacks {isa}"):
            cpu_quant.kernels(isa)
    if cap == "none":
        _info, isas, why = cpu_isa.usable_isas()
        assert isas == [] and "no AVX2" in why and "APPLIANCE_CPU_ISA=none" in why


def test_the_avxvnni_stand_in_is_the_same_instruction_on_256_bit_vectors(monkeypatch):
    """Where the CPU has AVX-512 VNNI but no AVX-VNNI, the avxvnni kernels (which every test of this module runs with
    the other ISAs, for the same bits) are the same source with vpdpbusd EVEX-encoded: its library multiplies with
    vpdpbusd on ymm registers and holds no zmm register, so it measures what an AVX-VNNI CPU's would run; `auto`
    never picks it over the CPU's own kernels, APPLIANCE_CPU_ISA=avxvnni does."""
    info = uncapped_cpu(monkeypatch)
    if not info.stands_in("avxvnni"):
        pytest.skip("no stand-in here: the CPU has AVX-VNNI itself, or no AVX-512 VNNI"
                    if "avxvnni" in info.features or not info.evex_vnni else "a cap hides VNNI")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the library's code")
    kern = cpu_quant.kernels("avxvnni")
    assert "avxvnni" not in info.isas and cpu_quant.best().isa != "avxvnni"
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", kern.path], capture_output=True, text=True,
                          check=True).stdout
    dots = [line for line in code.splitlines() if "vpdpbusd" in line]
    assert dots and all("%ymm" in line for line in dots)
    assert "%zmm" not in code
    monkeypatch.setenv(cpu_isa.ISA_CAP_ENV, "avxvnni")
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    assert cpu_isa.cpu_info().isas[0] == "avxvnni" and cpu_quant.best().path == kern.path


def test_an_unknown_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_CAP_ENV, "avx1024")
    monkeypatch.setattr(cpu_isa, "_cpu", [])
    with pytest.raises(cpu_build.KernelsUnavailable, match="APPLIANCE_CPU_ISA='avx1024'"):
        cpu_isa.cpu_info()
