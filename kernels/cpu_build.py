"""The C build cache of our CPU kernels: one C source per instruction set (kernels/cpu/quant_<isa>.c over the
shared kernels/cpu/quant_kernels.h), the cpuid probe (kernels/cpu/cpu_features.c) and the torch operators
(kernels/cpu/quant_op.cpp), each built with the system compiler at first use into a cache directory (the state
directory's, or the user's cache) under a name that carries the digest of the sources and flags, so an edited source
is never run stale. The Debian package ships them prebuilt beside the sources (`python -m kernels.cpu_build [DIR]`),
so a box needs no compiler. Where a library cannot be had, `KernelsUnavailable` says why (no compiler, the build
failed).

Which ISA a CPU runs: kernels/cpu_isa.py; the libraries as callables: kernels/cpu_quant.py (ctypes) and
kernels/cpu_torch_ops.py (torch.ops.quant_cpu). A new kernel: its source in kernels/cpu/, its target in `_targets`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.child_process import popen_tied

SOURCE_DIR = Path(__file__).with_name("cpu")
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "amx": _AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "avx512vnni": _AVX512,
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
ISAS = tuple(ISA_FLAGS)  # fastest first, as a rule; `auto` measures (kernels/cpu_isa.py: which run here)
# The avxvnni kernels on a CPU with AVX-512 VNNI but no AVX-VNNI (Zen 4, Ice Lake servers): the same source with its
# vpdpbusd EVEX-encoded on ymm registers (kernels/cpu/quant_avxvnni.c), 256-bit vectors only. Run where asked for
# (`quant_kernels: avxvnni`, APPLIANCE_CPU_ISA=avxvnni, the tests), never chosen by `auto` over the CPU's own.
AVXVNNI_EVEX_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256",
                      "-DVNNI_EVEX"]
HEADERS = ("quant_layout.h", "quant_kernels.h", "quant_attention.h", "quant_eltwise.h", "quant_vec256.h",
           "quant_vec512.h")


class KernelsUnavailable(RuntimeError):
    """Our kernels cannot run here; the message says why (shown in the model's Backend and status page)."""


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


def find(stem: str, build_dir: Path) -> Path | None:
    """A library already built: beside the sources (the Debian package), in build_dir, or in the user's cache (the
    same digest means the same sources and flags)."""
    source, flags = _targets()[stem]
    name = library_name(source, flags)
    for candidate in (SOURCE_DIR / name, Path(build_dir) / name, default_build_dir() / name):
        if candidate.exists():
            return candidate
    return None


def find_or_build(stem: str, build_dir: Path) -> Path:
    """The library's path, built into build_dir once where none exists."""
    found = find(stem, build_dir)
    if found is not None:
        return found
    try:
        return build(build_dir, stem)
    except FileNotFoundError as exc:
        raise KernelsUnavailable(str(exc)) from exc
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
        raise KernelsUnavailable(f"building {_targets()[stem][0]} failed: {detail[-1] if detail else exc}") from exc


def build_all(directory: Path) -> list[Path]:
    """Every library (the probe and each ISA's) into directory: the package build ships them."""
    return build_many(directory, list(_targets()))


if __name__ == "__main__":  # python -m kernels.cpu_build [DIR]: build every library (default: beside the sources)
    import sys
    for built in build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_DIR):
        print(built)
