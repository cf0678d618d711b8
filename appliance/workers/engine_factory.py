"""The engine service of one model, built in a worker from the settings the serve process sent: the tensor path
(appliance/engine/tensor/) or the language-model path (appliance/engine/llm/). The engines are imported here, on
first use, so a worker imports only the path its models take."""
from __future__ import annotations

from pathlib import Path

from appliance.engine.liveness import Liveness
from appliance.workers import protocol as p


def build_service(spec: p.ModelSpec, *, threads: int, metrics, liveness: Liveness, on_event,
                  inline_batches: bool = True):
    """The engine service of one model, from the settings the serve process sent. Tensor batches run on the
    worker's loop unless the worker also hosts a generative model (whose engine thread the loop must feed)."""
    s = dict(spec.settings)
    if spec.kind == "tensor":
        from appliance.engine.batcher import BatchPolicy
        from appliance.engine.tensor_service import TensorModelService
        policy = BatchPolicy(max_batch_size=s["max_batch_size"], max_queue_delay_s=s["max_queue_delay_s"],
                             max_queue_size=s["max_queue_size"])
        tensorrt = None
        if s["backend"] == "tensorrt":
            from appliance.engine.tensorrt_backend import TensorRtSettings
            tensorrt = TensorRtSettings(cache_dir=Path(s["tensorrt_cache_dir"]), max_batch_size=s["max_batch_size"],
                                        fp16=s["tensorrt_fp16"])
        return TensorModelService(spec.name, Path(spec.path), backend=s["backend"], device=s["device"],
                                  threads=threads, version_label=spec.version_label, max_samples=s["max_samples"],
                                  policy=policy, metrics=metrics, on_event=on_event, liveness=liveness,
                                  inline=inline_batches, tensorrt=tensorrt)
    from appliance.engine.llm_settings import GenerativeSettings
    from appliance.engine.llm_service import GenerativeModelService
    settings = GenerativeSettings(**{**s, "threads": threads})
    return GenerativeModelService(spec.name, Path(spec.path), settings, version_label=spec.version_label,
                                  metrics=metrics, on_event=on_event, liveness=liveness)
