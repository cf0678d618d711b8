"""Fused Triton kernels for decode, each with a pure-torch twin, chosen per call by device (see kernels.dispatch).

Importing this package never imports triton or touches CUDA; a kernel module (kernels/triton_*.py) is imported the
first time its Triton path runs. Every op takes `backend="auto" | "triton" | "torch"`.

    add_rms_norm(x, residual, weight, eps)                 residual += x in place; RMSNorm(residual) * weight
    apply_rotary_(q, k, positions, cos, sin)               rotary on q and k in place (tables: rotary_tables)
    silu_mul(gate_up)                                      silu(gate) * up of a fused gate/up projection
    write_kv_(k_cache, v_cache, k, v, slot_ids, positions) new keys/values into their slots
    decode_attention(q, k_cache, v_cache, slot_ids, lengths)   one query per row over its slot, GQA, no gather
    group_matmul(x, q, scale, zero, bits=, group=)         x @ W^T with W int8/int4, a scale (+ zero) per group
"""
from kernels.activation import silu_mul, silu_mul_torch
from kernels.decode_attention import decode_attention, decode_attention_torch
from kernels.dequant_matmul import group_matmul, group_matmul_torch, pack_int4
from kernels.dispatch import KERNEL_BACKENDS, KernelUnavailable, use_triton
from kernels.kv_write import write_kv_, write_kv_torch
from kernels.norm import add_rms_norm, add_rms_norm_torch
from kernels.rotary import apply_rotary_, apply_rotary_torch, rotary_tables

__all__ = [
    "KERNEL_BACKENDS", "KernelUnavailable", "add_rms_norm", "add_rms_norm_torch", "apply_rotary_",
    "apply_rotary_torch", "decode_attention", "decode_attention_torch", "group_matmul", "group_matmul_torch",
    "pack_int4", "rotary_tables", "silu_mul", "silu_mul_torch", "use_triton", "write_kv_", "write_kv_torch",
]
