"""Triton side of kernels.kv_write: one program per token stores all its kv heads."""
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(kc_ptr, vc_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, skc_s, skc_h, skc_t, svc_s, svc_h, svc_t,
                    sk_n, sk_h, sv_n, sv_h, n_kv, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < n_kv) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + n * sk_n + h[:, None] * sk_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + n * sv_n + h[:, None] * sv_h + d[None, :], mask=mask)
    tl.store(kc_ptr + slot * skc_s + pos * skc_t + h[:, None] * skc_h + d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * svc_s + pos * svc_t + h[:, None] * svc_h + d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mask)
