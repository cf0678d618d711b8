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
            dog = Watchdog(backend)
            state = dog.poll()
            assert dog.samples, dog.message  # read, not "GPU cannot be read" (which is Critical)
            for s in dog.samples:
                assert s.name and 0 < s.temperature_c < 120, s
                assert 0 <= s.memory_used_bytes <= s.memory_total_bytes and s.memory_total_bytes > 0, s
            # the state is the one the rules give for what NVML reported
            assert state == Watchdog(FakeGpuBackend([dog.samples])).poll(), dog.message
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


# ---- faults, hysteresis, actions and the YAML thresholds (issue 12) ----------------------------------------------

from appliance.watchdog import WatchdogActions, actions_for  # noqa: E402


class Recorder:
    def __init__(self):
        self.states, self.faults = [], []

    def dog(self, script, **kw) -> Watchdog:
        kw = {"temperature_warning_c": 80, "temperature_critical_c": 90, "memory_warning_ratio": 0.9, **kw}
        return Watchdog(FakeGpuBackend(script), on_state=lambda *e: self.states.append(e),
                        on_fault=self.faults.append, **kw)


def test_every_state_transition_calls_on_state_with_the_previous_state():
    rec = Recorder()
    dog = rec.dog([[gpu(50)], [gpu(85)], [gpu(50)], [gpu(95)], [gpu(85)], [gpu(95)], [gpu(50)]])
    assert [dog.poll() for _ in range(7)] == ["Ok", "Warning", "Ok", "Critical", "Warning", "Critical", "Ok"]
    assert [(s, p) for s, p, _ in rec.states] == [
        ("Warning", "Ok"), ("Ok", "Warning"), ("Critical", "Ok"), ("Warning", "Critical"), ("Critical", "Warning"),
        ("Ok", "Critical")]
    assert rec.faults == []  # heat alone is no fault


def test_memory_critical_ratio():
    rec = Recorder()
    dog = rec.dog([[gpu(used_gib=72)], [gpu(used_gib=79.5)], [gpu(used_gib=10)]], memory_critical_ratio=0.99)
    assert [dog.poll() for _ in range(3)] == ["Warning", "Critical", "Ok"]
    assert "memory 99% used >= critical 99%" in rec.states[1][2]


def test_hysteresis_holds_a_state_until_the_gpu_is_clearly_below_the_threshold():
    temps = [85, 79, 77.9, 91, 89, 88.5, 87.9, 80]
    rec = Recorder()
    dog = rec.dog([[gpu(t)] for t in temps], temperature_hysteresis_c=2)
    assert [dog.poll() for _ in temps] == ["Warning", "Warning", "Ok", "Critical", "Critical", "Critical",
                                           "Warning", "Warning"]
    assert len(rec.states) == 4  # no flapping around 80 and 90


def test_new_uncorrectable_ecc_error_is_a_latched_fault():
    rec = Recorder()
    dog = rec.dog([[gpu(ecc=2)], [gpu(ecc=3)], [gpu(ecc=3)], [gpu(ecc=4)]])
    assert dog.poll() == "Ok" and dog.actions == WatchdogActions(False, False, False)
    assert dog.poll() == "Critical"
    assert rec.faults == ["GPU 0 (Test GPU): 1 new uncorrected ECC error(s)"]
    assert dog.actions.stop_gpu_workers and dog.fault == rec.faults[0]
    assert dog.poll() == "Critical" and "1 new uncorrected ECC" in dog.message  # the count stays above baseline
    assert dog.poll() == "Critical"
    assert len(rec.faults) == 1 and [s for s, _, _ in rec.states] == ["Critical"]


@pytest.mark.parametrize("error", [RuntimeError("NVML_ERROR_GPU_IS_LOST"), RuntimeError("GPU is lost")])
def test_gpu_is_lost_is_a_fault_at_once(error):
    rec = Recorder()
    dog = rec.dog([[gpu()], error, [gpu()]])
    assert dog.poll() == "Ok"
    assert dog.poll() == "Critical" and rec.faults and rec.faults[0].startswith("GPU lost")
    assert dog.poll() == "Critical" and dog.actions.stop_gpu_workers  # a healthy sample does not clear it
    assert dog.message.startswith("all GPUs within limits; fault: GPU lost")


