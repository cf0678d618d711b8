"""Weights kept quantized: one type, `BlockMatrix`, for every GGUF block format the CPU kernels serve (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), holding the file's own numbers in the kernels' panel layout (kernels/cpu_layout.py), and
the layers that multiply by it.

`engine.weights` formats that keep matrices quantized (FORMATS):
- blocks: a GGUF file's matrices in their own block types, as they are (Q4_K_M files mix Q4_K and Q6_K; the
  embeddings / output matrix are often Q8_0 or Q6_K): nothing is requantized.
- int8: every matrix as Q8_0 (a file's Q8_0 as it is; other types and float weights quantized per block of 32 by
  gguf's own quantizer).
- int4: every matrix 4-bit: a file's Q4_0 / Q4_1 / Q4_K as they are, others quantized to Q4_1 by gguf's quantizer.
The embeddings and the output matrix of a quantized model are BlockMatrix too: the file's block type, or Q8_0 for a
float one. The embedding lookup dequantizes the rows it needs; the head multiplies approximately (our kernels,
int8 activations) and recomputes its 16 highest logits from the exact rows with fp32 activations, so the tokens
greedy decoding and top-p sampling choose among carry the file's numbers.

Multiplying (`linear_for`): with `cpu_kernels` (kernels.cpu_quant.CpuKernels: an ISA's library and the activation
mode, int8 or float32) our kernels; without, torch's ops: the 4-bit types through torch's
`_weight_int4pack_mm_for_cpu` (fp32 activations, the same numbers), others through a dense fp32 copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_layout
from models import torch_internals

GROUP = cpu_layout.QK  # the block size every format's scales (or sub-scales) come in multiples of
ROW_CHUNK = 256  # rows dequantised / quantized at a time (a multiple of the 16-row panel)
FORMATS = ("int8", "int4", "blocks")
BLOCK_TYPES = tuple(cpu_layout.FORMATS)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
HEAD_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
REFINE = 16  # the head's highest logits recomputed exactly


@dataclass(eq=False)
class BlockMatrix:
    """An (N, K) matrix in GGUF block type `type_name`, laid out for the CPU kernels: `data` (ceil(N / 16),
    records, record bytes) uint8 (kernels/cpu_layout.py describes every field)."""
    type_name: str
    shape: tuple[int, int]
    data: torch.Tensor

    @classmethod
    def from_layout(cls, type_name: str, shape: tuple[int, int], data: np.ndarray | torch.Tensor) -> "BlockMatrix":
        t = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
        return cls(type_name, (int(shape[0]), int(shape[1])), t)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _np(self) -> np.ndarray:
        return self.data.numpy()

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K), gguf's numbers (tests, oracles, and the dense fallbacks)."""
        n, k = self.shape
        return torch.from_numpy(cpu_layout.dequantize(self._np(), self.type_name, n, k))

    def rows(self, ids: torch.Tensor, kernels=None) -> torch.Tensor:
        """float32 (len(ids), K): output rows ids, exact (the embedding lookup, the head's refinement)."""
        n, k = self.shape
        if kernels is not None:
            return kernels.rows(self.data, self.type_name, n, k, ids)
        flat = ids.reshape(-1).cpu().numpy()
        return torch.from_numpy(cpu_layout.panel_rows(self._np(), self.type_name, n, k, flat))

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q uint8 (N, K) 0..15, scale, zero (N, K / 32) fp32), w = (q - 8) scale + zero, for Q4_0 / Q4_1 / Q4_K
        (torch's int4 op and the Triton kernel read this form); None for other types."""
        out = cpu_layout.int4_groups(self._np(), self.type_name, *self.shape)
        return None if out is None else tuple(torch.from_numpy(a) for a in out)

    def int8_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q int8 (N, K), scale (N, K / 32) fp32), w = q scale, for Q8_0; None for other types."""
        out = cpu_layout.int8_blocks(self._np(), self.type_name, *self.shape)
        return None if out is None else tuple(torch.from_numpy(a) for a in out)


QuantizedMatrix = BlockMatrix


# ---- making block matrices ---------------------------------------------------------------------------------------

def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int], fmt: str = "blocks",
                     dequantize_blocks=None, row_order: np.ndarray | None = None) -> BlockMatrix:
    """A GGUF matrix (raw: its bytes, N rows) in format fmt (FORMATS): the file's own blocks where fmt keeps its
    type, else dequantised a row chunk at a time by `dequantize_blocks(raw_rows, type_name) -> float32 (rows, K)`
    and quantized by gguf's quantizer. row_order: output rows reordered (llama's q/k un-permutation), on the raw
    rows before anything else (GGUF rows are independent runs of blocks)."""
    n, k = shape
    rows = np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8)).reshape(n, -1)
    if row_order is not None:
        rows = rows[np.asarray(row_order)]
    keep = {"blocks": BLOCK_TYPES, "int8": ("Q8_0",), "int4": FOUR_BIT}[fmt]
    if type_name in keep and k % cpu_layout.FORMATS[type_name].super_block == 0:
        return BlockMatrix.from_layout(type_name, shape, cpu_layout.from_gguf(rows, type_name, n, k))
    if dequantize_blocks is None:
        raise ValueError(f"a {type_name} matrix cannot be kept as {fmt} without a decoder")
    target = "Q8_0" if fmt != "int4" else "Q4_1"
    return _quantized(((rows[i:i + ROW_CHUNK], dequantize_blocks(rows[i:i + ROW_CHUNK], type_name))
                       for i in range(0, n, ROW_CHUNK)), target, shape)


def _quantized(chunks: Iterator[tuple[object, np.ndarray]], target: str, shape: tuple[int, int]) -> BlockMatrix:
    parts = [cpu_layout.quantize_float(np.asarray(w, np.float32).reshape(-1, shape[1]), target) for _raw, w in chunks]
    return BlockMatrix.from_layout(target, shape, np.concatenate(parts))


def quantize(w: torch.Tensor, fmt: str) -> BlockMatrix:
    """A float matrix (an HF safetensors file's) quantized at load by gguf's quantizer, a row chunk at a time: int8
    -> Q8_0, int4 -> Q4_1 (K a multiple of 32; otherwise ValueError)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"a matrix with {k} inputs cannot be quantized in blocks of {GROUP}")
    target = "Q4_1" if fmt == "int4" else "Q8_0"
    return _quantized(((None, w[i:i + ROW_CHUNK].float().numpy()) for i in range(0, n, ROW_CHUNK)), target, (n, k))


