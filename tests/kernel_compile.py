"""Compile every Triton kernel ahead of time for NVIDIA targets, without a GPU (triton ships ptxas): the compiled
path's type checks, lowering and register/shared-memory allocation, which the interpreter never exercises.

    TRITON_INTERPRET= python tests/kernel_compile.py [sm ...]      (default 90; prints one line per kernel)

The constexprs are the ones the dispatchers pass for SmolLM2/Llama-like shapes (head_dim 64 and 128, GQA 4).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_activation import silu_mul_kernel  # noqa: E402
from kernels.triton_decode_attention import (decode_attention_merge_kernel,  # noqa: E402
                                             decode_attention_split_kernel)
from kernels.triton_dequant_matmul import dequant_matmul_kernel  # noqa: E402
from kernels.triton_kv_write import write_kv_kernel  # noqa: E402
from kernels.triton_norm import add_rms_norm_kernel  # noqa: E402
from kernels.triton_rotary import rotary_kernel  # noqa: E402

TY = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, floats=(), sm: int = 90):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", sm, 32))


def cases(dt: str):
    p = "*" + TY[dt]
    dot32 = dt == "fp32"
    yield "add_rms_norm", add_rms_norm_kernel, {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p}, \
        {"HAS_RESIDUAL": True, "BLOCK": 1024}, ("eps",)
    yield "rotary", rotary_kernel, {"q_ptr": p, "k_ptr": p, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}, \
        {"BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_HALF": 64}, ()
    yield "silu_mul", silu_mul_kernel, {"x_ptr": p, "out_ptr": p}, {"BLOCK": 1024}, ()
    yield "write_kv", write_kv_kernel, {"kc_ptr": p, "vc_ptr": p, "k_ptr": p, "v_ptr": p, "slot_ptr": "*i64",
                                        "pos_ptr": "*i64"}, {"BLOCK_H": 8, "BLOCK_D": 128}, ()
    for hd in (64, 128):
        yield f"decode_attention_split hd{hd}", decode_attention_split_kernel, \
            {"q_ptr": p, "k_ptr": p, "v_ptr": p, "slot_ptr": "*i64", "len_ptr": "*i64", "po_ptr": "*fp32",
             "pl_ptr": "*fp32"}, {"BLOCK_G": 16, "BLOCK_T": 32 if dot32 else 64, "BLOCK_D": hd, "DOT_FP32": dot32}, \
            ("scale_log2",)
    yield "decode_attention_merge", decode_attention_merge_kernel, \
        {"po_ptr": "*fp32", "pl_ptr": "*fp32", "out_ptr": p}, {"BLOCK_S": 16, "BLOCK_D": 128}, ()
    for bits, wtype in ((8, "*i8"), (4, "*u8")):
        yield f"dequant_matmul int{bits}", dequant_matmul_kernel, \
            {"x_ptr": p, "w_ptr": wtype, "s_ptr": "*fp32", "z_ptr": "*fp32", "y_ptr": p}, \
            {"BITS": bits, "GROUP": 32, "HAS_ZERO": bits == 4, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
             "DOT_FP32": dot32}, ()


def main(sms: list[int]) -> int:
    failed = 0
    for sm in sms:
        for dt in ("fp16", "bf16", "fp32"):
            for name, fn, pointers, consts, floats in cases(dt):
                try:
                    c = compile_kernel(fn, pointers, consts, floats, sm)
                    print(f"OK sm_{sm} {dt} {name}: {c.metadata.num_warps} warps, {c.metadata.shared} B shared,"
                          f" {len(c.asm['cubin'])} B cubin", flush=True)
                except Exception as exc:  # noqa: BLE001 - report every kernel
                    failed += 1
                    print(f"FAILED sm_{sm} {dt} {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
