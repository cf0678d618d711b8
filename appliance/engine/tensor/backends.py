"""Backends that run a tensor model on a batch of samples: ONNX Runtime (the first choice), torch.export
(ExportedProgram .pt2 files; TorchScript is retired, it is deprecated in torch 2.13) and TensorRT.

Device choice is per backend: with device "auto", ONNX Runtime takes its CUDA provider only when the installed
package has one (onnxruntime-gpu) and the session really runs on it, torch takes CUDA only when it sees a device,
TensorRT needs the tensorrt package and a GPU; otherwise the CPU. `name` always says what runs:
onnxruntime-cpu, onnxruntime-cuda, torch-cpu, torch-cuda, tensorrt, tensorrt-fp16. Backend "tensorrt" without
TensorRT or a GPU serves with ONNX Runtime (and `name` says onnxruntime-...), with the reason in `note`.

torch and onnxruntime are imported inside the loaders, so importing this module costs nothing. Every load ends with
a probe run on one zero sample: a model that cannot run is refused at load time, not at the first PLC call.
Error messages never hold the file's path (clients and events see them); the full exception goes to the log.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from core.errors import EngineFailure

log = logging.getLogger(__name__)

ONNX_SUFFIXES = (".onnx",)
EXPORTED_SUFFIXES = (".pt2",)  # torch.export.save: an ExportedProgram
RETIRED_SUFFIXES = (".pt", ".torchscript")  # TorchScript archives: refused with what to do instead
BACKEND_CHOICES = ("auto", "onnxruntime", "torch", "tensorrt")
SHAPES_EXTRA_FILE = "shapes.json"  # optional, in a .pt2's extra files: {"input_shape": [...], "output_shape": [...]}

_ORT_FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


class TensorBackend(Protocol):
    name: str  # "onnxruntime-cpu", "onnxruntime-cuda", "torch-cpu", "torch-cuda", "tensorrt", "tensorrt-fp16"
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    output_shape: tuple[int, ...]

    def run(self, x: np.ndarray) -> np.ndarray:
        """(n, *input_shape) float32 -> (n, *output_shape) float32."""
        ...


# ---- device choice (each query is a function of its own so tests can fake what is installed) ----

def available_onnx_providers() -> list[str]:
    import onnxruntime as ort
    return list(ort.get_available_providers())


def torch_sees_cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def tensorrt_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensorrt") is not None


def tensorrt_unavailable_reason(device: str) -> str | None:
    """None when a TensorRT engine can be built here, else why not (the fallback's note)."""
    if device == "cpu":
        return "device cpu was asked for"
    if not tensorrt_installed():
        return "the tensorrt package is not installed"
    if not torch_sees_cuda():
        return "no CUDA GPU is visible"
    return None


def onnx_providers(device: str, available: list[str]) -> list:
    """ONNX Runtime providers in preference order for `device` ("auto", "cpu", "cuda", "cuda:N")."""
    if device == "cpu" or "CUDAExecutionProvider" not in available:
        if device.startswith("cuda"):
            raise EngineFailure("device cuda was asked for, but ONNX Runtime has no CUDA provider here "
                                "(install the gpu extra: onnxruntime-gpu)")
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", {"device_id": _cuda_index(device)}), "CPUExecutionProvider"]


def torch_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch_sees_cuda() else "cpu"
    if device.startswith("cuda") and not torch_sees_cuda():
        raise EngineFailure("device cuda was asked for, but torch has no CUDA device here")
    return device


_PROVIDER_NAMES = {"CUDAExecutionProvider": "onnxruntime-cuda", "TensorrtExecutionProvider": "onnxruntime-tensorrt",
                   "CPUExecutionProvider": "onnxruntime-cpu"}


def load_tensor_backend(path: Path, backend: str = "auto", device: str = "auto", threads: int = 0, *,
                        tensorrt: "TensorRtSettings | None" = None, timing_batch: int = 1) -> TensorBackend:
    """Load the model file at `path` with the backend asked for; EngineFailure (path-free message) if it cannot.

    `device` should be the YAML's engine.device as written ("auto" resolves per backend here, not once for all
    models). `tensorrt` carries the engine cache directory and batch profile for backend "tensorrt". `threads` 0
    on ONNX Runtime's CPU provider: one intra-op thread or all cores, whichever runs a batch of `timing_batch`
    samples faster here (see _load_onnx_measured)."""
    path = Path(path)
    if backend not in BACKEND_CHOICES:
        raise EngineFailure(f"unknown backend '{backend}'; expected one of {', '.join(BACKEND_CHOICES)}")
    suffix = path.suffix.lower()
    if suffix in RETIRED_SUFFIXES:
        raise EngineFailure(f"TorchScript ({suffix}) is retired: export the model as ONNX (preferred) or with "
                            "torch.export.save (an ExportedProgram .pt2 with a dynamic batch dimension)")
    kind = "onnxruntime" if suffix in ONNX_SUFFIXES else "torch" if suffix in EXPORTED_SUFFIXES else None
    if kind is None:
        raise EngineFailure(f"unsupported model file type '{suffix or '(none)'}'; expected .onnx or .pt2 "
                            "(torch.export)")
    if backend == "tensorrt":
        if kind != "onnxruntime":
            raise EngineFailure(f"the tensorrt backend builds its engine from an ONNX model, not {suffix}; "
                                "use backend 'torch' or 'auto'")
        if not path.is_file():
            raise EngineFailure("the model file does not exist or is not a file")
        loaded = _load_tensorrt_or_fallback(path, device, threads, tensorrt)
        _probe(loaded)
        return loaded
    if backend != "auto" and backend != kind:
        what = "an ONNX model" if kind == "onnxruntime" else "a torch.export model"
        raise EngineFailure(f"the {backend} backend cannot load {what} ({suffix}); use backend '{kind}' or 'auto'")
    if not path.is_file():
        raise EngineFailure("the model file does not exist or is not a file")
    if kind == "onnxruntime":
        return _load_onnx_measured(path, device, timing_batch) if threads == 0 else _probed(
            _load_onnx(path, device, threads))
    return _probed(_load_exported(path, device, threads))


def _probed(backend: TensorBackend) -> TensorBackend:
    _probe(backend)
    return backend


def _probe(backend: TensorBackend) -> None:
    """Run one zero sample: fixes the output shape where the file left it open and proves the model runs."""
    try:
        out = backend.run(np.zeros((1, *backend.input_shape), dtype=np.float32))
    except EngineFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own code (ONNX Runtime, torch): refused, logged
        log.warning("probe run of a %s model failed", backend.name, exc_info=True)
        raise EngineFailure(f"the model does not run on one sample of shape {list(backend.input_shape)} "
                            f"({type(exc).__name__})") from None
    if out.ndim < 1 or out.shape[0] != 1:
        raise EngineFailure("the model's output has no batch dimension matching its input")
    if backend.output_shape and tuple(out.shape[1:]) != tuple(backend.output_shape):
        raise EngineFailure(f"the model's output shape {list(out.shape[1:])} differs from the declared "
                            f"{list(backend.output_shape)}")
    backend.output_shape = tuple(int(d) for d in out.shape[1:])


def _load_failure(what: str, exc: BaseException) -> EngineFailure:
    """A reason safe to show clients (the type only: the library's message names the file); raised `from exc`, so
    the log line of the failed load (appliance/engine/model_status.py) carries the library's traceback."""
    return EngineFailure(f"{what} ({type(exc).__name__})")


# ---- ONNX Runtime ----

@dataclass
class OnnxRuntimeBackend:
    name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]  # empty until the probe run fixes it, when the graph leaves it open
    session: Any
    input_name: str
    output_name: str
    input_dtype: Any
    one_at_a_time: bool  # the graph's batch dimension is fixed at 1
    threads: int = 0  # intra-op threads (0: ONNX Runtime's default, all cores)
    note: str = ""  # why this backend serves instead of the one asked for (TensorRT fallback)
    timing: dict = field(default_factory=dict)  # threads 0: what the measured choice saw (see _load_onnx_measured)

    def run(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=self.input_dtype)
        if self.one_at_a_time:
            outs = [self.session.run([self.output_name], {self.input_name: x[i:i + 1]})[0] for i in range(len(x))]
            out = np.concatenate(outs, axis=0)
        else:
            out = self.session.run([self.output_name], {self.input_name: x})[0]
        return np.asarray(out, dtype=np.float32)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def _load_onnx_measured(path: Path, device: str, timing_batch: int) -> OnnxRuntimeBackend:
    """engine.threads 0: ONNX Runtime with one intra-op thread or with all cores, whichever runs a full batch faster
    on this machine. A small model (the TE classifier: 30 us a sample) runs slower on two threads than on one at
    every batch size on a 2-core box (the second thread's wake-up and hand-off cost more than it computes), and the
    core it leaves free is the one the serve process needs; a large model on many cores gains from them. So it is
    measured, at load, on zeros of the model's input shape."""
    single = _probed(_load_onnx(path, device, 1))
    if single.name != "onnxruntime-cpu" or usable_cores() < 2:
        return single  # a GPU provider, or one core: nothing to choose
    multi = _probed(_load_onnx(path, device, 0))
    batch = np.zeros((max(1, timing_batch), *single.input_shape), dtype=np.float32)
    one_s, all_s = _seconds_per_run(single, batch), _seconds_per_run(multi, batch)
    chosen = single if one_s <= all_s else multi
    log.info("model %s: ONNX Runtime on %s (a batch of %d: %.3f ms on one thread, %.3f ms on all %d cores)",
             path.name, "one thread" if chosen is single else "all cores", len(batch), one_s * 1e3, all_s * 1e3,
             usable_cores())
    chosen.timing = {"batch": len(batch), "one_thread_ms": one_s * 1e3, "all_cores_ms": all_s * 1e3}
    return chosen


