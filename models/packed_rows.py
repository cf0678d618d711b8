"""oneDNN's packed matmuls at a small fixed set of row counts, whatever rows a step has.

oneDNN builds a kernel for each row count a packed linear (`torch.ops.mkldnn._linear_pointwise`) is called with
(JIT code: about 0.6 MB resident and 1-10 ms to build, for any matrix size here) and keeps it: ideep's and oneDNN's
primitive caches hold up to 1024 each (LRU_CACHE_CAPACITY, ONEDNN_PRIMITIVE_CACHE_CAPACITY), and what they evict
is not all given back. The engine's steps have ragged row counts (prefill chunks padded to the longest, plus the
decode rows), so under steady load a generative worker kept building kernels: its RSS grew ~0.1 MB per Generate
call on the soak of tests/test_workers_load.py (320 -> 700 MB in 70 s, issue 18), hundreds of MB before the caches
would level off.

So rows are padded with zeros up to one of ROW_COUNTS (1..8 exactly, then four per doubling: 10, 12, 14, 16, 20,
24, ..., 448, 512; at most 25% added rows, ~10% on average), and more than MAX_ROWS run in blocks of MAX_ROWS:
at most 32 kernels per matrix shape (and matrices of one shape share them). A row's result does not depend on the
rows beside it (fp32 batch invariance, tests/test_batch_invariance.py), so padding changes no number.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models import torch_internals

EXACT_ROWS = 8  # decode batches: every count up to here is its own kernel
MAX_ROWS = 512  # larger inputs run in blocks of this many rows


def padded_rows(rows: int) -> int:
    """The row count a packed matmul of `rows` rows (1..MAX_ROWS) runs at."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)  # a quarter of the power of two below rows: four counts per doubling
    return -(-rows // step) * step


ROW_COUNTS = sorted({padded_rows(n) for n in range(1, MAX_ROWS + 1)})


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) times the packed weight (+ bias) -> (rows, out), through kernels for ROW_COUNTS only."""
    rows = x.shape[0]
    if rows > MAX_ROWS:
        return torch.cat([linear(x[i:i + MAX_ROWS], packed, bias) for i in range(0, rows, MAX_ROWS)])
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    y = torch_internals.onednn_linear(x, packed, bias)
    return y if padded == rows else y[:rows]
