"""Decode attention through our CPU kernels' operator (kernels/cpu/quant_attention.h, quant_cpu::decode_attention),
which the compiled decode step calls where the model multiplies with our kernels: against the eager forward's
attention (TorchOps.attend: sdpa with the mask) for every ISA this CPU runs, rows in any slot order at their own
positions, grouped query heads, a float32 and a bfloat16 cache, head sizes 64 and 128; and refusals by name."""
from __future__ import annotations

import pytest
import torch

from kernels_here import runnable_kernels
from models.forward_ops import TorchOps, attention_length


@pytest.fixture(scope="module")
def isas():
    """Every ISA's library this CPU runs, from the user's cache as the engine finds them (tests/test_cpu_quant.py
    covers building them), with their torch operators."""
    return runnable_kernels("int8", torch_ops=True)


def eager(q, k_cache, v_cache, slot_ids, positions):
    max_seq = k_cache.shape[2] - 1
    t = attention_length(int(positions.max()) + 1, max_seq)
    mask = (torch.arange(t) <= positions[:, None]).view(-1, 1, 1, t)
    hd = q.shape[-1]
    cos, sin = torch.ones(max_seq, hd), torch.zeros(max_seq, hd)
    rows = TorchOps.graph_decode_rows(torch.zeros(len(slot_ids), dtype=torch.long), slot_ids, positions, mask, cos,
                                      sin)
    return TorchOps(1e-5).attend(q, k_cache, v_cache, rows)


# groups of 3, 4, 1, 4, and 6 and 16 (the values weighed for several heads at once, in passes sized by the group,
# and head by head past 8)
@pytest.mark.parametrize("n_heads, n_kv, hd", [(9, 3, 64), (32, 8, 64), (4, 4, 128), (8, 2, 128), (12, 2, 64),
                                               (16, 1, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_is_the_eager_one(isas, n_heads, n_kv, hd, cache_dtype, threads):
    torch.manual_seed(hd + n_heads)
    slots, max_seq = 6, 200
    k_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    v_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    slot_ids = torch.tensor([4, 0, 5, 2, 1])
    positions = torch.tensor([0, 17, 199, 40, 64])  # one position, a vector's tail, the last, whole vectors
    q = torch.randn(5, n_heads, hd) * 3  # peaked softmaxes too
    want = eager(q, k_cache, v_cache, slot_ids, positions)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa, k in isas.items():
            got = torch.ops.quant_cpu.decode_attention.default(q, k_cache, v_cache, slot_ids, positions, k.path, isa)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{isa}: {m}")
    finally:
        torch.set_num_threads(before)


def test_a_position_outside_the_cache_or_a_bad_slot_is_refused(isas):
    isa, k = next(iter(isas.items()))
    k_cache = torch.zeros(2, 1, 9, 64)
    q = torch.zeros(1, 1, 64)
    op = torch.ops.quant_cpu.decode_attention.default
    with pytest.raises(RuntimeError, match="decode_attention failed"):
        op(q, k_cache, k_cache, torch.tensor([0]), torch.tensor([9]), k.path, isa)
    with pytest.raises(RuntimeError, match="a slot outside 0..1"):
        op(q, k_cache, k_cache, torch.tensor([2]), torch.tensor([0]), k.path, isa)
    with pytest.raises(RuntimeError, match="bad arguments"):
        op(q, k_cache.to(torch.float16), k_cache.to(torch.float16), torch.tensor([0]), torch.tensor([0]), k.path, isa)