def _seconds_per_run(backend: "OnnxRuntimeBackend", batch: np.ndarray, budget_s: float = 0.5) -> float:
    """Median of up to 7 runs (after one to warm up) within about `budget_s`: a slow model is timed fewer times."""
    backend.run(batch)
    runs: list[float] = []
    end = time.perf_counter() + budget_s
    while len(runs) < 7 and (len(runs) < 2 or time.perf_counter() < end):
        started = time.perf_counter()
        backend.run(batch)
        runs.append(time.perf_counter() - started)
    return float(np.median(runs))


def _load_onnx(path: Path, device: str, threads: int) -> OnnxRuntimeBackend:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    # ONNX Runtime's pool threads spin after each run, waiting for the next: between one PLC's calls that burnt
    # 1.2 ms of CPU per call here (bench/ua_overhead.py, 1 client), taken from the serve process and the language
    # model on a box of a few cores. They sleep instead.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    providers = onnx_providers(device, available_onnx_providers())
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own exception classes (none a RuntimeError): logged
        raise _load_failure("the ONNX model could not be loaded", exc) from exc
    running = session.get_providers()[0]  # what the session really uses: onnxruntime-gpu without a GPU runs on CPU
    if device.startswith("cuda") and running != "CUDAExecutionProvider":
        raise EngineFailure("device cuda was asked for, but ONNX Runtime could not start its CUDA provider")
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1:
        raise EngineFailure(f"the ONNX model has {len(inputs)} inputs; a tensor model takes exactly one")
    graph_in = inputs[0]
    if graph_in.type not in _ORT_FLOAT_TYPES:
        raise EngineFailure(f"the ONNX model's input is {graph_in.type}; expected a float tensor")
    float_outputs = [o for o in outputs if o.type in _ORT_FLOAT_TYPES]
    if not float_outputs:
        raise EngineFailure("the ONNX model has no float output")
    graph_out = float_outputs[0]  # e.g. a classifier with (label, probabilities): serve the first float output
    in_dims = list(graph_in.shape)
    if not in_dims:
        raise EngineFailure("the ONNX model's input has no batch dimension")
    batch_dim, sample_dims = in_dims[0], in_dims[1:]
    if isinstance(batch_dim, int) and batch_dim != 1:
        raise EngineFailure(f"the ONNX model's batch dimension is fixed at {batch_dim}; it must be dynamic or 1")
    if not all(isinstance(d, int) and d > 0 for d in sample_dims):
        raise EngineFailure("the ONNX model's input dimensions after the batch dimension must be fixed")
    out_dims = list(graph_out.shape)[1:]
    declared_out = tuple(out_dims) if all(isinstance(d, int) and d > 0 for d in out_dims) else ()
    return OnnxRuntimeBackend(
        name=_PROVIDER_NAMES.get(running, "onnxruntime-cpu"),
        input_shape=tuple(sample_dims), output_shape=declared_out, session=session,
        input_name=graph_in.name, output_name=graph_out.name, input_dtype=_ORT_FLOAT_TYPES[graph_in.type],
        one_at_a_time=batch_dim == 1, threads=threads)


