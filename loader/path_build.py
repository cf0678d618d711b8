"""Building a model file's weights along one path (loader/path_choice.py), and deciding the path for
`engine.weights: auto` by measuring (at the first load of a file on a machine, or at `appliance models prepare`).

`decide` loads the file's blocks once (through the weight cache: the layout the kernels read, mapped), times every
candidate path's decode-step matmuls (`path_choice.measure`, injectable: tests force timings), checks the
accuracy of approximate paths on a fixed text against the exact path, and returns the Record it saved beside the
weight cache; `build` makes the LlamaModel for the chosen path.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kernels import cpu_build, cpu_isa, cpu_quant
from loader import path_choice, weight_cache
from loader.path_choice import PathName, Record, StepMatmuls
from models import quant

log = logging.getLogger(__name__)

HEAD_SLICE_ROWS = 8192  # rows of the output matrix timed (the rest by proportion)


@dataclass
class Inputs:
    """What a decision is made from: the file, its digest, its quantized tensors (blocks), the settings."""
    path: Path
    digest: str
    config: Any  # LlamaConfig
    tensors: dict  # HF names -> BlockMatrix / tensor, loaded with weights format `fmt`
    fmt: str  # the quantized format the tensors were loaded in (blocks | int8 | int4)
    tokenizer: Any
    slots: int
    threads: int
    kernel_dir: Path | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # filled by kernels_for


def versions() -> dict[str, str]:
    """What a record's figures depend on besides the file and the CPU."""
    return {"torch": torch.__version__, "kernels": cpu_build.sources_digest(), "layout": weight_cache.LAYOUT}


def kernels_for(path: PathName, kernel_dir: Path | None) -> cpu_quant.CpuKernels | None:
    """Our kernels for a quantized path (None for torch's ops); KernelsUnavailable where they cannot run."""
    if not path.quantized or path.kernels == "torch":
        return None
    return cpu_quant.kernels(path.kernels, path.activations, kernel_dir)