def float_chunks(w: torch.Tensor, rows: int = ROW_CHUNK) -> Iterator[torch.Tensor]:
    for i in range(0, w.shape[0], rows):
        yield w[i:i + rows]


def concat_rows(parts: list[BlockMatrix]) -> BlockMatrix:
    """Matrices stacked along the output rows (fused qkv, gate/up); ValueError for different types."""
    first = parts[0]
    if any(p.type_name != first.type_name or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("cannot fuse matrices of different formats")
    n = sum(p.shape[0] for p in parts)
    if all(p.shape[0] % cpu_layout.PANEL == 0 for p in parts):  # whole panels: the layouts stack as they are
        adjacent = _adjacent_view(parts)
        data = adjacent if adjacent is not None else torch.cat([p.data for p in parts])
        return BlockMatrix(first.type_name, (n, first.shape[1]), data)
    unpacked = [cpu_layout.unpack(p._np(), p.type_name, *p.shape) for p in parts]
    joined = {key: np.concatenate([u[key] for u in unpacked]) for key in unpacked[0]}
    return BlockMatrix.from_layout(first.type_name, (n, first.shape[1]),
                                   cpu_layout.pack(joined, first.type_name, n, first.shape[1]))


def _adjacent_view(parts: list[BlockMatrix]) -> torch.Tensor | None:
    """The parts' data as one view when they lie back to back in one storage (the weight cache stores q/k/v and
    gate/up so, loader/weight_cache.py): fused without a copy, still a view of the mapped file (a 1B model's
    gate/up copies were 300 MB of private memory per worker). None when they do not."""
    first = parts[0].data  # concat_rows checked one format and one K: every part's records are alike
    if not all(p.data.is_contiguous() for p in parts):
        return None
    storage = first.untyped_storage()
    end = first.data_ptr()
    for p in parts:
        if p.data.untyped_storage().data_ptr() != storage.data_ptr() or p.data.data_ptr() != end:
            return None
        end += p.data.numel() * p.data.element_size()
    panels = sum(p.data.shape[0] for p in parts)
    return torch.as_strided(first, (panels, *first.shape[1:]), first.stride(), first.storage_offset())


def permute_rows(m: BlockMatrix, index: torch.Tensor) -> BlockMatrix:
    """The matrix with its output rows in the order `index`."""
    parts = cpu_layout.unpack(m._np(), m.type_name, *m.shape)
    idx = np.asarray(index)
    return BlockMatrix.from_layout(m.type_name, m.shape,
                                   cpu_layout.pack({k: v[idx] for k, v in parts.items()}, m.type_name, *m.shape))


def dequantize(m: BlockMatrix) -> torch.Tensor:
    """float32 weights (tests, oracles, dense fallbacks)."""
    return m.dequantize()


# ---- our kernels as ops a compiled graph can hold ---------------------------------------------------------------

@torch.library.custom_op("quant::block_matmul", mutates_args=())
def block_matmul(x: torch.Tensor, data: torch.Tensor, type_name: str, n: int, library: str, isa: str,
                 exact: bool) -> torch.Tensor:
    """x (rows, K) float32 @ W^T through the kernel library at `library` (its path: stable across processes, so
    a compiled step's package names it in the next one too)."""
    from kernels import cpu_quant
    return cpu_quant.matmul(library, isa, exact, x.float().contiguous(), data, type_name, n)


@block_matmul.register_fake
def _(x, data, type_name, n, library, isa, exact):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


@torch.library.custom_op("quant::block_rows", mutates_args=())
def block_rows(data: torch.Tensor, type_name: str, n: int, k: int, ids: torch.Tensor, library: str,
               isa: str) -> torch.Tensor:
    from kernels import cpu_quant
    kern = cpu_quant.CpuKernels(isa, "int8", library, cpu_quant.library_at(library))
    return kern.rows(data, type_name, n, k, ids)


@block_rows.register_fake
def _(data, type_name, n, k, ids, library, isa):
    return data.new_empty(ids.numel(), k, dtype=torch.float32)


# torch's CPU int4 matmul as an op a compiled graph keeps whole (Inductor's own lowering of it adds a tensor of its
# own, the group size, which a package whose tensors are all handed over at load does not have). Registered with the
# dispatcher directly: a torch.library.custom_op imports torch._dynamo at its first call (loader/compiled_decode.py).
_OPS = torch.library.Library("quant", "FRAGMENT")
_OPS.define("torch_int4_mm(Tensor x, Tensor packed, Tensor scales_zeros) -> Tensor")
_OPS.impl("torch_int4_mm", lambda x, packed, scales_zeros: torch_internals.int4_matmul(x, packed, GROUP, scales_zeros),
          "CPU")


@torch.library.register_fake("quant::torch_int4_mm")
def _(x, packed, scales_zeros):
    return x.new_empty(x.shape[0], scales_zeros.shape[1])  # scales_zeros: (K / GROUP, n, 2)


def _rows_op(kernels):
    """block_rows through the C++ operator where it is loaded (type by its code), else the Python custom op."""
    if not kernels.op:
        return block_rows
    op = torch.ops.quant_cpu.block_rows.default
    return lambda data, type_name, n, k, ids, library, isa: op(data, cpu_layout.FORMATS[type_name].code, n, k, ids,
                                                                 library, isa)


# ---- multiplying -------------------------------------------------------------------------------------------------

class BlockLinear:
    """y = x @ W.T for a BlockMatrix: our kernels (cpu_kernels), or torch's ops without them."""

    def __init__(self, m: BlockMatrix, cpu_kernels=None):
        self.matrix = m
        self.out_features, self.in_features = m.shape
        self.kernels = cpu_kernels
        self._int4 = self._dense = None
        if cpu_kernels is None:
            groups = m.int4_groups() if m.type_name in FOUR_BIT and m.shape[0] % 16 == 0 else None
            if groups is not None:  # torch's CPU int4 op, fp32 activations
                q, scale, zero = groups
                self._int4 = (torch_internals.int4_pack(q.to(torch.int32).contiguous(), 1),
                              torch.stack([scale.t(), zero.t()], dim=-1).float().contiguous())
            else:
                self._dense = m.dequantize()

    @property
    def label(self) -> str:
        if self.kernels is not None:
            return f"{self.matrix.type_name}/{self.kernels.label}"
        return f"{self.matrix.type_name}/{'torch-int4' if self._int4 is not None else 'dense-fp32'}"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is not None:
            y = self.kernels.matmul(x2, self.matrix.data, self.matrix.type_name, self.out_features)
        elif self._int4 is not None:
            y = torch_internals.int4_matmul(x2, self._int4[0], GROUP, self._int4[1])
        else:
            y = F.linear(x2, self._dense)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], self.out_features)

    def traceable(self):
        """The same product through an op a compiled graph keeps whole."""
        k = self.kernels
        if k is None and self._int4 is not None:
            packed, scales_zeros, n = self._int4[0], self._int4[1], self.out_features
            op = torch.ops.quant.torch_int4_mm.default
            return lambda x: op(x.reshape(-1, self.in_features).float().contiguous(), packed,
                                scales_zeros).view(*x.shape[:-1], n)
        if k is None:
            return lambda x: self(x)  # torch's ops (aten) trace as they are
        data, fmt, n, exact = self.matrix.data, self.matrix.type_name, self.out_features, k.activations == "float32"
        if k.op:  # the C++ operator: ~3 us a call from the graph, against ~16 through the Python custom op
            code, op = cpu_layout.FORMATS[fmt].code, torch.ops.quant_cpu.block_matmul.default
            return lambda x: op(x, data, code, n, k.path, k.isa, exact)
        return lambda x: block_matmul(x, data, fmt, n, k.path, k.isa, exact)