def _cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


# ---- torch.export (ExportedProgram) ----

@dataclass
class TorchExportBackend:
    name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    module: Any
    device: str
    torch: Any = field(repr=False)

    def run(self, x: np.ndarray) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            x = np.ascontiguousarray(x, dtype=np.float32)
            if not x.flags.writeable:
                x = x.copy()  # torch.from_numpy wants a writable buffer (arrays from network bytes are not)
            inp = torch.from_numpy(x).to(self.device)
            out = self.module(inp)
            if isinstance(out, (tuple, list)):
                out = out[0]
            if not isinstance(out, torch.Tensor):
                raise EngineFailure("the exported model returned no tensor")
            return out.detach().to("cpu", torch.float32).numpy()


def _load_exported(path: Path, device: str, threads: int) -> TorchExportBackend:
    import torch

    device = torch_device(device)
    if threads > 0:
        torch.set_num_threads(threads)  # process-wide in torch: the last model loaded sets it
    extra = {SHAPES_EXTRA_FILE: ""}
    try:
        program = torch.export.load(str(path), extra_files=extra)
        if device != "cpu":
            from torch.export.passes import move_to_device_pass
            program = move_to_device_pass(program, device)
        module = program.module()
    except Exception as exc:  # noqa: BLE001 - torch.export.load of a foreign archive raises many kinds: logged
        raise _load_failure("the torch.export model could not be loaded", exc) from exc
    shapes = _exported_shapes(path, program, extra[SHAPES_EXTRA_FILE])
    return TorchExportBackend(
        name="torch-cuda" if device.startswith("cuda") else "torch-cpu",
        input_shape=shapes[0], output_shape=shapes[1], module=module, device=device, torch=torch)


