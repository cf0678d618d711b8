"""Decode attention over the slot cache: Triton (interpreter) against the torch twin and against SDPA."""
import pytest
import torch
import torch.nn.functional as F

from kernels import decode_attention, decode_attention_torch
from kernel_cases import assert_close, dtypes


def cache_and_queries(dtype, n_slots, n_kv, group, head_dim, t_cap, batch, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, n_slots, n_kv, t_cap, head_dim, generator=g).to(dtype)  # 2 layers: views, not copies
    q = torch.randn(batch, n_kv * group, head_dim, generator=g).to(dtype)
    return kv[0, 1], kv[1, 1], q


@dtypes
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ragged_rows_any_slot_order_gqa(dtype, group, head_dim):
    n_kv = 2 if group < 8 else 1
    k_cache, v_cache, q = cache_and_queries(dtype, 5, n_kv, group, head_dim, 97, 4, group * head_dim)
    slot_ids = torch.tensor([4, 0, 2, 1])
    lengths = torch.tensor([1, 97, 40, 64])  # one position, the whole cache, inside and at a split boundary
    got = decode_attention(q, k_cache, v_cache, slot_ids, lengths, backend="triton", split_len=32)
    want = decode_attention(q, k_cache, v_cache, slot_ids, lengths, backend="torch")
    assert_close(got, want, dtype)


def test_twin_matches_sdpa_with_repeated_kv_heads():
    k_cache, v_cache, q = cache_and_queries(torch.float32, 3, 2, 4, 64, 50, 2, 7)
    slot_ids, lengths = torch.tensor([2, 0]), torch.tensor([50, 9])
    got = decode_attention_torch(q, k_cache, v_cache, slot_ids, lengths)
    for row in range(2):
        n = int(lengths[row])
        keys = k_cache[slot_ids[row], :, :n].repeat_interleave(4, dim=0)  # (heads, n, hd)
        values = v_cache[slot_ids[row], :, :n].repeat_interleave(4, dim=0)
        want = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


def test_positions_past_the_length_are_never_read():
    k_cache, v_cache, q = cache_and_queries(torch.float32, 2, 2, 4, 64, 64, 2, 3)
    slot_ids, lengths = torch.tensor([1, 0]), torch.tensor([10, 33])
    before = decode_attention(q, k_cache, v_cache, slot_ids, lengths, backend="triton", split_len=16)
    k_cache[1, :, 10:] = float("nan")  # garbage beyond each row's length, as in a reused slot
    v_cache[0, :, 33:] = float("inf")
    after = decode_attention(q, k_cache, v_cache, slot_ids, lengths, backend="triton", split_len=16)
    assert torch.equal(before, after)


def test_length_zero_row_gives_zeros_and_single_split_path():
    k_cache, v_cache, q = cache_and_queries(torch.float16, 2, 1, 4, 64, 20, 2, 5)
    lengths = torch.tensor([0, 20])
    got = decode_attention(q, k_cache, v_cache, torch.tensor([0, 1]), lengths, backend="triton")  # one split
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert_close(got, decode_attention_torch(q, k_cache, v_cache, torch.tensor([0, 1]), lengths), torch.float16)


def test_rejects_heads_that_do_not_group():
    k_cache, v_cache, q = cache_and_queries(torch.float32, 2, 3, 1, 64, 8, 1, 1)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q[:, :2], k_cache, v_cache, torch.tensor([0]), torch.tensor([4]), backend="triton")
