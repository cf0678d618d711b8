"""Weight-only int8 / int4 (group 32) matmul: format round trip, Triton (interpreter) against the torch twin."""
import pytest
import torch
import torch.nn.functional as F

from kernels import dequant_matmul, quantize_weight
from kernel_cases import assert_close, dtypes


@pytest.mark.parametrize("bits,worst", [(8, 0.5 / 127), (4, 0.5 / 7)])
def test_quantize_round_trip_error_is_half_a_step(bits, worst):
    w = torch.randn(48, 128)
    qw = quantize_weight(w, bits)
    assert qw.scales.shape == (48, 4) and qw.scales.dtype == torch.float16
    assert qw.qweight.shape == ((48, 128) if bits == 8 else (48, 64))
    group_max = w.abs().reshape(48, 4, 32).amax(-1, keepdim=True)
    err = (qw.dequantize() - w).abs().reshape(48, 4, 32) / group_max
    assert err.max() <= worst * 1.01  # fp16 scales add a little


def test_int4_nibble_order_low_is_even_input():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 7.0, -7.0  # scale 1: nibbles 15 (input 0) and 1 (input 1)
    qw = quantize_weight(w, 4)
    assert int(qw.qweight[0, 0]) == 15 | (1 << 4)


@dtypes
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 64, 128), (8, 96, 192), (17, 40, 64)])
def test_kernel_matches_twin(dtype, bits, rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * out_f + bits)
    qw = quantize_weight(torch.randn(out_f, in_f, generator=g), bits)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    got = dequant_matmul(x, qw, backend="triton")
    assert got.dtype == dtype and got.shape == (rows, out_f)
    assert_close(got, dequant_matmul(x, qw, backend="torch"), dtype)
    assert_close(got, F.linear(x.float(), qw.dequantize()), dtype, "against fp32")


def test_leading_dims_and_bad_width():
    qw = quantize_weight(torch.randn(32, 64), 8)
    x = torch.randn(2, 3, 64)
    assert dequant_matmul(x, qw, backend="triton").shape == (2, 3, 32)
    with pytest.raises(ValueError, match="64"):
        dequant_matmul(torch.randn(2, 48), qw)
    with pytest.raises(ValueError, match="group size"):
        quantize_weight(torch.randn(4, 48), 4)
