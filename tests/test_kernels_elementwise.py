"""RMSNorm + residual, rotary, SiLU-gate and the KV-cache write: Triton (interpreter) against the torch twins."""
import pytest
import torch

from kernels import add_rms_norm, apply_rotary_, rotary_tables, silu_mul, write_kv_
from kernel_cases import assert_close, dtypes


@dtypes
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 576)])
def test_add_rms_norm_matches_twin_and_updates_residual(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    r_kernel, r_twin = residual.clone(), residual.clone()
    got = add_rms_norm(x, r_kernel, w, 1e-5, backend="triton")
    want = add_rms_norm(x, r_twin, w, 1e-5, backend="torch")
    assert_close(r_kernel, r_twin, dtype, "residual")
    assert_close(r_kernel, residual.float() + x.float(), dtype, "residual is the sum")
    assert_close(got, want, dtype, "normed")


@dtypes
def test_plain_rms_norm_matches_hf_formula(dtype):
    x = torch.randn(2, 3, 64).to(dtype)  # leading dims are flattened and restored
    w = torch.rand(64).to(dtype)
    got = add_rms_norm(x, None, w, 1e-6, backend="triton")
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # HF LlamaRMSNorm
    assert got.shape == x.shape
    assert_close(got, want, dtype)


@dtypes
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 4, 4), (64, 8, 2), (128, 8, 1)])
def test_rotary_in_place_on_views_of_fused_qkv(dtype, head_dim, n_heads, n_kv):
    g = torch.Generator().manual_seed(head_dim + n_heads)
    qkv = torch.randn(3, n_heads + 2 * n_kv, head_dim, generator=g).to(dtype)
    twin = qkv.clone()
    original = qkv.clone()
    untouched_v = qkv[:, n_heads + n_kv:].clone()
    cos, sin = rotary_tables(head_dim, 64, 10000.0)
    positions = torch.tensor([0, 17, 63])
    apply_rotary_(qkv[:, :n_heads], qkv[:, n_heads:n_heads + n_kv], positions, cos, sin, backend="triton")
    apply_rotary_(twin[:, :n_heads], twin[:, n_heads:n_heads + n_kv], positions, cos, sin, backend="torch")
    assert_close(qkv, twin, dtype)
    assert torch.equal(qkv[:, n_heads + n_kv:], untouched_v)  # v is not rotated
    assert torch.equal(qkv[0], original[0])  # position 0 rotates by nothing
    assert not torch.equal(qkv[2], original[2])


def test_rotary_twin_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hd = 64
    q, k = torch.randn(1, 4, 5, hd), torch.randn(1, 2, 5, hd)  # HF: (batch, heads, seq, hd)
    positions = torch.arange(3, 8)
    cos, sin = rotary_tables(hd, 16, 10000.0)
    emb_cos = torch.cat([cos, cos], -1)[positions].unsqueeze(0)
    emb_sin = torch.cat([sin, sin], -1)[positions].unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb_cos, emb_sin)
    ours_q, ours_k = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()  # (seq, heads, hd)
    apply_rotary_(ours_q, ours_k, positions, cos, sin, backend="triton")
    torch.testing.assert_close(ours_q, want_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, want_k[0].transpose(0, 1))


@dtypes
@pytest.mark.parametrize("rows,width", [(1, 128), (4, 1536), (3, 200)])
def test_silu_mul(dtype, rows, width):
    gate_up = torch.randn(rows, 2 * width).to(dtype)
    got = silu_mul(gate_up, backend="triton")
    assert got.shape == (rows, width)
    assert_close(got, silu_mul(gate_up, backend="torch"), dtype)
    gate, up = gate_up.float().chunk(2, -1)
    assert_close(got, torch.nn.functional.silu(gate) * up, dtype, "against the formula")


@dtypes
@pytest.mark.parametrize("head_dim,n_kv", [(64, 1), (128, 4)])
def test_write_kv_into_slots_of_the_shared_cache(dtype, head_dim, n_kv):
    n_layers, n_slots, max_seq = 2, 4, 16
    kv = torch.zeros(2, n_layers, n_slots, n_kv, max_seq + 1, head_dim, dtype=dtype)
    twin = kv.clone()
    qkv = torch.randn(4, 2 + 2 * n_kv, head_dim).to(dtype)  # k and v as views of a fused projection
    k, v = qkv[:, 2:2 + n_kv], qkv[:, 2 + n_kv:]
    slot_ids = torch.tensor([3, 0, 2, 0])
    positions = torch.tensor([0, 15, 7, max_seq])  # the last row is padding: the scratch cell
    write_kv_(kv[0, 1], kv[1, 1], k, v, slot_ids, positions, backend="triton")
    write_kv_(twin[0, 1], twin[1, 1], k, v, slot_ids, positions, backend="torch")
    assert torch.equal(kv, twin)
    assert torch.equal(kv[0, 1, 2, :, 7], k[2]) and torch.equal(kv[1, 1, 3, :, 0], v[0])
    assert not kv[:, 0].any()  # the other layer is untouched
    assert int((kv != 0).any(-1).sum()) == 2 * 4 * n_kv  # exactly 4 positions per k and v were written
