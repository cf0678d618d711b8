"""Triton side of kernels.norm (imported only when the Triton path runs)."""
import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_r, stride_o, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Added in fp32 and rounded once to the model dtype: the value a native fp16/bf16 add gives (HF adds in
        # the model dtype), and the interpreter has no bf16 arithmetic of its own.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