def _exported_shapes(path: Path, program, embedded: bytes | str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sample shapes (without the batch dimension): from a sidecar `<file>.json` / `<stem>.json` or shapes.json in
    the file's extra files when given, else from the program's own input and output (the dimensions after the
    first must be fixed numbers; the first is the batch)."""
    text: bytes | str = embedded
    for sidecar in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if sidecar.is_file():
            text = sidecar.read_bytes()
            break
    if text:
        try:
            doc = json.loads(text)
            input_shape = tuple(int(d) for d in doc["input_shape"])
            output_shape = tuple(int(d) for d in doc.get("output_shape", ()))
        except (ValueError, TypeError, KeyError) as exc:
            raise EngineFailure(f"the exported model's shapes are not valid JSON with input_shape "
                                f"({type(exc).__name__})") from None
    else:
        input_shape, output_shape = _program_shapes(program)
    if not input_shape or not all(d > 0 for d in input_shape + output_shape):
        raise EngineFailure("the exported model's sample shapes must be positive integers: export it with a fixed "
                            "sample shape and a dynamic batch dimension, or give shapes.json")
    return input_shape, output_shape


def _program_shapes(program) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.export.graph_signature import InputKind

    def fixed(meta_val) -> tuple[int, ...]:
        dims = tuple(getattr(meta_val, "shape", ()))[1:]
        return tuple(d if isinstance(d, int) else -1 for d in dims)

    users = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    nodes = {n.name: n for n in program.graph.nodes}
    if len(users) != 1:
        raise EngineFailure(f"an exported tensor model takes one input tensor, this one takes {len(users)}")
    input_shape = fixed(nodes[users[0]].meta.get("val"))
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    first = output_node.args[0][0] if isinstance(output_node.args[0], (tuple, list)) else output_node.args[0]
    output_shape = fixed(first.meta.get("val")) if hasattr(first, "meta") else ()
    return input_shape, output_shape


# ---- TensorRT ----

def _load_tensorrt_or_fallback(path: Path, device: str, threads: int,
                               settings: "TensorRtSettings | None") -> TensorBackend:
    """A TensorRT engine when TensorRT and a GPU are here, else ONNX Runtime with the reason in `note`. The ONNX
    Runtime session is opened first either way: it checks the graph and gives the sample shape for the profile."""
    reason = tensorrt_unavailable_reason(device)
    if reason is None and settings is None:
        reason = "no engine cache directory was configured"
    fallback = _load_onnx(path, "auto" if device == "auto" else device, threads)
    if reason is not None:
        log.warning("TensorRT not used for %s: %s; serving with %s", path.name, reason, fallback.name)
        fallback.note = f"TensorRT not used: {reason}"
        return fallback
    from appliance.engine.tensor.tensorrt_backend import load_tensorrt
    try:
        engine = load_tensorrt(path, device if device.startswith("cuda") else "cuda:0", fallback.input_shape,
                               not fallback.one_at_a_time, settings)
    except Exception as exc:  # noqa: BLE001 - a failed build still serves, on ONNX Runtime
        log.warning("TensorRT engine for %s failed; serving with %s", path.name, fallback.name, exc_info=True)
        fallback.note = f"TensorRT not used: the engine build failed ({type(exc).__name__})"
        return fallback
    log.info("model %s runs as %s (%s engine)", path.name, engine.name, "new" if engine.built_now else "cached")
    return engine


if TYPE_CHECKING:
    from appliance.engine.tensor.tensorrt_backend import TensorRtSettings
