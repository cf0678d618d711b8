"""Triton side of kernels.rotary: one program per token rotates all its q and k heads."""
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base, stride_h, n_heads, half, c, s, d, d_mask, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < n_heads) & d_mask[None, :]
    p1 = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (f1 * c[None, :] - f2 * s[None, :]).to(x1.dtype), mask=mask)
    tl.store(p1 + half, (f2 * c[None, :] + f1 * s[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, sq_n, sq_h, sk_n, sk_h, s_cos, n_q, n_k, half,
                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    n = tl.program_id(0)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    c = tl.load(cos_ptr + pos * s_cos + d, mask=d_mask, other=0.0)
    s = tl.load(sin_ptr + pos * s_cos + d, mask=d_mask, other=0.0)
    _rotate_heads(q_ptr + n * sq_n, sq_h, n_q, half, c, s, d, d_mask, BLOCK_HQ)
    _rotate_heads(k_ptr + n * sk_n, sk_h, n_k, half, c, s, d, d_mask, BLOCK_HK)
