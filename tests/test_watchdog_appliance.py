"""The watchdog's verdicts carried out by a running appliance (fake GPU behind the real backend interface): Warning
and Critical are alarms and Degraded; a lost GPU or an uncorrectable ECC error stops the workers of models on the
GPU and makes the appliance Fault, while models on the CPU keep serving."""
from __future__ import annotations

import asyncio

import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, read, run, session, status_name

from appliance.watchdog import FakeGpuBackend, GpuSample


def prompt(text: str) -> list:
    return [ua.Variant(text, ua.VariantType.String), ua.Variant(3, ua.VariantType.UInt32),
            ua.Variant(0.0, ua.VariantType.Float)]


def gpu(temperature: float = 40.0, ecc: int = 0) -> list[GpuSample]:
    return [GpuSample(0, "Fake GPU", temperature, 1 << 30, 80 << 30, 0.0, ecc, 60.0)]


def test_watchdog_states_and_a_gpu_fault(tmp_path):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    make_model_dir(tmp_path / "chat")
    models = {"cpu-model": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))},
              "chat": {"kind": "generative", "path": str(tmp_path / "chat")},
              # backend tensorrt: a GPU model (on this CPU-only machine ONNX Runtime serves it, the backend says so)
              "gpu-model": {"kind": "tensor", "path": str(affine_model(tmp_path / "b.onnx")), "backend": "tensorrt"}}
    app = RunningAppliance(tmp_path / "state", models, {"watchdog": {"backend": "fake", "interval_s": 0.1}})
    try:
        plc = app.issue("plc", "operator")
        samples = [gpu()]
        app.app.watchdog.backend = FakeGpuBackend(lambda: samples[0])

        async def go():
            async with session(app, *plc) as c, session(app, *plc) as later:
                assert status_name(await call(c, "gpu-model", "Infer", [floats([1] * 4)])) == "Good"
                assert status_name(await call(c, "chat", "Generate", prompt("Hello"))) == "Good"
                samples[0] = gpu(temperature=85.0)
                await asyncio.sleep(0.8)
                assert await read(c, "Health", "WatchdogState") == "Warning"
                assert await read(c, "Alarms", "GpuWarning") is True
                assert await read(c, "State") == "Degraded"
                samples[0] = gpu(temperature=95.0)
                await asyncio.sleep(0.8)
                assert await read(c, "Alarms", "GpuCritical") is True
                # Critical sheds load: tensor batches of half the size (the worker was told), still answering
                assert app.app.services["gpu-model"].shedding is True
                assert status_name(await call(c, "gpu-model", "Infer", [floats([1] * 4)])) == "Good"
                # ... and takes no new generative session, while the sessions it has go on
                assert status_name(await call(later, "chat", "Generate", prompt("Hi"))) == "BadResourceUnavailable"
                assert status_name(await call(c, "chat", "Generate", prompt("And now?"))) == "Good"
                samples[0] = gpu(temperature=60.0, ecc=1)  # a new uncorrectable ECC error: fault
                await asyncio.sleep(1.5)
                assert await read(c, "State") == "Fault"
                assert await read(c, "Alarms", "EngineFault") is True
                assert status_name(await call(c, "gpu-model", "Infer", [floats([1] * 4)])) == "BadInvalidState"
                assert status_name(await call(c, "cpu-model", "Infer", [floats([1] * 4)])) == "Good"
                assert await read(c, "Models", "gpu-model", "State") == "Failed"
                assert await read(c, "Models", "cpu-model", "State") == "Ready"
        run(go())
    finally:
        app.stop()
