"""The eager forward's CPU ops through our kernels (models/forward_ops.py's TorchOps where the model multiplies with
them: prefill, mixed steps, decode before the compiled step is ready): attention of prefill rows through the decode
attention operator (each token a query row at its own position), the residual add with RMSNorm, and SiLU-gate
(kernels/cpu/quant_eltwise.h), each against torch's own ops for every ISA this CPU runs; and refusals by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_here import best_kernels
from models.forward_ops import TorchOps
from test_cpu_attention import isas  # noqa: F401 - every ISA's kernels this CPU runs (a fixture)


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_attend_through_the_kernel_as_through_sdpa(isas, threads, cache_dtype):
    """Ragged rows of a prefill (different lengths, a chunk after an earlier one, slots out of order), grouped query
    heads: every token's attention, padding included, is sdpa's with the causal mask; packed (the rows' own tokens
    only), each token's the same."""
    torch.manual_seed(3)
    n_heads, n_kv, hd, slots, max_seq = 9, 3, 64, 5, 120
    k_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    v_cache = torch.randn(slots, n_kv, max_seq + 1, hd).to(cache_dtype)
    slot_ids, start = torch.tensor([3, 0, 4]), torch.tensor([0, 50, 7])
    lens = torch.tensor([7, 3, 5])
    cos, sin = torch.ones(max_seq, hd), torch.zeros(max_seq, hd)
    rows = TorchOps.ragged_rows(torch.zeros(3, 7, dtype=torch.long), slot_ids, start, lens, max_seq, cos, sin)
    q = torch.randn(rows.b * rows.s, n_heads, hd) * 3
    want = TorchOps(1e-5).attend(q, k_cache, v_cache, rows)
    packed = TorchOps.ragged_rows(torch.zeros(3, 7, dtype=torch.long), slot_ids, start, lens, max_seq, cos, sin,
                                  packed=True)
    valid = (torch.arange(7) < lens[:, None]).reshape(-1)
    for isa, k in isas.items():
        ops = TorchOps(1e-5, attention=k.attention)
        torch.testing.assert_close(ops.attend(q, k_cache, v_cache, rows), want, rtol=2e-5, atol=2e-5,
                                   msg=lambda m: f"{isa}: {m}")
        torch.testing.assert_close(ops.attend(q[valid], k_cache, v_cache, packed), want[valid], rtol=2e-5, atol=2e-5,
                                   msg=lambda m: f"{isa}, packed: {m}")


@pytest.mark.parametrize("rows, dim", [(1, 576), (624, 576), (3, 100), (40, 2048)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_torch_s_and_updates_the_residual_in_place(isas, threads, rows, dim, with_delta):
    torch.manual_seed(rows + dim)
    h0, delta, weight = torch.randn(rows, dim) * 4, torch.randn(rows, dim), torch.randn(dim)
    want_h = h0 + delta if with_delta else h0
    want = F.rms_norm(want_h, (dim,), weight, 1e-5)
    for isa, k in isas.items():
        h = h0.clone()
        ops = TorchOps(1e-5, fused=k)
        got_h, got = ops.add_norm(h, delta if with_delta else None, weight)
        assert got_h.data_ptr() == h.data_ptr()
        torch.testing.assert_close(h, want_h, rtol=0, atol=0, msg=lambda m: f"{isa}: {m}")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{isa}: {m}")


@pytest.mark.parametrize("rows, inter", [(1, 1536), (624, 1536), (3, 37)])
def test_silu_mul_is_torch_s(isas, threads, rows, inter):
    torch.manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # e^-g past float's range both ways
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    for isa, k in isas.items():
        got = TorchOps(1e-5, fused=k).silu_mul(gate_up)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{isa}: {m}")


def test_tensors_the_kernels_do_not_take_go_through_torch_or_are_refused(isas):
    isa, k = next(iter(isas.items()))
    ops = TorchOps(1e-5, fused=k)
    h, weight = torch.randn(4, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    _, got = ops.add_norm(h, None, weight)  # not float32: torch's ops
    torch.testing.assert_close(got, F.rms_norm(h, (64,), weight, 1e-5))
    strided = torch.randn(4, 128)[:, ::2]
    torch.testing.assert_close(ops.silu_mul(strided), F.silu(strided[:, :32]) * strided[:, 32:])
    with pytest.raises(RuntimeError, match="add_rms_norm: bad arguments"):
        k.add_rms_norm(torch.randn(4, 64), None, torch.randn(63), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: bad arguments"):
        k.silu_mul(torch.randn(4, 63))


def test_a_ragged_prefill_packed_gives_every_row_what_the_padded_one_gives(tmp_path):
    """A prefill of rows of very different lengths multiplies only the rows' own tokens (packed), and gives each row
    the logits and the cache cells it gives padded to the longest: bit for bit (int8 activations are quantized per
    row, and attention, norms and SiLU work per token); a mixed step of new prompts and decode rows the same."""
    from models.llama import KVCache, LlamaModel
    from loader.weights import load_weights
    from test_quantized import write_kquant_gguf
    kernels = best_kernels("int8", torch_ops=True)
    path = tmp_path / "k.gguf"
    write_kquant_gguf(path)
    w = load_weights(path, torch.float32, "blocks")
    model = LlamaModel(w.config, w.tensors, cpu_kernels=kernels)
    assert model.torch_ops.packs(torch.float32, torch.bfloat16)
    torch.manual_seed(0)
    lens = torch.tensor([13, 2, 40, 1])
    ids = torch.randint(3, w.config.vocab_size, (4, 40))
    slots, start = torch.tensor([2, 0, 3, 1]), torch.zeros(4, dtype=torch.long)
    caches = [KVCache(w.config, 6, 64, torch.bfloat16) for _ in range(2)]
    got, want = (model.forward(c, ids, slots, start, lens, pad=pad) for c, pad in zip(caches, (False, True)))
    assert torch.equal(got, want)
    real = caches[0].kv[..., :64, :]  # the padded rows wrote their padding to the scratch cell 64
    assert torch.equal(real, caches[1].kv[..., :64, :]) and real.abs().sum() > 0
    # a mixed step: two new prompts beside the four rows' next tokens
    prefill = (torch.randint(3, w.config.vocab_size, (2, 9)), torch.tensor([5, 4]), torch.zeros(2, dtype=torch.long),
               torch.tensor([9, 3]))
    decode = (got.argmax(-1), slots, lens)
    (p_got, d_got), (p_want, d_want) = (model.forward_mixed(c, prefill, decode, pad=pad)
                                        for c, pad in zip(caches, (False, True)))
    assert torch.equal(p_got, p_want) and torch.equal(d_got, d_want)
    assert torch.equal(caches[0].kv[..., :64, :], caches[1].kv[..., :64, :])
