"""The on-disk cache of built TensorRT engines (a build takes seconds to minutes; loading a plan, milliseconds).

An engine is only valid for the exact ONNX bytes, TensorRT version, GPU model, precision and batch profile it was
built with, so all of them go into the key. Files live in `<state_dir>/tensorrt/` as `<model>-<key>.plan` with a
`.json` beside it saying what the key stands for; storing a new engine for a model removes that model's older ones,
and a plan that no longer deserialises (truncated, other driver) is rebuilt and overwritten.
A plan is executable code (NVIDIA: never deserialise an engine from an untrusted source), so the directory is
created owner-only and only engines this cache built are loaded from it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class EngineKey:
    onnx_sha256: str
    tensorrt_version: str
    gpu_name: str
    fp16: bool
    max_batch_size: int

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def onnx_digest(onnx_bytes: bytes) -> str:
    return hashlib.sha256(onnx_bytes).hexdigest()


class EngineCache:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    @staticmethod
    def _label(model: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", model)[:64] or "model"

    def plan_path(self, model: str, key: EngineKey) -> Path:
        return self.directory / f"{self._label(model)}-{key.digest}.plan"

    def entries(self, model: str) -> list[Path]:
        return sorted(self.directory.glob(f"{self._label(model)}-*.plan"))

    def load(self, model: str, key: EngineKey) -> bytes | None:
        path = self.plan_path(model, key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def store(self, model: str, key: EngineKey, plan: bytes) -> Path:
        """Atomic write (a crash leaves the old file or none, never half a plan); older engines of the model go."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.plan_path(model, key)
        for old in self.entries(model):
            if old != path:
                old.unlink(missing_ok=True)
                old.with_suffix(".json").unlink(missing_ok=True)
        _atomic_write(path, plan)
        _atomic_write(path.with_suffix(".json"), json.dumps(asdict(key), indent=1).encode())
        return path

    def get_or_build(self, model: str, key: EngineKey, build: Callable[[], bytes],
                     deserialize: Callable[[bytes], T | None]) -> tuple[T, bool]:
        """(engine, built_now). A cached plan that deserialize() refuses (None or an exception) is rebuilt."""
        plan = self.load(model, key)
        if plan is not None:
            try:
                engine = deserialize(plan)
            except Exception:  # noqa: BLE001 - any failure to load a cached plan means: build again
                log.warning("cached TensorRT engine %s does not load; rebuilding", self.plan_path(model, key).name,
                            exc_info=True)
                engine = None
            if engine is not None:
                return engine, False
        plan = build()
        engine = deserialize(plan)
        if engine is None:
            raise RuntimeError("TensorRT could not load the engine it has just built")
        self.store(model, key, plan)
        return engine, True


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # re-raised: whatever stopped the write (interrupt included), no temporary file stays
        Path(tmp).unlink(missing_ok=True)
        raise