def layer_names(config, i: int) -> list[list[str]]:
    """The matrices of layer i as the model multiplies them: qkv, o, gate/up, down (fused groups)."""
    p = f"model.layers.{i}."
    if config.fused_projections:
        return [[p + "self_attn.qkv_proj.weight"], [p + "self_attn.o_proj.weight"],
                [p + "mlp.gate_up_proj.weight"], [p + "mlp.down_proj.weight"]]
    return [[p + f"self_attn.{n}_proj.weight" for n in "qkv"], [p + "self_attn.o_proj.weight"],
            [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [p + "mlp.down_proj.weight"]]


def head_matrix(config, tensors: dict):
    head = None if config.tie_word_embeddings else tensors.get("lm_head.weight")
    return tensors["model.embed_tokens.weight"] if head is None else head


def _fused(parts: list) -> list:
    """The matrices of one fused group as the model builds them: one when they stack, else each."""
    if len(parts) == 1 or not all(isinstance(p, quant.BlockMatrix) for p in parts):
        return parts if len(parts) == 1 else ([torch.cat([_dense(p) for p in parts])])
    try:
        return [quant.concat_rows(parts)]
    except ValueError:
        return parts


def _dense(t) -> torch.Tensor:
    return t.dequantize() if isinstance(t, quant.BlockMatrix) else t.float()


def step_matmuls(path: PathName, inputs: Inputs, kernels: cpu_quant.CpuKernels | None) -> StepMatmuls:
    """One decode step's matmuls along `path` for timing (layer 0's matrices and a slice of the head)."""
    cfg, t = inputs.config, inputs.tensors
    linears, ins = [], []
    for group in layer_names(cfg, 0):
        for m in _fused([t[n] for n in group]):
            if path.quantized and isinstance(m, quant.BlockMatrix):
                linears.append(quant.linear_for(m, kernels))
            else:
                linears.append(path_choice.dense_linear(_dense(m), _dtype(path)))
            ins.append(m.shape[1])
    head = head_matrix(cfg, t)
    n = head.shape[0]
    rows = min(n, HEAD_SLICE_ROWS)
    if isinstance(head, quant.BlockMatrix):
        sliced = quant.BlockMatrix(head.type_name, (rows, head.shape[1]), head.data[:-(-rows // 16)])
    else:
        sliced = head[:rows]
    if path.quantized and isinstance(sliced, quant.BlockMatrix):
        head_fn = quant.head_for(sliced, kernels)
    else:
        head_fn = path_choice.dense_linear(_dense(sliced), _dtype(path))
    return StepMatmuls(linears, ins, cfg.num_hidden_layers, head_fn, head.shape[1], n / rows, _dtype(path))


def _dtype(path: PathName) -> torch.dtype:
    return torch.bfloat16 if path.weights == "bfloat16" else torch.float32


def build(path: PathName, inputs: Inputs, kernel_dir: Path | None = None, dense_loader=None):
    """The LlamaModel of `path`: quantized paths from the inputs' blocks (our kernels or torch's ops), dense ones
    from `dense_loader(dtype) -> tensors` (the file dequantised)."""
    from models.llama import LlamaModel
    if path.quantized:
        return LlamaModel(inputs.config, inputs.tensors, cpu_kernels=kernels_for(path, kernel_dir))
    dtype = _dtype(path)
    return LlamaModel(inputs.config, dense_loader(dtype), dtype=dtype)


def teacher_forced(model, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    from models.llama import KVCache
    cache = KVCache(model.config, 1, len(ids) + 8, kv_dtype)
    return model.forward(cache, torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), torch.tensor([len(ids)]),
                         all_logits=True)[0].float()


def kl_to_exact(path: PathName, inputs: Inputs, exact: PathName, dense_loader=None) -> float:
    """Mean KL divergence of `path`'s next-token distribution to `exact`'s over KL_TOKENS tokens of KL_TEXT."""
    ids = inputs.tokenizer.encode(path_choice.KL_TEXT)[:path_choice.KL_TOKENS]
    if len(ids) < 2:
        raise ValueError("the accuracy text encodes to fewer than 2 tokens")
    ref = teacher_forced(build(exact, inputs, inputs.kernel_dir, dense_loader), ids, torch.float32)
    got = teacher_forced(build(path, inputs, inputs.kernel_dir, dense_loader), ids,
                         torch.bfloat16 if path.weights == "bfloat16" else torch.float32)
    return path_choice.mean_kl(ref, got)


def decide(inputs: Inputs, paths: list[PathName], setting: str, cpu: cpu_isa.CpuInfo | None,
           measure: Callable = path_choice.measure, kl: Callable | None = None, dense_loader=None,
           record_dir: Path | None = None) -> Record:
    """Measure the candidate `paths`, choose, record (beside the weight cache, in record_dir). `measure(parts,
    slots) -> timings` and `kl(path, inputs, exact) -> float` are the seams tests use to force figures."""
    started = time.monotonic()
    unavailable = dict(inputs.unavailable)
    parts: dict[str, StepMatmuls] = {}
    runnable: dict[str, PathName] = {}
    cpu_isa.ensure_built(sorted({p.kernels for p in paths if p.quantized and p.kernels != "torch"}),
                           inputs.kernel_dir)
    for p in paths:
        try:
            parts[str(p)] = step_matmuls(p, inputs, kernels_for(p, inputs.kernel_dir))
            runnable[str(p)] = p
        except cpu_build.KernelsUnavailable as exc:
            unavailable[str(p)] = str(exc)
    if not runnable:
        raise cpu_build.KernelsUnavailable("; ".join(f"{k}: {v}" for k, v in unavailable.items())
                                           or "no path can run this model here")
    built = time.monotonic()
    timings = measure(parts, inputs.slots)
    timed = time.monotonic()
    exact = _exact_reference(runnable)
    accuracy: dict[str, dict] = {}
    kl_fn = kl or (lambda p, i, e: kl_to_exact(p, i, e, dense_loader))

    def accurate(name: str) -> bool:
        p = runnable[name]
        if p.exact:
            return True
        try:
            value = kl_fn(p, inputs, exact)
        except (RuntimeError, ValueError) as exc:  # a path that cannot even run the check is not chosen
            accuracy[name] = {"error": str(exc)[:200], "ok": False}
            return False
        accuracy[name] = {"kl": value, "bar": path_choice.KL_BAR, "ok": value <= path_choice.KL_BAR}
        return accuracy[name]["ok"]

    chosen = path_choice.choose(timings, accurate)
    if chosen is None:
        chosen = str(exact)
    log.info("path choice for %s: %.1f s building the paths' matmuls, %.1f s timing them, %.1f s checking accuracy",
             inputs.path.name, built - started, timed - built, time.monotonic() - timed)
    record = Record(digest=inputs.digest, cpu_key=cpu.key() if cpu else "unknown",
                    cpu=cpu.described if cpu else "unknown", setting=setting, slots=inputs.slots,
                    threads=inputs.threads, chosen=chosen,
                    timings_ms={k: [round(v[0], 4), round(v[1], 4)] for k, v in timings.items()},
                    unavailable=unavailable, accuracy=accuracy, measured_at=time.time(),
                    seconds=round(time.monotonic() - started, 2), versions=versions())
    if record_dir is not None:
        path_choice.save_record(path_choice.record_path(record_dir, inputs.digest, record.cpu_key), record)
    log.info("path for %s on %s: %s (%s; %.1f s)", inputs.path.name, record.cpu, chosen, record.summary(),
             record.seconds)
    return record


def _exact_reference(runnable: dict[str, PathName]) -> PathName:
    """The exact path the approximate ones are checked against: our float32 kernels, else torch's int4 op, else
    dense float32."""
    for p in runnable.values():
        if p.quantized and p.exact and p.kernels != "torch":
            return p
    for p in runnable.values():
        if p.quantized and p.exact:
            return p
    return PathName("float32", "float32", "torch")
