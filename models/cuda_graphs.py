"""CUDA graphs for decode steps, one per batch-size bucket; prefill stays eager (models/llama.py decode_graphs).

A decode step of a small model is dozens of short kernel launches whose CPU-side cost dominates at small batches;
a captured graph replays them with one launch. Graphs have fixed shapes, so each bucket (1, 2, 4, 8, ... up to the
slot count) gets its own graph over static input buffers; a batch of n rows is copied into the smallest bucket that
holds it and the rest of the rows are filled with pad values chosen by the caller so that they touch nothing real
(for the slot cache: write position = the scratch cell max_seq_len, attention length 1). All buckets share one
memory pool, captured largest first.

    graphs = DecodeGraphs(step, inputs={"token_ids": InputSpec((), torch.long, 0), ...}, max_batch=8,
                          device="cuda:0")
    logits = graphs.run(token_ids=..., slot_ids=..., positions=..., lengths=...)   # a view: use before next run

`step(**static_inputs) -> Tensor` must be capturable: no host syncs (.item(), .tolist(), data-dependent shapes), so
on CUDA the Triton kernels, not the torch twins, whose decode attention reads lengths.max(). On a CPU device the
same object runs the step eagerly over the padded buffers (what the CPU tests exercise). torch.cuda is touched only
when capturing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself: at most 2x padding, log2(max) graphs."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    buckets = []
    b = 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} rows is larger than the largest captured bucket ({buckets[-1]})")


@dataclass(frozen=True)
class InputSpec:
    row_shape: tuple[int, ...]  # one row's shape (() for a scalar per row)
    dtype: torch.dtype
    pad: Any  # the value of rows beyond n


@dataclass
class _Bucket:
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor | None
    graph: Any  # torch.cuda.CUDAGraph, or None when eager


class DecodeGraphs:
    def __init__(self, step: Callable[..., torch.Tensor], inputs: dict[str, InputSpec], max_batch: int,
                 device: str | torch.device, *, warmup: int = 2, buckets: list[int] | None = None):
        self.step = step
        self.specs = inputs
        self.device = torch.device(device)
        self.buckets = buckets or batch_buckets(max_batch)
        self.use_graphs = self.device.type == "cuda"
        self._pool = None
        self._by_size: dict[int, _Bucket] = {}
        for b in sorted(self.buckets, reverse=True):  # largest first: the smaller graphs reuse its memory pool
            self._by_size[b] = self._capture(b, warmup)

    def _static_inputs(self, b: int) -> dict[str, torch.Tensor]:
        return {name: torch.full((b, *spec.row_shape), spec.pad, dtype=spec.dtype, device=self.device)
                for name, spec in self.specs.items()}

    def _capture(self, b: int, warmup: int) -> _Bucket:
        static = self._static_inputs(b)
        if not self.use_graphs:
            return _Bucket(static, None, None)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):  # Triton compiles and autotunes here, outside the capture
                self.step(**static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.step(**static)
        self._pool = graph.pool()
        return _Bucket(static, output, graph)

    def run(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Rows 0..n-1 of the step's output for these n rows."""
        if set(inputs) != set(self.specs):
            raise ValueError(f"expected inputs {sorted(self.specs)}, got {sorted(inputs)}")
        n = len(next(iter(inputs.values())))
        bucket = self._by_size[bucket_for(n, self.buckets)]
        for name, value in inputs.items():
            if len(value) != n:
                raise ValueError(f"input {name} has {len(value)} rows, expected {n}")
            buf = bucket.inputs[name]
            buf[:n].copy_(value)
            buf[n:].fill_(self.specs[name].pad)
        if bucket.graph is None:
            return self.step(**bucket.inputs)[:n]
        bucket.graph.replay()
        return bucket.output[:n]
