"""Every private torch API the engine uses, in one module, checked against the torch it was written for.

torch promises nothing about names with a leading underscore or about `torch.ops.mkldnn`: they move or change
their arguments between releases. As uaserver/asyncua_internals/ does for asyncua, this module refuses to load with
another torch than TORCH_VERSION (pyproject pins it), so a torch upgrade is one file to review:

- torch._convert_weight_to_int4pack_for_cpu, torch._weight_int4pack_mm_for_cpu: torch's CPU int4 matmul
  (models/quant.py, the path for CPUs our kernels do not serve)
- torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise: oneDNN's packed fp32/bf16 linear
  (models/llama.py, models/packed_rows.py)
- torch._inductor (config, cpp_builder, exc, aoti_compile_and_package) and torch._C._aoti.AOTIModelPackageLoader:
  the decode step compiled ahead of time and its package loaded (loader/compiled_decode.py)

The compiler's modules are imported inside the functions that use them: importing torch._inductor costs about
70 MB and a second, and a serving process that only loads a package never needs them.
"""
from __future__ import annotations

import torch

TORCH_VERSION = "2.13.0"


class TorchVersionError(RuntimeError):
    pass


def check_torch_version(installed: str | None = None) -> None:
    """Refuse another torch than the one these calls were written for (a local build suffix such as +cpu is
    allowed: the same release)."""
    installed = installed if installed is not None else torch.__version__
    if installed.split("+")[0] != TORCH_VERSION:
        raise TorchVersionError(
            f"the appliance's engine was written for torch {TORCH_VERSION}, but torch {installed} is installed: "
            f"install torch=={TORCH_VERSION} (`pip install torch=={TORCH_VERSION}`), or review "
            "models/torch_internals.py against the new version and change TORCH_VERSION there")


check_torch_version()


# ---- int4 matmul (CPU) ---------------------------------------------------------------------------------------------

def int4_pack(q: torch.Tensor, inner_k_tiles: int = 1) -> torch.Tensor:
    """q: (n, k) int32 values 0..15 -> torch's packed int4 layout for int4_matmul."""
    return torch._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x (rows, k) float32, contiguous, times the packed int4 weight -> (rows, n)."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


# ---- oneDNN's packed linear ----------------------------------------------------------------------------------------

def onednn_pack_linear_weight(w: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """w (out, in), float32 or bfloat16, reordered into oneDNN's blocked layout for batches of about batch_hint."""
    return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) times a weight from onednn_pack_linear_weight (+ bias), no fused activation."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# ---- the ahead-of-time compiler (Inductor) and its packages ---------------------------------------------------------

class NoCxxCompiler(RuntimeError):
    pass


def require_cxx_compiler() -> None:
    """Raise NoCxxCompiler where Inductor finds no C++ compiler (it would fail only after a minute of tracing)."""
    from torch._inductor import cpp_builder, exc as inductor_exc
    try:
        cpp_builder.get_cpp_compiler()
    except inductor_exc.InvalidCxxCompiler as exc:
        raise NoCxxCompiler(str(exc)) from exc


def configure_inductor(*, compile_threads: int, cpp_threads: int, min_chunk: int, march: str | None) -> None:
    """Inductor's settings for this process's compiles: how many compiling processes, the OpenMP threads the
    generated loops are written for, the values per thread below which a loop is not parallel (Inductor's own is
    512), and -march (None: Inductor's own choice, native)."""
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = compile_threads
    inductor_config.cpp.threads = cpp_threads
    inductor_config.cpp.min_chunk_size = min_chunk
    if march:
        inductor_config.cpp.march = march


def aot_compile_package(program, package_path: str) -> None:
    """An exported program compiled ahead of time into a package whose weights are left out (handed over at load)."""
    import torch._inductor
    torch._inductor.aoti_compile_and_package(
        program, package_path=package_path,
        inductor_configs={"aot_inductor.package_constants_in_so": False,
                          "aot_inductor.package_constants_on_disk_format": None})


def load_aot_package(package_path: str):
    """The runner of a package from aot_compile_package (model "model", one runner); RuntimeError when the file is
    cut short or was written by another torch."""
    return torch._C._aoti.AOTIModelPackageLoader(package_path, "model", False, 1, -1)
