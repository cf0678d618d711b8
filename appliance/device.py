"""Which device the engine runs on: the YAML's `engine.device` resolved against what the box has."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def resolve_device(requested: str) -> str:
    """'cpu' or 'cuda:N NAME'; torch is only imported when a GPU could be there (it costs the serve process ~2 s)."""
    if requested == "cpu" or not Path("/dev/nvidiactl").exists():
        if requested.startswith("cuda"):
            log.warning("CUDA was asked for but no NVIDIA device is present; running on the CPU")
        return "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            index = int(requested.split(":")[1]) if ":" in requested else 0
            return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    except (ImportError, RuntimeError, ValueError, AssertionError) as e:  # no CUDA build, a driver that fails
        log.warning("CUDA cannot be used (%s)", e)
    if requested.startswith("cuda"):
        log.warning("CUDA was asked for but is not available; running on the CPU")
    return "cpu"


def on_gpu(spec) -> bool:
    """A model's worker uses the GPU (its device names CUDA, or it builds TensorRT engines)."""
    return str(spec.settings.get("device", "cpu")).startswith("cuda") or spec.settings.get("backend") == "tensorrt"
