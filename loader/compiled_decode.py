"""The decode step compiled ahead of time (torch.export, then AOTInductor on the CPU): one token per row, each row at
its own position.

What is compiled is the one forward (models/forward.py) with torch's ops and every matmul in a form a graph can
hold; run eagerly, the same function is the reference and the fallback: prefill always runs eagerly, and decode
does until `compile()` has succeeded. What compiling buys is the ~600 small ops of a step between the matmuls (norms,
rotary, cache writes, attention, SiLU-gate) fused into a few generated C++ loops with no Python in between.

Ahead of time, not torch.compile: a package (a shared object and its metadata) is built once per kind of model and
cache, on this box (`appliance models prepare`, the package's postinst, or the first start) and kept under
`cache_dir`; every later start loads it through torch's C++ loader in milliseconds and hands it the model's own
weight and cache tensors by name (nothing copied). torch.compile traced the step again at every start before its
cache answered (8.5 s of a 1B model's 11 s start here) and imported the compiler (~110 MB per worker).

Shapes: the batch (1 to the slots) and the attention length are symbolic: one graph serves every step. Attention
looks at the longest row rounded up to ATTENTION_ROUND positions, through a mask built here, like the eager path.

The weight matmuls reach the graph as custom ops: oneDNN's packed weights (`appliance::packed_linear`, here) and our
CPU kernels (models/quant.py's `traceable()`) are opaque to Inductor, which would otherwise try, and fail, to lower
them; the package calls them through torch's dispatcher. torch's own int4 ops are traced as they are.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import models
from models import packed_rows, torch_internals
from models.forward import forward
from models.forward_ops import ATTENTION_ROUND, GraphOps, attention_length
from models.llama import CastLinear, KVCache, Linear, LlamaModel, RefinedHead, RowStack

PACKAGE_FORMAT = 1  # bump when the traced module's names or inputs change
# The sources of what is traced: a package built from other code is another package (an upgrade of these files
# builds anew; a package never outlives the forward it was traced from).
_MODELS = Path(models.__file__).parent
_TRACED_SOURCES = hashlib.sha256(b"".join(
    path.read_bytes() for path in (_MODELS / "forward.py", _MODELS / "forward_ops.py", Path(__file__),
                                   _MODELS / "quant.py"))).hexdigest()

log = logging.getLogger(__name__)


# ---- the matmuls as ops a compiled graph can hold --------------------------------------------------------------

# Registered with the dispatcher directly, not as torch.library.custom_op: a custom_op's kernel imports the whole of
# torch._dynamo (and Inductor's modules, ~70 MB) at its first call, which the compiled step makes in the worker.
_OPS = torch.library.Library("appliance", "DEF")
_OPS.define("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor")
for _key in ("CPU", "MkldnnCPU"):  # the packed weight is a oneDNN tensor, which dispatches as MkldnnCPU
    _OPS.impl("packed_linear", lambda x, packed, out_features: packed_rows.linear(x, packed), _key)  # at the eager
    # path's row counts, sharing its oneDNN kernels


@torch.library.register_fake("appliance::packed_linear")
def _(x, packed, out_features):
    return x.new_empty(x.shape[0], out_features)


packed_linear = torch.ops.appliance.packed_linear.default


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


# ---- the weights as named tensors, so the compiled step takes them at load instead of holding copies ------------

def _ours(obj) -> bool:
    """An object of our weight types (models/, kernels/): walked for tensors; anything else is a leaf."""
    return type(obj).__module__.split(".")[0] in ("models", "kernels") and hasattr(obj, "__dict__")


def named_tensors(obj, prefix: str, out: dict[str, torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable from obj through lists, tuples, dicts and our weight types, named by its path
    (first path wins for a tensor shared by two holders: a head tied to the embeddings)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            out[prefix] = obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            named_tensors(item, f"{prefix}_{i}", out, seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            named_tensors(item, f"{prefix}_{key}", out, seen)
    elif _ours(obj):
        for key, item in vars(obj).items():
            named_tensors(item, f"{prefix}_{key}", out, seen)


def _rebound(obj, by_id: dict[int, torch.Tensor], memo: dict[int, object]):
    """A copy of obj whose tensors are by_id's stand-ins (the traced module's buffers): lists, tuples, dicts and our
    weight types copied (shallowly, each once: shared holders stay shared), everything else the same object."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = by_id.get(id(obj), obj)
    elif isinstance(obj, (list, tuple)):
        out = type(obj)(_rebound(item, by_id, memo) for item in obj)
    elif isinstance(obj, dict):
        out = {key: _rebound(item, by_id, memo) for key, item in obj.items()}
    elif _ours(obj):
        out = copy.copy(obj)
        for key, item in vars(obj).items():
            out.__dict__[key] = _rebound(item, by_id, memo)
    else:
        out = obj
    memo[id(obj)] = out
    return out


