"""Triton side of kernels.dequant_matmul (layouts there)."""
import triton
import triton.language as tl


@triton.jit
def _mac(acc, x, w, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def dequant_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, sx_m, sw_n, ss_n, sz_n, sy_m,
                          BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 8:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            x = tl.load(x_ptr + rm[:, None] * sx_m + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wmask = n_mask[:, None] & k_mask[None, :]
            q = tl.load(w_ptr + rn[:, None] * sw_n + rk[None, :], mask=wmask, other=0).to(tl.float32)
            g = (rk // GROUP)[None, :]
            w = q * tl.load(s_ptr + rn[:, None] * ss_n + g, mask=wmask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                w += tl.load(z_ptr + rn[:, None] * sz_n + g, mask=wmask, other=0.0).to(tl.float32)
            acc = _mac(acc, x, w, DOT_FP32)
        else:
            # bytes of this chunk; byte j of a block of 32 inputs holds input j (low) and j + 16 (high)
            rj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            k_lo = (rj // 16) * 32 + rj % 16
            k_mask = k_lo < K
            wmask = n_mask[:, None] & k_mask[None, :]
            packed = tl.load(w_ptr + rn[:, None] * sw_n + rj[None, :], mask=wmask, other=0).to(tl.int32)
            g = (k_lo // GROUP)[None, :]  # inputs j and j + 16 share their block, so their group
            sc = tl.load(s_ptr + rn[:, None] * ss_n + g, mask=wmask, other=0.0).to(tl.float32)
            lo = ((packed & 15) - 8).to(tl.float32) * sc
            hi = (((packed >> 4) & 15) - 8).to(tl.float32) * sc
            if HAS_ZERO:
                zr = tl.load(z_ptr + rn[:, None] * sz_n + g, mask=wmask, other=0.0).to(tl.float32)
                lo += zr
                hi += zr
            xmask = m_mask[:, None] & k_mask[None, :]
            x_lo = tl.load(x_ptr + rm[:, None] * sx_m + k_lo[None, :], mask=xmask, other=0.0)
            x_hi = tl.load(x_ptr + rm[:, None] * sx_m + (k_lo + 16)[None, :], mask=xmask, other=0.0)
            acc = _mac(acc, x_lo, lo, DOT_FP32)
            acc = _mac(acc, x_hi, hi, DOT_FP32)
    tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
