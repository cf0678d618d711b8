"""The decode step compiled by torch.compile (Inductor, CPU): one token per row, each row at its own position.

What is compiled is the one forward (models/forward.py) with torch's ops and every matmul in a form a graph can
hold; run eagerly, the same function is the reference and the fallback: prefill always runs eagerly, and decode
does until `compile()` has succeeded. What compiling buys is the ~600 small ops of a step between the matmuls (norms,
rotary, cache writes, attention, SiLU-gate) fused into a few generated C++ loops with no Python in between.

Shapes: `dynamic=True`, so one graph serves every batch of two rows or more and every attention length; torch
specialises a batch of one, so that is a second graph (`compile()` makes both). Attention looks at the longest row
rounded up to ATTENTION_ROUND positions, through a mask built here, like the eager path.

The weight matmuls reach the graph as custom ops: oneDNN's packed weights (`appliance::packed_linear`, here) and our
CPU kernels (models/quant.py's `traceable()`) are opaque to Inductor, which would otherwise try, and fail, to lower
them. torch's own int4 ops are traced as they are. The embedding lookup likewise, through its own `traceable()`
where it has one.

Inductor's artefacts (generated C++, compiled objects, FX graphs) are kept under `cache_dir` (the state
directory's `cache/inductor`), so a restart loads them instead of compiling again (TORCHINDUCTOR_CACHE_DIR, set for
this process: the worker serves one model).
"""
from __future__ import annotations

import logging
import os
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from models import packed_rows
from models.forward import forward
from models.forward_ops import ATTENTION_ROUND, attention_length
from models.llama import CastLinear, KVCache, Linear, LlamaModel, RefinedHead, RowStack

log = logging.getLogger(__name__)


# ---- the matmuls as ops torch.compile can place in a graph -------------------------------------------------------

