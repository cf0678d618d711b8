"""Triton side of kernels.decode_attention (split-K decode attention over the slot cache, log2 domain)."""
import triton
import triton.language as tl


@triton.jit
def decode_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, po_ptr, pl_ptr,
        sq_b, sq_h, sk_s, sk_h, sk_t, sv_s, sv_h, sv_t, spo_b, spo_h, spo_s, spl_b, spl_h,
        scale_log2, group, head_dim, split_len,
        BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kvh * group + g
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + slot * sk_s + kvh * sk_h
    v_base = v_ptr + slot * sv_s + kvh * sv_h

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < end
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + t[:, None] * sk_t + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + t[:, None] * sv_t + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(po_ptr + b * spo_b + heads[:, None] * spo_h + split * spo_s + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(pl_ptr + b * spl_b + heads * spl_h + split, lse, mask=g_mask)


@triton.jit
def decode_attention_merge_kernel(po_ptr, pl_ptr, out_ptr, spo_b, spo_h, spo_s, spl_b, spl_h, so_b, so_h,
                                  n_splits, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < n_splits
    lse = tl.load(pl_ptr + b * spl_b + h * spl_h + sp, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (length 0): weights 0, output 0
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    parts = tl.load(po_ptr + b * spo_b + h * spo_h + sp[:, None] * spo_s + d[None, :],
                    mask=s_mask[:, None] & (d[None, :] < head_dim), other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)
