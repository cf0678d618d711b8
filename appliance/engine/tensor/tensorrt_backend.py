"""A tensor model as a TensorRT engine: built from its ONNX on first load, cached, reused on the next start.

tensorrt and torch (for CUDA memory and streams) are imported inside `load_tensorrt`, never at module import; the
caller (tensor/backends.py) checks first that both and a GPU are there and otherwise serves with ONNX Runtime.

Precision: TensorRT 11 removed BuilderFlag.FP16 (strongly typed networks only), so "fp16 allowed" means the ONNX is
converted to fp16 weights and activations with fp32 inputs/outputs (onnxconverter-common, keep_io_types) before the
build; without that package the engine is built in fp32 and the log says so.
Batch: one optimisation profile covering 1..max_batch_size (opt at the middle); larger requests run in chunks.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from appliance.engine.tensor.trt_cache import EngineCache, EngineKey, onnx_digest
from core.errors import EngineFailure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorRtSettings:
    cache_dir: Path  # <state_dir>/tensorrt
    max_batch_size: int = 64  # the batcher's largest batch: the profile's maximum
    fp16: bool = True
    workspace_bytes: int = 1 << 30


def fp16_converter_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("onnxconverter_common") is not None


def fp16_onnx(onnx_bytes: bytes) -> bytes | None:
    """The model with fp16 weights and compute but fp32 inputs/outputs; None when onnxconverter-common is missing."""
    try:
        import onnx
        from onnxconverter_common import float16
    except ImportError:
        return None
    model = onnx.load_from_string(onnx_bytes)
    return float16.convert_float_to_float16(model, keep_io_types=True).SerializeToString()


def build_plan(trt: Any, onnx_bytes: bytes, sample_shape: tuple[int, ...], max_batch: int, dynamic: bool,
               workspace_bytes: int) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network()
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineFailure(f"TensorRT cannot parse the ONNX model ({errors[:200]})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if dynamic:
        name = network.get_input(0).name
        profile = builder.create_optimization_profile()
        profile.set_shape(name, (1, *sample_shape), (max(1, max_batch // 2), *sample_shape),
                          (max_batch, *sample_shape))
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineFailure("TensorRT could not build an engine for the model")
    return bytes(plan)


@dataclass
class TensorRtBackend:
    name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    engine: Any
    context: Any
    input_name: str
    output_names: list[str]  # every output gets a buffer; the first float one is served
    served_output: str
    max_batch: int
    device: str
    built_now: bool
    torch: Any = field(repr=False)
    trt: Any = field(repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def run(self, x: np.ndarray) -> np.ndarray:
        torch = self.torch
        outs = []
        with self._lock, torch.cuda.device(self.device):  # one execution context: one batch at a time
            stream = torch.cuda.current_stream()
            for start in range(0, len(x), self.max_batch):
                chunk = torch.from_numpy(np.ascontiguousarray(x[start:start + self.max_batch], dtype=np.float32))
                chunk = chunk.to(self.device)
                self.context.set_input_shape(self.input_name, tuple(chunk.shape))
                self.context.set_tensor_address(self.input_name, chunk.data_ptr())
                buffers = {}
                for name in self.output_names:
                    shape = tuple(self.context.get_tensor_shape(name))
                    dtype = _torch_dtype(self.trt, torch, self.engine.get_tensor_dtype(name))
                    buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
                    self.context.set_tensor_address(name, buffers[name].data_ptr())
                if not self.context.execute_async_v3(stream.cuda_stream):
                    raise EngineFailure("TensorRT failed to run the batch")
                stream.synchronize()
                outs.append(buffers[self.served_output].float().cpu().numpy())
        return np.concatenate(outs, axis=0)


def _torch_dtype(trt: Any, torch: Any, dt: Any):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.int64: torch.int64,
             trt.int8: torch.int8, trt.bool: torch.bool}
    if dt not in table:
        raise EngineFailure(f"TensorRT output type {dt} is not supported")
    return table[dt]


def load_tensorrt(path: Path, device: str, sample_shape: tuple[int, ...], dynamic_batch: bool,
                  settings: TensorRtSettings) -> TensorRtBackend:
    """Build or reuse the engine for the ONNX file at `path` on `device` ("cuda:N")."""
    import tensorrt as trt
    import torch

    index = int(device.partition(":")[2] or 0)
    device = f"cuda:{index}"
    onnx_bytes = Path(path).read_bytes()
    max_batch = settings.max_batch_size if dynamic_batch else 1
    fp16 = settings.fp16 and fp16_converter_installed()
    if settings.fp16 and not fp16:
        log.warning("onnxconverter-common is not installed: the TensorRT engine is built in fp32")
    key = EngineKey(onnx_sha256=onnx_digest(onnx_bytes), tensorrt_version=trt.__version__,
                    gpu_name=torch.cuda.get_device_name(index), fp16=fp16, max_batch_size=max_batch)
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)

    def build() -> bytes:
        source = (fp16_onnx(onnx_bytes) or onnx_bytes) if fp16 else onnx_bytes
        log.info("building a TensorRT engine for %s (batch 1..%d); this takes a while once", path.name, max_batch)
        return build_plan(trt, source, sample_shape, max_batch, dynamic_batch, settings.workspace_bytes)

    with torch.cuda.device(index):
        engine, built = EngineCache(settings.cache_dir).get_or_build(
            Path(path).stem, key, build, runtime.deserialize_cuda_engine)
        context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if n not in inputs]
    floats = [n for n in outputs if engine.get_tensor_dtype(n) in (trt.float32, trt.float16)]
    if len(inputs) != 1 or not floats:
        raise EngineFailure("the TensorRT engine needs exactly one input and a float output")
    context.set_input_shape(inputs[0], (1, *sample_shape))
    out_shape = tuple(int(d) for d in context.get_tensor_shape(floats[0]))[1:]
    return TensorRtBackend(
        name="tensorrt-fp16" if fp16 else "tensorrt", input_shape=tuple(sample_shape),
        output_shape=out_shape, engine=engine, context=context, input_name=inputs[0], output_names=outputs,
        served_output=floats[0], max_batch=max_batch, device=device, built_now=built, torch=torch, trt=trt)