@torch.library.custom_op("appliance::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return packed_rows.linear(x, packed)  # at the eager path's row counts, sharing its oneDNN kernels


@packed_linear.register_fake
def _(x, packed, out_features):
    return x.new_empty(x.shape[0], out_features)


def traceable(linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (rows, in) -> (rows, out) through ops a graph can hold, for each kind of matmul the model has: a weight's
    own `traceable()` where it offers one (models/quant.py's block weights: our CPU kernels as custom ops, torch's
    ops as they are), composite weights mapped part by part, oneDNN's packed weights as a custom op."""
    if hasattr(linear, "traceable"):
        return linear.traceable()
    if isinstance(linear, (RowStack, CastLinear, RefinedHead)):
        return linear.map(traceable)
    if isinstance(linear, Linear):
        if linear.packed is None:
            return lambda x: F.linear(x, linear.plain)
        return lambda x: packed_linear(x.to(linear.packed.dtype), linear.packed, linear.out_features).to(x.dtype)
    raise TypeError(f"no traceable form for {type(linear).__name__}")


WARM_UP = ((1, ATTENTION_ROUND), (1, 2 * ATTENTION_ROUND), (2, ATTENTION_ROUND), (3, 2 * ATTENTION_ROUND))


# One copy of the step's code object per kind of model (see CompiledDecode._own_decode): a handful per process.
_CODE_BY_KIND: dict[tuple, types.CodeType] = {}


class CompileUnavailable(RuntimeError):
    """torch.compile cannot build the decode step here (no C++ compiler, an unsupported op): decode stays eager."""


class CompiledDecode:
    """model's decode step over cache, compiled; `step()` has forward()'s numbers for rows of one token."""

    def __init__(self, model: LlamaModel, cache: KVCache, cache_dir: Path | None = None):
        if model.device.type != "cpu":
            raise CompileUnavailable("the compiled decode step is for CPUs (CUDA decodes through CUDA graphs)")
        self.model, self.cache, self.cache_dir = model, cache, cache_dir
        w = model.weights
        # The model's weights with every matmul in its traceable form (the tensors are the model's own).
        self.weights = replace(w, layers=[replace(lw, qkv=traceable(lw.qkv), o=traceable(lw.o),
                                                  gate_up=traceable(lw.gate_up), down=traceable(lw.down))
                                          for lw in w.layers], head=traceable(w.head),
                               embed=w.embed.traceable() if hasattr(w.embed, "traceable") else w.embed)
        self._cos, self._sin = model.rope_tables(cache)  # positions 0..max_seq_len: the scratch cell warm-up rows use
        self._compiled = None
        self.compile_seconds: float | None = None

    def _decode(self, token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The graph: token_ids, slot_ids, positions (B,) long; mask (B, 1, 1, T) bool -> fp32 logits (B, vocab)."""
        ops = self.model.torch_ops
        rows = ops.graph_decode_rows(token_ids, slot_ids, positions, mask, self._cos, self._sin)
        x = forward(self.weights, ops, self.cache.k_layers, self.cache.v_layers, [rows])
        return self.weights.head(x).float()

    def _own_decode(self):
        """_decode bound to self through a code object of this model's kind. Dynamo keeps its compiled entries,
        and counts recompiles against its limit (8), per code object: with one code object for all, every other
        model compiled in a process (a worker across deploys of other models; the test suite) added entries until
        compiling failed with FailOnRecompileLimitHit and decode stayed eager. A reload of the same kind of model
        (same configuration, weight types and cache) shares its code object and so reuses the graphs without a
        trace."""
        kind = (repr(self.model.config), tuple(self.cache.kv.shape), str(self.cache.kv.dtype),
                tuple(type(w).__name__ for w in (self.weights.embed, self.weights.head, *(
                    m for lw in self.weights.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)))))
        fn = CompiledDecode._decode
        code = _CODE_BY_KIND.setdefault(kind, fn.__code__.replace())
        own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        return types.MethodType(own, self)

    def compile(self) -> None:
        """Build the graphs now (a batch of one, and of several; each over any attention length): raises
        CompileUnavailable where torch cannot."""
        if self.cache_dir is not None:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        import torch._inductor.config as inductor_config
        from torch._inductor import cpp_builder, exc as inductor_exc
        # Compile in this process: a pool of compile workers would stay behind as children of the model's worker
        # (memory, processes), for no gain on a 2-core box whose other core is serving.
        inductor_config.compile_threads = 1
        started = time.monotonic()
        # The batch and attention-length dimensions are symbolic from the first trace (marked dynamic), everything
        # else (weights, the cache) static; torch specialises a batch of one, so there are two graphs. Each start
        # traces every graph again before it finds the compiled kernels in Inductor's cache (~2-4 s a trace for
        # a 1B model): marked, the warm-up traces twice; left to automatic dynamic shapes (a dimension becomes
        # symbolic once seen with two sizes) it traced three times. Warm-up rows write only slot 0's scratch cell.
        scratch = self.cache.max_seq_len
        try:
            cpp_builder.get_cpp_compiler()  # before tracing: without a compiler Inductor fails after a minute of it
            compiled = torch.compile(self._own_decode(), fullgraph=True)
            with torch.no_grad():
                for b, t_len in WARM_UP:  # lengths as step() makes them: never past max_seq_len
                    t_len = min(t_len, self.cache.max_seq_len)
                    args = (torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                            torch.full((b,), scratch), torch.ones(b, 1, 1, t_len, dtype=torch.bool))
                    torch._dynamo.mark_dynamic(args[3], 3)
                    if b > 1:
                        for arg in args:
                            torch._dynamo.mark_dynamic(arg, 0)
                    compiled(*args)
        except inductor_exc.InvalidCxxCompiler as exc:
            raise CompileUnavailable("no C++ compiler for Inductor (g++ or $CXX); install g++ for the compiled "
                                     "decode step") from exc
        except Exception as exc:  # noqa: BLE001 - whatever Inductor raises, the eager path serves
            raise CompileUnavailable(f"torch.compile of the decode step failed: {type(exc).__name__}: "
                                     f"{str(exc)[:300]}") from exc
        self._compiled = compiled
        self.compile_seconds = time.monotonic() - started
        log.info("decode step compiled in %.1f s", self.compile_seconds)

    @property
    def ready(self) -> bool:
        return self._compiled is not None

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 logits (B, vocab) of one new token per row at positions (B,), its K/V written into slot_ids."""
        t_len = attention_length(int(positions.max()) + 1, self.cache.max_seq_len)
        mask = (torch.arange(t_len) <= positions.unsqueeze(-1)).view(-1, 1, 1, t_len)
        return self._compiled(token_ids, slot_ids, positions, mask)
