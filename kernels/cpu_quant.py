"""Our CPU quantized matmuls: one C source per instruction set (kernels/cpu/quant_<isa>.c over the shared
kernels/cpu/quant_kernels.h), built with the system C compiler at first use, cached, and called through ctypes.

Which instruction sets this CPU has comes from the cpuid instruction (kernels/cpu/cpu_features.c), never from
/proc/cpuinfo (a hardened systemd unit may hide it: torch then reports no AVX at all) nor from the machine the
package was built on. Every ISA's library computes the same numbers in int8 mode below 32 rows (integer dot products
are exact; the float steps are the same), so the choice among them, made on decode steps, is a matter of speed
alone. From 32 rows (a prefill chunk) AMX multiplies in bf16 instead (weights dequantized once per panel,
activations rounded to bf16, float sums in the tiles): 2-3x its int8 tiles there, and nearer the exact product.

    ISA          instruction                         needs (cpuid + the OS's XCR0)
    amx          tdpbssd on 16-row tiles, else as    avx512vnni's + AVX-512 BF16, AMX tile, int8 and bf16, the
                 avx512vnni; tdpbf16ps from 32 rows  tile state granted
    avx512vnni   vpdpbusd, 16 outputs per vector     AVX-512 F/BW/VL/DQ + VNNI, F16C, FMA
    avxvnni      vpdpbusd (VEX), 8 per vector        AVX2 + AVX-VNNI, F16C, FMA
    avx2         maddubs + madd, 8 per vector        AVX2, F16C, FMA

Each library has two modes (`activations`): int8 (activations quantized per block of 32, llama.cpp's scheme) and
float32 (the exact path: weights widened to fp32 in registers). See kernels/cpu/quant_kernels.h.

Libraries are built into a cache directory (the state directory's, or the user's cache) under a name that carries
the digest of the sources and flags, so an edited source is never run stale; the Debian package ships them
prebuilt beside the sources (`python -m kernels.cpu_quant [DIR]`), so a box needs no compiler. Where a library
cannot be had, `KernelsUnavailable` says why (no compiler, the CPU lacks the instructions, the build failed), and
the caller says so in the model's Backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import cpu_layout
from kernels.child_process import popen_tied

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "amx": _AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "avx512vnni": _AVX512,
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
ISAS = tuple(ISA_FLAGS)  # fastest first, as a rule; `auto` measures
# The avxvnni kernels on a CPU with AVX-512 VNNI but no AVX-VNNI (Zen 4, Ice Lake servers): the same source with its
# vpdpbusd EVEX-encoded on ymm registers (kernels/cpu/quant_avxvnni.c), 256-bit vectors only. Run where asked for
# (`quant_kernels: avxvnni`, APPLIANCE_CPU_ISA=avxvnni, the tests), never chosen by `auto` over the CPU's own.
AVXVNNI_EVEX_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256",
                      "-DVNNI_EVEX"]
ACTIVATIONS = ("int8", "float32")
HEADERS = ("quant_layout.h", "quant_kernels.h", "quant_attention.h", "quant_eltwise.h", "quant_vec256.h",
           "quant_vec512.h")

# cpu_features() bits (kernels/cpu/cpu_features.c)
_BITS = ("avx2", "fma", "f16c", "avxvnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni",
         "avx512bf16", "avx512fp16", "amx_tile", "amx_int8", "amx_bf16", "os_avx", "os_avx512", "os_amx")
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "fma", "f16c", "os_avx", "os_avx512"}
_NEEDS = {
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


class KernelsUnavailable(RuntimeError):
    """Our kernels cannot run here; the message says why (shown in the model's Backend and status page)."""


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
        return [isa for isa in ISAS if _NEEDS[isa] <= self.features or (self.cap == isa and self.stands_in(isa))]

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
_libs: dict[str, ctypes.CDLL] = {}  # by path
_cpu: list = []  # [CpuInfo | KernelsUnavailable], once per process
_logged: set[str] = set()
_ops: list[bool] = []  # [whether torch.ops.quant_cpu is loaded], once per process


def default_build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "opcua-appliance" / "kernels"


def compiler(cpp: bool = False) -> str | None:
    if cpp:
        return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def library_name(source: str, flags: list[str]) -> str:
    """`source`'s stem-<digest of the sources and flags>.so: an edited source or header is never run stale."""
    # the flags' absolute paths (torch's, the sources') are not part of the name: a package built in a scratch root
    # finds its libraries where it is installed
    text = " ".join(flags).replace(str(Path(torch.__file__).parent), "<torch>").replace(str(SOURCE_DIR), "<src>")
    h = hashlib.sha256(text.encode())
    for name in (source, *HEADERS):
        path = SOURCE_DIR / name
        if path.exists():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return f"{Path(source).stem}-{h.hexdigest()[:16]}.so"


def _targets() -> dict[str, tuple[str, list[str]]]:
    """library stem -> (source file, flags): the feature probe, one library per ISA, and the torch operators."""
    out = {"cpu_features": ("cpu_features.c", ["-O2", "-shared", "-fPIC", "-std=gnu11"])}
    for isa, flags in ISA_FLAGS.items():
        out[f"quant_{isa}"] = (f"quant_{isa}.c", COMMON + flags)
    out["quant_avxvnni_evex"] = ("quant_avxvnni.c", COMMON + AVXVNNI_EVEX_FLAGS)
    out["quant_op"] = ("quant_op.cpp", _torch_op_flags())
    return out


def sources_digest() -> str:
    """One digest of every kernel source (what a measurement's figures depend on)."""
    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*")):
        if path.suffix in (".c", ".h", ".cpp"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _torch_op_flags() -> list[str]:
    """Compiler flags of kernels/cpu/quant_op.cpp: torch's headers and libraries (and its version, so a different
    torch builds its own)."""
    root = Path(torch.__file__).parent
    # no rpath (torch's libraries are loaded before ours) and __FILE__ relative: the package build moves the tree,
    # and no built file may name the directory it was built in
    return ["-O2", "-shared", "-fPIC", "-std=c++17", f"-DAPPLIANCE_TORCH_VERSION=\"{torch.__version__}\"",
            f"-ffile-prefix-map={SOURCE_DIR}=kernels/cpu", f"-ffile-prefix-map={root}=torch",
            "-isystem", str(root / "include"),
            "-isystem", str(root / "include" / "torch" / "csrc" / "api" / "include"),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu"]


def build(directory: Path, stem: str) -> Path:
    """Compile one library into directory (built aside, renamed: a reader never sees half); raises OSError /
    SubprocessError where it cannot."""
    return build_many(directory, [stem])[0]


def build_many(directory: Path, stems: list[str]) -> list[Path]:
    """Compile several libraries at once (one compiler process each: the first start builds every ISA's library
    the measurement needs, in the time of the slowest)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    targets = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        procs = []
        for stem in stems:
            source, flags = _targets()[stem]
            cc = compiler(source.endswith(".cpp"))
            if cc is None:
                raise FileNotFoundError("no C++ compiler (c++/g++) on PATH" if source.endswith(".cpp")
                                        else "no C compiler (cc/gcc) on PATH")
            target = directory / library_name(source, flags)
            out = Path(tmp) / target.name
            # tied: the compiler ends with a planned stop and with the worker that started it (child_process.py)
            procs.append((popen_tied([cc, str(SOURCE_DIR / source), "-o", str(out), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE), out, target))
        failure = None
        for proc, out, target in procs:
            try:
                _stdout, stderr = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired as exc:
                proc.kill()
                proc.communicate()
                failure = failure or exc
                continue
            if proc.returncode != 0:
                failure = failure or subprocess.CalledProcessError(proc.returncode, proc.args, stderr=stderr)
                continue
            os.replace(out, target)
            targets.append(target)
            _share(target)
        if failure is not None:
            raise failure
    return targets


def _share(built: Path) -> None:
    """A copy in the user's cache too, where other state directories (tests, a second appliance) find it: the name
    carries the sources' digest, so a copy is never stale. Best effort."""
    shared = default_build_dir() / built.name
    if shared.exists() or shared.parent == built.parent:
        return
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        tmp = shared.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(built, tmp)
        os.replace(tmp, shared)
    except OSError:
        pass


def _find(stem: str, build_dir: Path) -> Path | None:
    """A library already built: beside the sources (the Debian package), in build_dir, or in the user's cache (the
    same digest means the same sources and flags)."""
    source, flags = _targets()[stem]
    name = library_name(source, flags)
    for candidate in (SOURCE_DIR / name, Path(build_dir) / name, default_build_dir() / name):
        if candidate.exists():
            return candidate
    return None


def _find_or_build(stem: str, build_dir: Path) -> Path:
    """The library's path, built into build_dir once where none exists."""
    found = _find(stem, build_dir)
    if found is not None:
        return found
    try:
        return build(build_dir, stem)
    except FileNotFoundError as exc:
        raise KernelsUnavailable(str(exc)) from exc
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
        raise KernelsUnavailable(f"building {_targets()[stem][0]} failed: {detail[-1] if detail else exc}") from exc


def ensure_built(isas: list[str], build_dir: Path | None = None) -> None:
    """Build the libraries of `isas` that do not exist yet, together; a failure is left for `kernels` to report."""
    build_dir = Path(build_dir) if build_dir else default_build_dir()
    try:
        stems = [cpu_info(build_dir).library_stem(isa) for isa in isas]
    except KernelsUnavailable:
        return
    missing = [stem for stem in stems if _find(stem, build_dir) is None]
    if isas and _find("quant_op", build_dir) is None and compiler(True) is not None:
        missing.append("quant_op")
    if len(missing) > 1 and compiler() is not None:
        try:
            build_many(build_dir, missing)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building our kernels failed (%s); each is tried again on its own", exc)


def library_at(path: str) -> ctypes.CDLL:
    """The library at path, loaded once per process (the compiled decode step's ops name it by its path, which,
    unlike its address, is the same in the next process, which loads the step's package)."""
    with _lock:
        lib = _libs.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)
            p, i32 = ctypes.c_void_p, ctypes.c_int
            for isa in ISAS:
                if Path(path).name.startswith(f"quant_{isa}-"):
                    getattr(lib, f"{isa}_matmul").argtypes = [i32, i32, p, i32, i32, p, i32, p, i32]
                    getattr(lib, f"{isa}_rows").argtypes = [i32, p, i32, i32, p, i32, p]
                    getattr(lib, f"{isa}_quantize").argtypes = [p, i32, i32, p, p, p]
            _libs[path] = lib
        return lib


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
        path = _find_or_build("cpu_features", Path(build_dir) if build_dir else default_build_dir())
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


@dataclass(frozen=True)
class CpuKernels:
    """One ISA's library in one activation mode: what a quantized linear layer multiplies with."""
    isa: str
    activations: str  # "int8" | "float32"
    path: str  # the built library (the compiled decode step's custom op names it)
    lib: ctypes.CDLL = field(compare=False, repr=False)
    op: bool = False  # torch.ops.quant_cpu is loaded: calls go through torch's dispatcher, not ctypes

    @property
    def label(self) -> str:
        return f"{self.isa}/{self.activations}"

    def with_activations(self, activations: str) -> "CpuKernels":
        return CpuKernels(self.isa, activations, self.path, self.lib, self.op)

    def matmul(self, x: torch.Tensor, data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
        """x (rows, K) float32 contiguous @ W^T, W (n, K) in format fmt laid out in `data` -> (rows, n)."""
        if self.op:
            return torch.ops.quant_cpu.block_matmul.default(x, data, cpu_layout.FORMATS[fmt].code, n, self.path,
                                                            self.isa, self.activations == "float32")
        return matmul(self.path, self.isa, self.activations == "float32", x, data, fmt, n)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """(N, n_heads * head_dim) float32: each query row of q (N, n_heads, head_dim) over its slot's cached positions
        0..positions[r] (kernels/cpu/quant_attention.h; caches (slots, n_kv, positions, head_dim) float32 or bfloat16).
        Through the C++ operator only (`op`)."""
        return torch.ops.quant_cpu.decode_attention.default(q, k_cache, v_cache, slot_ids, positions, self.path,
                                                            self.isa)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h (rows, dim) float32 += delta (in place, where given); returns RMSNorm(h) * weight (kernels/cpu/
        quant_eltwise.h). Through the C++ operator only (`op`)."""
        return torch.ops.quant_cpu.add_rms_norm.default(h, delta, weight, eps, self.path, self.isa)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(rows, inter) float32: SiLU(gate) * up of gate_up (rows, 2 * inter). Through the C++ operator only."""
        return torch.ops.quant_cpu.silu_mul.default(gate_up, self.path, self.isa)

    def rows(self, data: torch.Tensor, fmt: str, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """float32 (len(ids), k): rows ids of W, gguf's numbers exactly."""
        if self.op:
            return torch.ops.quant_cpu.block_rows.default(data, cpu_layout.FORMATS[fmt].code, n, k, ids, self.path,
                                                          self.isa)
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        rc = getattr(self.lib, f"{self.isa}_rows")(cpu_layout.FORMATS[fmt].code, data.data_ptr(), n, k,
                                                   ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"rows of a {fmt} ({n}, {k}) matrix: bad ids or shape ({rc})")
        return out


def matmul(path: str, isa: str, exact: bool, x: torch.Tensor, data: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """The library call (also what the compiled step's custom op runs)."""
    lib = library_at(path)
    rows, k = x.shape
    y = torch.empty(rows, n, dtype=torch.float32)
    rc = getattr(lib, f"{isa}_matmul")(cpu_layout.FORMATS[fmt].code, 1 if exact else 0, x.data_ptr(), rows, k,
                                       data.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{isa} matmul failed ({rc}) for a ({rows}, {k}) input and a {fmt} ({n}, {k}) matrix")
    return y


def torch_ops(build_dir: Path | None = None) -> bool:
    """Load kernels/cpu/quant_op.cpp's operators (torch.ops.quant_cpu.*) once per process; False (the reason logged
    once) where they cannot be built: the callers then reach the kernels through ctypes (slower per call)."""
    with _lock:
        if _ops:
            return _ops[0]
    try:
        path = _find_or_build("quant_op", Path(build_dir) if build_dir else default_build_dir())
        torch.ops.load_library(str(path))
        _register_fakes()
        ok = True
    except (KernelsUnavailable, OSError, RuntimeError) as exc:
        log.warning("our kernels' torch operators are not available (%s); calls go through ctypes", exc)
        ok = False
    with _lock:
        _ops[:] = [ok]
    return ok


def _register_fakes() -> None:
    """Shapes for tracing the compiled decode step (torch.export)."""
    @torch.library.register_fake("quant_cpu::block_matmul")
    def _(x, data, fmt, n, library, isa, exact):
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("quant_cpu::block_rows")
    def _(data, fmt, n, k, ids, library, isa):
        return data.new_empty(ids.numel(), k, dtype=torch.float32)

    @torch.library.register_fake("quant_cpu::decode_attention")
    def _(q, k_cache, v_cache, slot_ids, positions, library, isa):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float32)


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


def kernels(isa: str, activations: str = "int8", build_dir: Path | None = None) -> CpuKernels:
    """The library of one ISA in one activation mode; KernelsUnavailable (with the reason) where it cannot run."""
    if os.environ.get("APPLIANCE_CPU_KERNELS", "1") == "0":
        raise KernelsUnavailable("our CPU kernels are switched off (APPLIANCE_CPU_KERNELS=0)")
    if isa not in ISA_FLAGS:
        raise KernelsUnavailable(f"no kernels for ISA {isa!r} (ours: {', '.join(ISAS)})")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}")
    build_dir = Path(build_dir) if build_dir else default_build_dir()
    info = cpu_info(build_dir)
    if isa not in info.isas and not info.stands_in(isa):
        missing = sorted(_NEEDS[isa] - info.features)
        masked = f" or hidden by {ISA_CAP_ENV}={info.cap}" if info.cap else ""
        raise KernelsUnavailable(f"the CPU lacks {isa} ({', '.join(missing)} not reported by cpuid{masked})")
    if info.stands_in(isa):
        with _lock:
            first = isa not in _logged
            _logged.add(isa)
        if first:
            log.info("%s, the same instruction and bits", info.stand_in_text(isa))
    path = str(_find_or_build(info.library_stem(isa), build_dir))
    try:
        lib = library_at(path)
    except OSError as exc:
        raise KernelsUnavailable(f"loading {Path(path).name} failed: {exc}") from exc
    return CpuKernels(isa, activations, path, lib, torch_ops(build_dir))


def best(activations: str = "int8", build_dir: Path | None = None) -> CpuKernels:
    """The first ISA of ISAS this CPU runs (tests and benchmarks; the engine measures, see loader/path_choice)."""
    reasons = []
    for isa in ISAS:
        try:
            return kernels(isa, activations, build_dir)
        except KernelsUnavailable as exc:
            reasons.append(f"{isa}: {exc}")
            if "compiler" in str(exc) or "x86-64" in str(exc):
                break
    raise KernelsUnavailable("; ".join(reasons))


def library(build_dir: Path | None = None, activations: str = "float32") -> CpuKernels | None:
    """The best of our kernels here (`best`), by default in the exact mode (fp32 activations: what the kernels
    before the integer ones computed), or None with the reason logged once: where callers (tests, benchmarks) only
    need to know whether our kernels run."""
    try:
        return best(activations, build_dir)
    except KernelsUnavailable as exc:
        with _lock:
            first = str(exc) not in _logged
            _logged.add(str(exc))
        if first:
            log.warning("our CPU quantized kernels are not available: %s", exc)
        return None


def quantize_activations(k: CpuKernels, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 (rows, K), d (rows, K / 32), half sums (rows, K / 16)) as the kernels quantize x (tests)."""
    rows, kk = x.shape
    x = x.float().contiguous()
    q = torch.empty(rows, kk, dtype=torch.int8)
    d = torch.empty(rows, kk // 32, dtype=torch.float32)
    s = torch.empty(rows, kk // 16, dtype=torch.int32)
    rc = getattr(k.lib, f"{k.isa}_quantize")(x.data_ptr(), rows, kk, q.data_ptr(), d.data_ptr(), s.data_ptr())
    if rc != 0:
        raise ValueError(f"cannot quantize a ({rows}, {kk}) input")
    return q, d, s


def build_all(directory: Path) -> list[Path]:
    """Every library (the probe and each ISA's) into directory: the package build ships them."""
    return build_many(directory, list(_targets()))


if __name__ == "__main__":  # python -m kernels.cpu_quant [DIR]: build every library (default: beside the sources)
    import sys
    for built in build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_DIR):
        print(built)
