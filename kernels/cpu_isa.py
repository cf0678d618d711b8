"""Which of our kernels' instruction sets this CPU runs, read from the cpuid instruction (kernels/cpu/
cpu_features.c, built by kernels/cpu_build.py), never from /proc/cpuinfo (a hardened systemd unit may hide it: torch
then reports no AVX at all) nor from the machine the package was built on. Every ISA's library computes the same
numbers in int8 mode below 32 rows (integer dot products are exact; the float steps are the same), so the choice among
them, made on decode steps, is a matter of speed alone. From 32 rows (a prefill chunk) AMX multiplies in bf16 instead
(weights dequantized once per panel, activations rounded to bf16, float sums in the tiles): 2-3x its int8 tiles there,
and nearer the exact product.

    ISA          instruction                         needs (cpuid + the OS's XCR0)
    amx          tdpbssd on 16-row tiles, else as    avx512vnni's + AVX-512 BF16, AMX tile, int8 and bf16, the
                 avx512vnni; tdpbf16ps from 32 rows  tile state granted
    avx512vnni   vpdpbusd, 16 outputs per vector     AVX-512 F/BW/VL/DQ + VNNI, F16C, FMA
    avxvnni      vpdpbusd (VEX), 8 per vector        AVX2 + AVX-VNNI, F16C, FMA
    avx2         maddubs + madd, 8 per vector        AVX2, F16C, FMA
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from kernels import cpu_build
from kernels.cpu_build import KernelsUnavailable

log = logging.getLogger(__name__)

# cpu_features() bits (kernels/cpu/cpu_features.c)
_BITS = ("avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni",
         "avx512bf16", "avx512fp16", "amx_tile", "amx_int8", "amx_bf16", "os_avx", "os_avx512", "os_amx")
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "fma", "f16c", "os_avx", "os_avx512"}
NEEDS = {
    "amx": _AVX512_NEEDS | {"avx512bf16", "amx_tile", "amx_int8", "amx_bf16", "os_amx"},
    "avx512vnni": _AVX512_NEEDS,
    "avxvnni": {"avx2", "avxvnni", "fma", "f16c", "os_avx"},
    "avx2": {"avx2", "fma", "f16c", "os_avx"},
}


# APPLIANCE_CPU_ISA caps what our kernels see of the CPU (`bench/generate.py --isa`, tests): the features of a CPU
# whose best is that ISA, intersected with the real ones, so a cap can only hide instructions, never lend one the
# CPU lacks. `none`: a CPU without AVX2 (Atom x6000, older Celeron).
ISA_CAP_ENV = "APPLIANCE_CPU_ISA"
_AVX2_SET = {"avx2", "fma", "f16c", "os_avx"}
_CAPS = {
    "none": {"fma", "f16c", "os_avx"},
    "avx2": _AVX2_SET,
    "avxvnni": _AVX2_SET | {"avxvnni"},
    "avx512vnni": _AVX2_SET | {"avxvnni"} | _AVX512_NEEDS | {"avx512bf16", "avx512fp16"},
    "amx": set(_BITS),
}


def isa_cap() -> str | None:
    """The ISA APPLIANCE_CPU_ISA caps our kernels to (None: the CPU's own); ValueError for an unknown name."""
    value = os.environ.get(ISA_CAP_ENV, "").strip()
    if not value or value == "native":
        return None
    if value not in _CAPS:
        raise ValueError(f"{ISA_CAP_ENV}={value!r}: one of native, {', '.join(_CAPS)}")
    return value


@dataclass(frozen=True)
class CpuInfo:
    brand: str
    features: frozenset[str]
    cap: str | None = None  # APPLIANCE_CPU_ISA's cap when these features were masked by it
    evex_vnni: bool = False  # the real CPU runs vpdpbusd on ymm registers EVEX-encoded (AVX-512 VNNI and VL)

    @property
    def described(self) -> str:
        """The brand, and the cap where one hides features ("AMD EPYC 9R14, seen as avx2 (APPLIANCE_CPU_ISA)")."""
        return self.brand + (f", seen as {self.cap} ({ISA_CAP_ENV})" if self.cap else "")

    @property
    def isas(self) -> list[str]:
        """Our kernels' ISAs this CPU (and its OS) can run, fastest first (the avxvnni stand-in only where
        APPLIANCE_CPU_ISA=avxvnni asks for an AVX-VNNI CPU)."""
        return [isa for isa in cpu_build.ISAS
                if NEEDS[isa] <= self.features or (self.cap == isa and self.stands_in(isa))]

    def stands_in(self, isa: str) -> bool:
        """Whether `isa` runs here as the EVEX stand-in (AVXVNNI_EVEX_FLAGS): avxvnni on a CPU without AVX-VNNI
        whose AVX-512 VNNI runs the same instruction, unless a cap hides VNNI."""
        return (isa == "avxvnni" and self.evex_vnni and "avxvnni" not in self.features and _AVX2_SET <= self.features
                and (self.cap is None or "avxvnni" in _CAPS[self.cap]))

    def library_stem(self, isa: str) -> str:
        return "quant_avxvnni_evex" if self.stands_in(isa) else f"quant_{isa}"

    @staticmethod
    def stand_in_text(isa: str) -> str:
        """What the log, `Backend` and the benchmarks say of the stand-in."""
        return (f"{isa} without AVX-VNNI here: its kernels run with vpdpbusd EVEX-encoded "
                "(AVX-512 VNNI on 256-bit registers)")

    def key(self) -> str:
        """The CPU model and features, for records that hold only on the same kind of CPU."""
        return hashlib.sha256(f"{self.brand}\0{sorted(self.features)}".encode()).hexdigest()[:16]


_lock = threading.Lock()
_cpu: list = []  # [CpuInfo | KernelsUnavailable], once per process


def cpu_info(build_dir: Path | None = None) -> CpuInfo:
    """This CPU's brand and features from cpuid (once per process); KernelsUnavailable where the probe cannot be
    built (no compiler and no prebuilt probe) or this is not an x86-64 CPU."""
    with _lock:
        cached = _cpu[0] if _cpu else None
    if isinstance(cached, CpuInfo):
        return cached
    if isinstance(cached, KernelsUnavailable):
        raise cached
    try:
        import platform
        if platform.machine() not in ("x86_64", "AMD64"):
            raise KernelsUnavailable(f"our kernels are for x86-64 CPUs, not {platform.machine()}")
        path = cpu_build.find_or_build("cpu_features", Path(build_dir or cpu_build.default_build_dir()))
        lib = ctypes.CDLL(str(path))
        bits = lib.cpu_features()
        brand = ctypes.create_string_buffer(49)
        lib.cpu_brand(brand)
        features = {name for i, name in enumerate(_BITS) if bits & (1 << i)}
        evex_vnni = {"avx512vnni", "avx512vl", "os_avx512"} <= features
        cap = isa_cap()
        if cap is not None:
            features &= _CAPS[cap]
        if {"amx_tile", "amx_int8", "os_amx"} <= features and lib.amx_request() != 0:
            features.discard("os_amx")  # the kernel refused the tile state to this process
        info: CpuInfo | KernelsUnavailable = CpuInfo(brand.value.decode(errors="replace").strip(),
                                                     frozenset(features), cap, evex_vnni)
    except ValueError as exc:
        info = KernelsUnavailable(str(exc))
    except KernelsUnavailable as exc:
        info = exc
    with _lock:
        _cpu[:] = [info]
    if isinstance(info, KernelsUnavailable):
        raise info
    return info


def usable_isas(build_dir: Path | None = None) -> tuple[CpuInfo | None, list[str], str | None]:
    """(this CPU, the ISAs our kernels may run on it, why none may): what a caller shows when it falls back."""
    try:
        info = cpu_info(build_dir)
    except KernelsUnavailable as exc:
        return None, [], str(exc)
    if os.environ.get("APPLIANCE_CPU_KERNELS", "1") == "0":
        return info, [], "our CPU kernels are switched off (APPLIANCE_CPU_KERNELS=0)"
    if not info.isas:
        masked = f", as {ISA_CAP_ENV}={info.cap} makes it look" if info.cap else ""
        return info, [], f"the CPU has no AVX2 with FMA and F16C (cpuid{masked})"
    return info, info.isas, None


def ensure_built(isas: list[str], build_dir: Path | None = None) -> None:
    """Build the libraries of `isas` that do not exist yet, together; a failure is left for `kernels` to report."""
    build_dir = Path(build_dir) if build_dir else cpu_build.default_build_dir()
    try:
        stems = [cpu_info(build_dir).library_stem(isa) for isa in isas]
    except KernelsUnavailable:
        return
    missing = [stem for stem in stems if cpu_build.find(stem, build_dir) is None]
    if isas and cpu_build.find("quant_op", build_dir) is None and cpu_build.compiler(True) is not None:
        missing.append("quant_op")
    if len(missing) > 1 and cpu_build.compiler() is not None:
        try:
            cpu_build.build_many(build_dir, missing)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building our kernels failed (%s); each is tried again on its own", exc)