def test_a_vanished_gpu_is_a_fault():
    rec = Recorder()
    dog = rec.dog([[gpu(index=0), gpu(index=1)], [gpu(index=0)]])
    dog.poll()
    assert dog.poll() == "Critical" and rec.faults == ["GPU 1 lost (no longer reports)"]


def test_transient_read_errors_recover_but_repeated_ones_mean_lost():
    rec = Recorder()
    flaky = rec.dog([[gpu()], OSError("timeout"), OSError("timeout"), [gpu()]], lost_after_failures=3)
    assert [flaky.poll() for _ in range(4)] == ["Ok", "Critical", "Critical", "Ok"]
    assert rec.faults == [] and flaky.fault is None
    rec = Recorder()
    dead = rec.dog([[gpu()], OSError("timeout"), OSError("timeout"), OSError("timeout"), [gpu()]],
                   lost_after_failures=3)
    assert [dead.poll() for _ in range(5)] == ["Ok", "Critical", "Critical", "Critical", "Critical"]
    assert rec.faults == ["GPU unreadable 3 times in a row: timeout"]


def test_a_read_error_is_logged_once_per_run_of_failures_even_when_already_critical(caplog):
    dog = make([[gpu(95)], RuntimeError("NVML: Unknown Error"), RuntimeError("NVML: Unknown Error"), [gpu(95)],
                RuntimeError("NVML: Unknown Error")])
    assert [dog.poll() for _ in range(5)] == ["Critical"] * 5  # no state change to log the reason with
    logged = [r for r in caplog.records if r.getMessage() == "GPU cannot be read"]
    assert len(logged) == 2 and all(str(r.exc_info[1]) == "NVML: Unknown Error" for r in logged)


def test_a_failing_fault_callback_does_not_break_polling():
    def broken(_):
        raise ValueError("daemon bug")

    dog = Watchdog(FakeGpuBackend([[gpu(ecc=0)], [gpu(ecc=1)], [gpu(ecc=1)]]), on_fault=broken)
    assert [dog.poll() for _ in range(3)] == ["Ok", "Critical", "Critical"] and dog.fault


def test_actions_per_state():
    assert actions_for("Ok", None) == WatchdogActions(alarm=False, shed_load=False, stop_gpu_workers=False)
    assert actions_for("NoGpu", None) == WatchdogActions(False, False, False)
    assert actions_for("Warning", None) == WatchdogActions(alarm=True, shed_load=False, stop_gpu_workers=False)
    assert actions_for("Critical", None) == WatchdogActions(alarm=True, shed_load=True, stop_gpu_workers=False)
    assert actions_for("Critical", "GPU lost") == WatchdogActions(alarm=True, shed_load=True, stop_gpu_workers=True)


def test_thresholds_come_from_the_yaml():
    from core.config import ConfigError, load_config_text
    cfg = load_config_text("models: {m: {kind: tensor, path: builtin:te-classifier}}\n"
                           "watchdog: {temperature_warning_c: 70, temperature_critical_c: 75, "
                           "memory_critical_ratio: 0.97, temperature_hysteresis_c: 1, lost_after_failures: 2}\n")
    rec = Recorder()
    dog = Watchdog.from_config(FakeGpuBackend([[gpu(72)], [gpu(69.5)], [gpu(68.9)], [gpu(used_gib=78)],
                                               OSError("x"), OSError("x")]), cfg.watchdog,
                               on_state=lambda *e: rec.states.append(e), on_fault=rec.faults.append)
    assert [dog.poll() for _ in range(6)] == ["Warning", "Warning", "Ok", "Critical", "Critical", "Critical"]
    assert rec.faults == ["GPU unreadable 2 times in a row: x"]
    with pytest.raises(ConfigError, match="memory_critical_ratio"):
        load_config_text("models: {m: {kind: tensor, path: builtin:te-classifier}}\n"
                         "watchdog: {memory_warning_ratio: 0.9, memory_critical_ratio: 0.8}\n")