def linear_for(m: BlockMatrix, cpu_kernels=None) -> BlockLinear:
    """The linear layer for a quantized matrix; cpu_kernels: kernels.cpu_quant.CpuKernels, or None for torch's ops."""
    return BlockLinear(m, cpu_kernels)


class BlockEmbedding:
    """Token embeddings kept in the file's block format: a lookup dequantizes the rows it needs (exact)."""

    def __init__(self, m: BlockMatrix, cpu_kernels=None):
        self.matrix, self.kernels = m, cpu_kernels
        self.num_embeddings, self.embedding_dim = m.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids, self.kernels).view(*ids.shape, self.embedding_dim)

    def traceable(self):
        k, m = self.kernels, self.matrix
        if k is None:
            return self
        n, kk = m.shape
        return lambda ids: _rows_op(k)(m.data, m.type_name, n, kk, ids.reshape(-1), k.path,
                                       k.isa).view(*ids.shape, kk)


class BlockHead:
    """The output matrix in the file's block format: every logit from our kernels (int8 activations, or float32),
    then the REFINE highest recomputed from the exact rows with fp32 activations and fp32 sums."""

    def __init__(self, m: BlockMatrix, cpu_kernels=None):
        self.matrix, self.kernels = m, cpu_kernels
        self.out_features, self.in_features = m.shape
        self.linear = BlockLinear(m, cpu_kernels)
        self.exact = cpu_kernels is not None and cpu_kernels.activations == "float32"

    def _refine(self, x: torch.Tensor, approx: torch.Tensor, rows) -> torch.Tensor:
        top = approx.topk(min(REFINE, self.out_features), dim=-1).indices  # (r, REFINE)
        exact = torch.einsum("rh,rkh->rk", x, rows(top).view(*top.shape, self.in_features))
        return approx.scatter(1, top, exact)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.in_features).float().contiguous()
        approx = self.linear(x)
        if self.exact:  # the float32 kernels' logits are the exact ones already
            return approx
        return self._refine(x, approx, lambda ids: self.matrix.rows(ids, self.kernels))

    def traceable(self):
        k, m = self.kernels, self.matrix
        if k is None:
            return lambda x: self(x)
        mm = self.linear.traceable()
        n, kk = m.shape
        rows = lambda ids: _rows_op(k)(m.data, m.type_name, n, kk, ids.reshape(-1), k.path, k.isa)  # noqa: E731
        if self.exact:
            return lambda x: mm(x.float())
        return lambda x: self._refine(x.float(), mm(x.float()), rows)


def head_for(m: BlockMatrix, cpu_kernels=None) -> BlockHead:
    return BlockHead(m, cpu_kernels)


def describe(tensors: dict) -> str:
    """The block types of a model's matrices, most weights first: "Q4_1+Q8_0" (the weight-format label)."""
    sizes: dict[str, int] = {}
    for t in tensors.values():
        if isinstance(t, BlockMatrix):
            sizes[t.type_name] = sizes.get(t.type_name, 0) + t.shape[0] * t.shape[1]
    return "+".join(sorted(sizes, key=lambda name: -sizes[name]))
