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
    settings = dict(spec.settings)
    if spec.kind == "tensor":
        from appliance.engine.tensor.service import TensorModelService
        return TensorModelService.from_settings(spec.name, Path(spec.path), settings, threads=threads,
                                                version_label=spec.version_label, metrics=metrics,
                                                on_event=on_event, liveness=liveness, inline=inline_batches)
    from appliance.engine.llm.service import GenerativeModelService
    return GenerativeModelService.from_settings(spec.name, Path(spec.path), settings, threads=threads,
                                                version_label=spec.version_label, metrics=metrics,
                                                on_event=on_event, liveness=liveness)