def structure(obj) -> str:
    """What the compiled step's code depends on besides tensor values: our weight types, their plain settings
    (block formats, kernel library and ISA, sizes) and each tensor's shape and dtype."""
    if isinstance(obj, torch.Tensor):
        strides = tuple(obj.stride()) if obj.layout == torch.strided else obj.layout
        return f"T{tuple(obj.shape)}{obj.dtype}{strides}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(structure(item) for item in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k}:{structure(v)}" for k, v in obj.items()) + "}"
    if _ours(obj):
        return type(obj).__name__ + "(" + ",".join(f"{k}={structure(v)}" for k, v in vars(obj).items()) + ")"
    if isinstance(obj, (str, int, float, bool, torch.dtype, type(None))):
        return repr(obj)
    return type(obj).__name__


def traceable_weights(w):
    """The model's weights with every matmul in its traceable form (the tensors are w's own)."""
    return replace(w, layers=[replace(lw, qkv=traceable(lw.qkv), o=traceable(lw.o), gate_up=traceable(lw.gate_up),
                                      down=traceable(lw.down)) for lw in w.layers], head=traceable(w.head),
                   embed=w.embed.traceable() if hasattr(w.embed, "traceable") else w.embed)


class _Step(torch.nn.Module):
    """The decode step as torch.export traces it: the weights, rotary tables and each layer's K and V cache are
    buffers under stable names (so a later process hands its own tensors to the compiled package by name), and the
    step writes the cache buffers in place. oneDNN's packed weights are opaque tensors (no strides) that Inductor
    cannot hold as constants: they come in as inputs instead, after the step's own."""

    def __init__(self, model: LlamaModel, weights: dict[str, torch.Tensor], opaque: list[torch.Tensor],
                 cache: KVCache):
        super().__init__()
        self._model, self._ids = model, {name: id(t) for name, t in weights.items()}
        self._opaque_ids = [id(t) for t in opaque]
        for name, t in weights.items():
            self.register_buffer(name, t)
        for i, (k, v) in enumerate(zip(cache.k_layers, cache.v_layers)):
            self.register_buffer(f"cache_k_{i}", k)
            self.register_buffer(f"cache_v_{i}", v)
        self._layers = len(cache.k_layers)

    def forward(self, token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, opaque: list[torch.Tensor]) -> torch.Tensor:
        """token_ids, slot_ids, positions (B,) long; mask (B, 1, 1, T) bool -> fp32 logits (B, vocab)."""
        by_id = {tensor_id: getattr(self, name) for name, tensor_id in self._ids.items()}
        by_id.update(zip(self._opaque_ids, opaque))
        w = traceable_weights(_rebound(self._model.weights, by_id, {}))
        ops = GraphOps(self._model.config.rms_norm_eps, self._model.torch_ops.attention)
        rows = ops.graph_decode_rows(token_ids, slot_ids, positions, mask, self.rope_cos, self.rope_sin)
        x = forward(w, ops, [getattr(self, f"cache_k_{i}") for i in range(self._layers)],
                    [getattr(self, f"cache_v_{i}") for i in range(self._layers)], [rows])
        return w.head(x).float()


# Values per thread (at the export's batch of two) below which a generated loop runs on one thread. A parallel loop
# costs ~2.5 us and two futex calls to start and join (libgomp), more than a norm, the rotary or a silu of a row or
# sixteen takes; Inductor's own 512 made ~130 such regions in a SmolLM2 step. With 4096 the vocabulary's, the 1B's
# MLP and Inductor's own attention stay parallel. Under avx2 on a 2-core EPYC (noisy host, best of 10 s), with the
# kernels' one-thread calls: SmolLM2 Q4_0's step 3.5-3.7 -> 3.1-3.4 ms at one row, the same at 16 rows and on the
# 1B; every loop serial instead made the 1B's 16-row step 0.96x.
LOOP_MIN_CHUNK = 4096


class CompileUnavailable(RuntimeError):
    """torch cannot build the decode step here (no C++ compiler, an unsupported op): decode stays eager."""


# Inductor's -march for a torch capped by ATEN_CPU_CAPABILITY (where TORCHINDUCTOR_CPP_MARCH says nothing): its
# vector code follows the cap, but its other loops are built with -march=native, which on an AVX-512 CPU lets the
# compiler use zmm registers anyway (an AVX2 box could not run that package).
_MARCH_FOR_CAPABILITY = {"avx2": "x86-64-v3", "default": "x86-64"}


