"""The Triton side of the quantized formats (kernels/dequant_matmul.py): int4 nibbles in GGUF's order, int8, one
scale (and a zero) per group; the kernel (interpreter) against its torch twin and against the formats' own
numbers: models/quant.py's Int4Groups / Int8Rows and gguf's dequantization of Q4_0 / Q4_1 / Q8_0 blocks."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import group_matmul, pack_int4
from kernels.dequant_matmul import dequantize, unpack_int4
from kernel_cases import assert_close, dtypes
from models import quant
from models.gpu_linear import gpu_linear


def test_nibble_order_is_ggufs():
    q = torch.arange(32, dtype=torch.uint8).view(1, 32) % 16
    packed = pack_int4(q)
    assert packed.shape == (1, 16)
    assert int(packed[0, 0]) == 0 | (0 << 4) and int(packed[0, 1]) == 1 | (1 << 4)
    q[0, 16] = 9
    assert int(pack_int4(q)[0, 0]) == 0 | (9 << 4)  # byte 0: input 0 low, input 16 high
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def _random_int4(out_f, in_f, group, g):
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // group, generator=g) * 0.1 + 0.01
    zero = torch.randn(out_f, in_f // group, generator=g) * 0.1
    return pack_int4(q), scale, zero


@dtypes
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,out_f,in_f,group", [(1, 64, 128, 32), (8, 96, 192, 64), (17, 40, 64, 64),
                                                   (3, 24, 96, 32)])
def test_kernel_matches_twin(dtype, bits, rows, out_f, in_f, group):
    g = torch.Generator().manual_seed(rows * out_f + bits)
    if bits == 4:
        q, scale, zero = _random_int4(out_f, in_f, group, g)
    else:
        q = torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int8)
        scale, zero = torch.rand(out_f, in_f // group, generator=g) * 0.01, None
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    got = group_matmul(x, q, scale, zero, bits=bits, group=group, backend="triton")
    assert got.dtype == dtype and got.shape == (rows, out_f)
    assert_close(got, group_matmul(x, q, scale, zero, bits=bits, group=group, backend="torch"), dtype)
    assert_close(got, F.linear(x.float(), dequantize(q, scale, zero, bits, group)), dtype, "against fp32")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_blocks_through_the_gpu_linear_equal_gguf_dequantize(qtype):
    """A GGUF matrix kept in its blocks (quant.BlockMatrix, the type the CPU kernels multiply) and laid out for the
    Triton kernel multiplies as gguf's own dequantization of the same blocks."""
    from models.gpu_linear import TritonQuantLinear
    rng = np.random.default_rng(3)
    k = 256 if qtype == "Q4_K" else 96  # K-quants come in super-blocks of 256
    w = (rng.standard_normal((40, k)) * rng.uniform(0.1, 2.0, size=(40, 1))).astype(np.float32)
    if qtype == "Q4_K":  # gguf cannot quantize to K-quants: random super-blocks, finite fp16 d and dmin
        raw = rng.integers(0, 256, size=(40, k // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.frombuffer(rng.uniform(0.001, 0.05, size=(40, k // 256, 2)).astype(np.float16)
                                      .tobytes(), np.uint8).reshape(40, k // 256, 4)
        raw = raw.reshape(40, -1)
    else:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))
    m = quant.from_gguf_blocks(raw, qtype, w.shape)
    lin = gpu_linear(m, torch.device("cpu"), torch.float32, backend="triton")
    assert isinstance(lin, TritonQuantLinear) and lin.bits == (8 if qtype == "Q8_0" else 4)
    x = torch.randn(5, k)
    torch.testing.assert_close(lin(x), F.linear(x, ref), rtol=1e-4, atol=1e-4)


def test_leading_dims_and_bad_shapes():
    q, scale, zero = _random_int4(32, 64, 32, torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 64)
    assert group_matmul(x, q, scale, zero, bits=4, group=32, backend="triton").shape == (2, 3, 32)
    with pytest.raises(ValueError, match="64"):
        group_matmul(torch.randn(2, 48), q, scale, zero, bits=4, group=32)
    with pytest.raises(ValueError, match="group"):
        group_matmul(x, q, scale, zero, bits=4, group=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(torch.zeros(4, 48, dtype=torch.uint8))
