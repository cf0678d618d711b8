"""GPU watchdog: state rules, events, metrics, the async loop, and the NVML path on a machine without a GPU."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from appliance.metrics import Metrics
from appliance.watchdog import (FakeGpuBackend, GpuSample, NvmlBackend, Watchdog, WatchdogUnavailable,
                                make_backend)

GIB = 1 << 30


def gpu(temperature: float = 40.0, used_gib: float = 10.0, ecc: int = 0, index: int = 0) -> GpuSample:
    return GpuSample(index=index, name="Test GPU", temperature_c=temperature, memory_used_bytes=int(used_gib * GIB),
                     memory_total_bytes=80 * GIB, utilization=0.5, ecc_errors=ecc, power_w=250.0)


def value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def make(script, metrics=None, events=None) -> Watchdog:
    return Watchdog(FakeGpuBackend(script), temperature_warning_c=80, temperature_critical_c=90,
                    memory_warning_ratio=0.9, metrics=metrics,
                    on_event=(lambda *e: events.append(e)) if events is not None else None)


def test_ok_warning_critical_ok_with_events_and_metrics():
    metrics, events = Metrics(gpu_present=True), []
    dog = make([[gpu(50)], [gpu(85)], [gpu(95)], [gpu(95)], [gpu(60)]], metrics, events)
    assert dog.poll() == "Ok" and events == []
    assert value(metrics, "appliance_watchdog_state") == 0
    assert dog.poll() == "Warning"
    assert value(metrics, "appliance_watchdog_state") == 1
    assert dog.poll() == "Critical"
    assert value(metrics, "appliance_watchdog_state") == 2
    assert dog.poll() == "Critical"  # no event when the state stays
    assert dog.poll() == "Ok"
    assert [(state, previous) for state, previous, _ in events] == [
        ("Warning", "Ok"), ("Critical", "Warning"), ("Ok", "Critical")]
    assert "85 C >= warning 80 C" in events[0][2] and "95 C >= critical 90 C" in events[1][2]
    assert dog.temperature_c == 60.0 and dog.memory_used_bytes == 10 * GIB
    assert value(metrics, "appliance_gpu_temperature_celsius", gpu="0") == 60.0
    assert value(metrics, "appliance_gpu_memory_used_bytes", gpu="0") == 10 * GIB
    assert value(metrics, "appliance_gpu_power_watts", gpu="0") == 250.0


def test_thresholds_are_inclusive_and_memory_warns():
    dog = make([[gpu(80)], [gpu(79.9, used_gib=72)], [gpu(79.9, used_gib=71.9)], [gpu(90)]])
    assert [dog.poll() for _ in range(4)] == ["Warning", "Warning", "Ok", "Critical"]


def test_new_ecc_errors_since_start_are_critical():
    events = []
    dog = make([[gpu(ecc=3)], [gpu(ecc=3)], [gpu(ecc=4)]], events=events)
    assert dog.poll() == "Ok"  # errors from before the watchdog started are the baseline
    assert dog.poll() == "Ok" and dog.ecc_errors == 3
    assert dog.poll() == "Critical" and dog.ecc_errors == 4
    assert "1 new uncorrected ECC error" in events[-1][2]


def test_backend_errors_and_vanished_gpus_are_critical_not_raised():
    events = []
    dog = make([[gpu(), gpu(index=1)], [gpu()], RuntimeError("NVML_ERROR_GPU_IS_LOST"), []], events=events)
    assert dog.poll() == "Ok"
    assert dog.poll() == "Critical" and "GPU 1 no longer reports" in dog.message
    assert dog.poll() == "Critical" and "GPU_IS_LOST" in dog.message
    assert dog.poll() == "Critical"
    assert len(events) == 1


def test_worst_gpu_decides():
    dog = make([[gpu(50, index=0), gpu(85, index=1)]])
    assert dog.poll() == "Warning" and "GPU 1" in dog.message and dog.temperature_c == 85


def test_no_backend_is_nogpu():
    metrics = Metrics()
    dog = Watchdog(None, metrics=metrics)
    assert dog.state == "NoGpu" and dog.poll() == "NoGpu"
    assert value(metrics, "appliance_watchdog_state") == 3
    assert dog.temperature_c == 0.0 and dog.memory_used_bytes == 0 and dog.ecc_errors == 0
    assert value(metrics, "appliance_gpu_temperature_celsius", gpu="0") is None


def test_a_failing_event_handler_does_not_break_polling():
    def handler(*_):
        raise ValueError("handler bug")

    dog = Watchdog(FakeGpuBackend([[gpu(95)], [gpu(40)]]), on_event=handler)
    assert dog.poll() == "Critical" and dog.poll() == "Ok"


def test_run_polls_until_cancelled():
    events = []
    dog = make([[gpu(50)], [gpu(85)], [gpu(95)]], events=events)

    async def main():
        task = asyncio.create_task(dog.run(0.01))
        for _ in range(500):
            if dog.state == "Critical":
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [e[0] for e in events] == ["Warning", "Critical"]


def test_a_hung_sample_is_critical_and_not_piled_up():
    release = threading.Event()
    calls = []

    def stuck():
        calls.append(1)
        release.wait(5)
        return [gpu()]

    dog = Watchdog(FakeGpuBackend(stuck), sample_timeout_s=0.05)

    async def main():
        task = asyncio.create_task(dog.run(0.02))
        await asyncio.sleep(0.3)
        state, message = dog.state, dog.message
        task.cancel()
        release.set()
        return state, message

    state, message = asyncio.run(main())
    assert state == "Critical" and ("no answer" in message or "has not returned" in message)
    assert len(calls) == 1  # one stuck thread, not one per interval


def test_make_backend_kinds():
    assert make_backend("none") is None
    fake = make_backend("fake")
    assert Watchdog(fake).poll() == "Ok"
    with pytest.raises(ValueError):
        make_backend("cuda")


def test_nvml_path_without_a_gpu():
    backend = make_backend("auto")  # never raises
    if backend is not None:  # a machine with a GPU: the real path must sample
        try:
            samples = backend.sample()
            assert samples and samples[0].memory_total_bytes > 0
            assert Watchdog(backend).poll() in ("Ok", "Warning", "Critical")
        finally:
            backend.close()
        return
    with pytest.raises(WatchdogUnavailable):
        NvmlBackend()
    with pytest.raises(WatchdogUnavailable):
        make_backend("nvml")


def test_pynvml_is_not_imported_at_module_import():
    code = "import sys, appliance.watchdog; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"