def inductor_march() -> str | None:
    """The -march the generated code is built with: TORCHINDUCTOR_CPP_MARCH, else the one ATEN_CPU_CAPABILITY caps
    it to, else None (Inductor's own: native)."""
    explicit = os.environ.get("TORCHINDUCTOR_CPP_MARCH")
    if explicit:
        return explicit
    return _MARCH_FOR_CAPABILITY.get(os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())


def inductor_isa() -> str:
    """What the generated code may use: torch's CPU capability (which Inductor's vector ISA follows) and -march (part
    of the package's key, so a package built for one capability is never loaded under another). Read from ATen, not
    from Inductor: the serving process never imports the compiler."""
    return f"{torch.backends.cpu.get_cpu_capability().lower()}/{inductor_march() or 'native'}"


class CompiledDecode:
    """model's decode step over cache, compiled ahead of time; `step()` has forward()'s numbers for rows of one
    token."""

    def __init__(self, model: LlamaModel, cache: KVCache, cache_dir: Path | None = None):
        if model.device.type != "cpu":
            raise CompileUnavailable("the compiled decode step is for CPUs (CUDA decodes through CUDA graphs)")
        self.model, self.cache, self.cache_dir = model, cache, cache_dir
        found: dict[str, torch.Tensor] = {}
        named_tensors(model.weights, "w", found, set())
        found["rope_cos"], found["rope_sin"] = model.rope_tables(cache)
        self.weights = {name: t for name, t in found.items() if t.layout == torch.strided}
        self.opaque = [t for t in found.values() if t.layout != torch.strided]  # inputs of every step
        self._runner = None
        self.compile_seconds: float | None = None
        self.built = False  # this process compiled the package (False: loaded a package compiled before)

    def package_path(self, directory: Path) -> Path:
        """The package for this kind of model and cache and this many threads (not these weights: they are handed
        over at load)."""
        key = "|".join((str(PACKAGE_FORMAT), _TRACED_SOURCES, torch.__version__, repr(self.model.config),
                        structure(self.weights), structure(self.model.weights),
                        f"{tuple(self.cache.kv.shape)}{self.cache.kv.dtype}", f"threads {torch.get_num_threads()}",
                        f"loop chunk {LOOP_MIN_CHUNK}", inductor_isa()))
        return directory / f"decode-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt2"

    @property
    def prepared(self) -> bool:
        """A package for this kind of model and cache is in cache_dir: compile() loads it in milliseconds."""
        return self.cache_dir is not None and self.package_path(Path(self.cache_dir)).exists()

    def _export(self, package: Path, threads: int) -> None:
        """torch.export the step (the batch and attention-length dimensions symbolic), compile it with Inductor
        ahead of time for `threads` OpenMP threads, and write the package (its weights left out: they are the
        model's own at load)."""
        try:  # before tracing: without a compiler Inductor fails after a minute of it
            torch_internals.require_cxx_compiler()
        except torch_internals.NoCxxCompiler as exc:
            raise CompileUnavailable("no C++ compiler for Inductor (g++ or $CXX); install g++ for the compiled "
                                     "decode step") from exc
        # One compiling thread: the box's other core is serving; Inductor's artefacts under the package's directory.
        # The generated loops are parallel for the threads the step will run on, not for the one this (forked)
        # process computes with: built for one, every fused loop (attention, norms, rotary) ran on one core.
        torch_internals.configure_inductor(compile_threads=1, cpp_threads=threads, min_chunk=LOOP_MIN_CHUNK,
                                           march=inductor_march())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(package.parent)
        max_len = self.cache.max_seq_len
        if max_len < 2:
            raise CompileUnavailable("max_seq_len under 2: nothing to compile")
        b = 2  # any batch of two or more stands for every batch, one included (a size of 1 would specialise)
        args = (torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
                torch.full((b,), max_len), torch.ones(b, 1, 1, min(ATTENTION_ROUND, max_len), dtype=torch.bool),
                self.opaque)
        batch = torch.export.Dim("batch", min=1, max=max(2, self.cache.n_slots))
        length = torch.export.Dim("attention", min=2, max=max_len)
        partial = package.with_name(f"partial-{os.getpid()}-{package.name}")
        with warnings.catch_warnings():  # torch's own pytree deprecation notice, printed into the worker's log
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(_Step(self.model, self.weights, self.opaque, self.cache), args,
                                          strict=False, dynamic_shapes=({0: batch}, {0: batch}, {0: batch},
                                                                        {0: batch, 3: length},
                                                                        [None] * len(self.opaque)))
            if program.constants:  # a tensor the walk did not name would be missing at load
                raise CompileUnavailable(f"the decode step holds tensors outside the model's weights: "
                                         f"{sorted(program.constants)[:3]}")
            torch_internals.aot_compile_package(program, str(partial))
        os.replace(partial, package)  # whole or not at all: a start never finds half a package

    def _build_in_child(self, package: Path) -> None:
        """_export in a forked copy of this process: the compiler's memory (~1 GB for a 1B model, Inductor's
        modules and its copies of the graph's tensors, which it keeps) leaves with the child instead of staying in
        the worker that serves. The child shares the model's mapped weights and writes nothing but the package."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only this thread runs here; it ends with os._exit, never returning
            status = 1
            try:
                os.close(read_end)
                threads = torch.get_num_threads()  # what the worker serves with
                # OpenMP's thread team did not survive the fork (a parallel region would wait on it for ever): one
                # thread, which runs torch's loops inline
                torch.set_num_threads(1)
                self._export(package, threads)
                status = 0
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
                os.write(write_end, f"{type(exc).__name__}: {exc}"[:600].encode(errors="replace"))
            finally:
                os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            failure = pipe.read().decode(errors="replace")
        _, wait_status = os.waitpid(pid, 0)
        package.with_name(f"partial-{pid}-{package.name}").unlink(missing_ok=True)  # what a failed child left
        if os.waitstatus_to_exitcode(wait_status) != 0 or not package.exists():
            raise CompileUnavailable(failure.removeprefix("CompileUnavailable: ") or
                                     f"the compiling process ended with {os.waitstatus_to_exitcode(wait_status)}")

    def compile(self) -> None:
        """Load the compiled step, compiling it first where no package for this kind of model and cache is in
        cache_dir yet; raises CompileUnavailable where torch cannot."""
        started = time.monotonic()
        if self.cache_dir is None:  # nowhere to keep it (tests): built for this object only
            with tempfile.TemporaryDirectory(prefix="decode-") as scratch:
                self._compile_in(Path(scratch))
        else:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
            self._compile_in(Path(self.cache_dir))
        self.compile_seconds = time.monotonic() - started
        log.info("decode step %s in %.1f s", "compiled" if self.built else "loaded", self.compile_seconds)

    def _compile_in(self, directory: Path) -> None:
        package = self.package_path(directory)
        if not package.exists():
            self._build_in_child(package)
            self.built = True
        try:
            self._runner = self._load(package)
        except RuntimeError as exc:  # the loader's errors: a package cut short, or one this torch cannot read
            if self.built:
                raise CompileUnavailable(f"loading the decode step's new package failed: {str(exc)[:300]}") from exc
            log.warning("the decode step's package %s could not be loaded (%s): removed, compiling it again",
                        package.name, str(exc)[:200])
            package.unlink(missing_ok=True)
            self._build_in_child(package)
            self.built = True
            self._runner = self._load(package)

    def _load(self, package: Path):
        """The package's runner, holding the model's own weight and cache tensors (by name, not copied)."""
        runner = torch_internals.load_aot_package(str(package))
        ours, wanted = {**self.weights, **self._cache_tensors()}, runner.get_constant_fqns()
        missing = sorted(set(wanted) - set(ours))
        if missing:  # tensors Inductor made itself (the package holds none): an op to keep out of its reach
            raise CompileUnavailable(f"the compiled decode step needs tensors of its own: {missing[:3]}")
        # user-managed: the runner keeps pointers to our tensors; a tensor the step never reads (a matrix
        # multiplied from another copy of it) is not asked for
        runner.load_constants({name: ours[name] for name in wanted}, False, True, True)
        return runner

    def _cache_tensors(self) -> dict[str, torch.Tensor]:
        c = self.cache
        return {**{f"cache_k_{i}": k for i, k in enumerate(c.k_layers)},
                **{f"cache_v_{i}": v for i, v in enumerate(c.v_layers)}}

    @property
    def ready(self) -> bool:
        return self._runner is not None

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 logits (B, vocab) of one new token per row at positions (B,), its K/V written into slot_ids."""
        t_len = attention_length(int(positions.max()) + 1, self.cache.max_seq_len)
        mask = (torch.arange(t_len) <= positions.unsqueeze(-1)).view(-1, 1, 1, t_len)
        return self._runner.run([token_ids.contiguous(), slot_ids.contiguous(), positions.contiguous(), mask,
                                 *self.opaque])[0]
