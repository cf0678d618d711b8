"""Accelerator health: temperature, memory, uncorrected ECC errors, behind one backend interface.

States: Critical when a GPU is at or above the critical temperature or memory ratio, reports new uncorrected ECC
errors since the watchdog started, cannot be read, or has disappeared; Warning at or above the warning temperature
or memory ratio; Ok otherwise; NoGpu when there is no backend at all (CPU-only box). The worst GPU decides. Leaving a
temperature state needs `temperature_hysteresis_c` below its threshold, so a GPU hovering at 83 C does not flap.

Fault (latched until restart, reported once through `on_fault(message)`): a new uncorrected ECC error, a GPU that
vanished from the samples or reports NVML's GPU_IS_LOST, or `lost_after_failures` unreadable samples in a row.
The state stays Critical while faulted. What the daemon does about each is `actions_for(state, fault)`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from appliance.metrics import WATCHDOG_STATES

log = logging.getLogger("appliance.watchdog")

OK, WARNING, CRITICAL, NO_GPU = "Ok", "Warning", "Critical", "NoGpu"
_SEVERITY = {OK: 0, WARNING: 1, CRITICAL: 2}


@dataclass(frozen=True)
class WatchdogActions:
    """What the appliance does in a watchdog state (the daemon carries them out)."""
    alarm: bool  # raise the alarm: OPC UA event, Health variables, log at WARNING
    shed_load: bool  # smaller batches, no new generative sessions, tensor models may move to the CPU
    stop_gpu_workers: bool  # GPU workers stop; the appliance is Fault; CPU models keep serving


def actions_for(state: str, fault: str | None) -> WatchdogActions:
    if fault is not None:
        return WatchdogActions(alarm=True, shed_load=True, stop_gpu_workers=True)
    return WatchdogActions(alarm=state in (WARNING, CRITICAL), shed_load=state == CRITICAL, stop_gpu_workers=False)


class WatchdogUnavailable(RuntimeError):
    """The GPU management library cannot be used here (no driver, no GPU)."""


@dataclass
class GpuSample:
    index: int
    name: str
    temperature_c: float
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1
    ecc_errors: int  # uncorrected, since boot
    power_w: float


class GpuBackend(Protocol):
    def sample(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


class NvmlBackend:
    """NVIDIA GPUs through NVML (package nvidia-ml-py). pynvml is imported here, never at module import."""

    def __init__(self, indices: Sequence[int] | None = None):
        try:
            import pynvml
        except ImportError as exc:
            raise WatchdogUnavailable("nvidia-ml-py is not installed") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise WatchdogUnavailable(f"NVML cannot start: {exc}") from exc
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._indices = list(range(count)) if indices is None else [i for i in indices if 0 <= i < count]
            if not self._indices:
                raise WatchdogUnavailable("NVML reports no GPU")
            self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in self._indices}
            self._names = {i: self._text(pynvml.nvmlDeviceGetName(h)) for i, h in self._handles.items()}
        except BaseException:  # re-raised: NVML is shut down again whatever stopped the set-up
            pynvml.nvmlShutdown()
            raise

    @staticmethod
    def _text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _optional(self, read: Callable[[], float], default: float = 0.0) -> float:
        """Some boards lack a sensor (ECC off, no power meter): NOT_SUPPORTED reads as the default."""
        try:
            return read()
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                return default
            raise

    def _temperature(self, handle) -> float:
        nv = self._nvml
        try:
            return float(nv.nvmlDeviceGetTemperatureV(handle, nv.NVML_TEMPERATURE_GPU))
        except (nv.NVMLError, AttributeError):
            return float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))  # drivers before 535

    def sample(self) -> list[GpuSample]:
        nv = self._nvml
        samples = []
        for i, h in self._handles.items():
            memory = nv.nvmlDeviceGetMemoryInfo(h)
            samples.append(GpuSample(
                index=i, name=self._names[i], temperature_c=self._temperature(h),
                memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
                utilization=self._optional(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                ecc_errors=int(self._optional(lambda: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), 0)),
                power_w=self._optional(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)))
        return samples

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:  # closing: nothing is left to release, the reason is only worth a line
            log.info("NVML shutdown: %s", exc)


class FakeGpuBackend:
    """Scripted samples for tests: a list of steps (each a list of GpuSample, or an Exception to raise), consumed
    one per sample() and repeating the last; or a callable returning the samples."""

    def __init__(self, script: list | Callable[[], list[GpuSample]]):
        self._script = script
        self._step = 0
        self.closed = False

    def sample(self) -> list[GpuSample]:
        if callable(self._script):
            return self._script()
        step = self._script[min(self._step, len(self._script) - 1)]
        self._step += 1
        if isinstance(step, BaseException):
            raise step
        return list(step)

    def close(self) -> None:
        self.closed = True


def make_backend(kind: str) -> GpuBackend | None:
    """"auto": NVML when it initialises, else None; "nvml": NVML or WatchdogUnavailable; "fake": one idle fake GPU;
    "none": None."""
    if kind == "none":
        return None
    if kind == "fake":
        return FakeGpuBackend([[GpuSample(0, "Fake GPU", 40.0, 1 << 30, 80 << 30, 0.0, 0, 60.0)]])
    if kind == "nvml":
        return NvmlBackend()
    if kind == "auto":
        try:
            return NvmlBackend()
        except WatchdogUnavailable as exc:
            log.info("no GPU watchdog: %s", exc)
            return None
    raise ValueError(f"unknown watchdog backend {kind!r}: auto, nvml, fake or none")


class Watchdog:
    """Evaluates backend samples into a state; reports changes through metrics, `on_state(state, previous,
    message)` (also accepted as `on_event`) and a latched fault through `on_fault(message)`. In `run()` the
    sampling happens in a worker thread and the evaluation (and so the callbacks) on the event loop, so callbacks
    may touch asyncio objects."""

    def __init__(self, backend: GpuBackend | None, *, temperature_warning_c: float = 83.0,
                 temperature_critical_c: float = 90.0, memory_warning_ratio: float = 0.95,
                 memory_critical_ratio: float = 0.99, temperature_hysteresis_c: float = 0.0,
                 lost_after_failures: int = 3, metrics=None,
                 on_state: Callable[[str, str, str], None] | None = None,
                 on_fault: Callable[[str], None] | None = None,
                 on_event: Callable[[str, str, str], None] | None = None, sample_timeout_s: float = 10.0):
        self.backend = backend
        self.temperature_warning_c = float(temperature_warning_c)
        self.temperature_critical_c = float(temperature_critical_c)
        self.memory_warning_ratio = float(memory_warning_ratio)
        self.memory_critical_ratio = float(memory_critical_ratio)
        self.temperature_hysteresis_c = float(temperature_hysteresis_c)
        self.lost_after_failures = max(1, int(lost_after_failures))
        self.sample_timeout_s = sample_timeout_s
        self._metrics = metrics
        self._on_state = on_state or on_event
        self._on_fault = on_fault
        self._ecc_baseline: dict[int, int] = {}
        self._known_gpus: set[int] = set()
        self._failures_in_a_row = 0
        self._temperature_level: dict[int, int] = {}  # per GPU: 0, 1 (warning) or 2 (critical), for hysteresis
        self.state = NO_GPU if backend is None else OK
        self.message = "no GPU" if backend is None else "not sampled yet"
        self.fault: str | None = None
        self.temperature_c = 0.0
        self.memory_used_bytes = 0
        self.ecc_errors = 0
        self.samples: list[GpuSample] = []
        self._pending_sample: threading.Thread | None = None
        self._publish_state()

    @classmethod
    def from_config(cls, backend: GpuBackend | None, cfg, *, metrics=None,
                    on_state: Callable[[str, str, str], None] | None = None,
                    on_fault: Callable[[str], None] | None = None) -> "Watchdog":
        """From the YAML's `watchdog` section (core.config.WatchdogConfig)."""
        return cls(backend, temperature_warning_c=cfg.temperature_warning_c,
                   temperature_critical_c=cfg.temperature_critical_c, memory_warning_ratio=cfg.memory_warning_ratio,
                   memory_critical_ratio=cfg.memory_critical_ratio,
                   temperature_hysteresis_c=cfg.temperature_hysteresis_c,
                   lost_after_failures=cfg.lost_after_failures, metrics=metrics, on_state=on_state,
                   on_fault=on_fault)

    @property
    def actions(self) -> WatchdogActions:
        return actions_for(self.state, self.fault)

    # ---- evaluation ---------------------------------------------------------------------------------------------

    def poll(self) -> str:
        """Sample once (in this thread) and evaluate. Never raises: a backend error is a Critical state."""
        if self.backend is None:
            return self._apply(None, None)
        try:
            return self._apply(self.backend.sample(), None)
        except Exception as exc:  # noqa: BLE001 - any backend failure is the Critical state, its message names it
            return self._apply(None, exc)

    def _apply(self, samples: list[GpuSample] | None, error: BaseException | None) -> str:
        fault = None
        try:
            if self.backend is None:
                state, message = NO_GPU, "no GPU"
            elif error is not None:
                self._failures_in_a_row += 1
                state, message = CRITICAL, f"GPU cannot be read: {error}"
                if self._failures_in_a_row == 1:  # once per run of failures, with the traceback
                    log.warning("GPU cannot be read", exc_info=error)
                if "GPU_IS_LOST" in str(error).upper().replace(" ", "_"):
                    fault = f"GPU lost: {error}"
                elif self._failures_in_a_row >= self.lost_after_failures:
                    fault = f"GPU unreadable {self._failures_in_a_row} times in a row: {error}"
            elif not samples:
                self._failures_in_a_row += 1
                state, message = CRITICAL, "the GPU no longer reports (fell off the bus?)"
                fault = "GPU lost: NVML reports no GPU any more"
            else:
                self._failures_in_a_row = 0
                state, message, fault = self._evaluate(samples)
        except Exception as exc:  # noqa: BLE001 - a malformed sample must not stop the watchdog: Critical, logged
            log.exception("GPU sample could not be evaluated")
            state, message = CRITICAL, f"GPU sample unreadable: {exc}"
        if self.fault is not None:  # latched: only a restart clears a lost GPU or an ECC fault
            state = CRITICAL
            if self.fault not in message:
                message = f"{message}; fault: {self.fault}"
        previous = self.state
        self.state, self.message = state, message
        self._publish_state()
        if fault is not None and self.fault is None:
            self.fault = fault
            log.error("watchdog fault: %s", fault)
            self._call(self._on_fault, fault)
        if state != previous:
            log.log(logging.INFO if state in (OK, NO_GPU) else logging.WARNING,
                    "watchdog %s -> %s: %s", previous, state, message)
            self._call(self._on_state, state, previous, message)
        return state

    @staticmethod
    def _call(callback, *args) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - the daemon's callback: its failure is logged, the watchdog goes on
            log.exception("watchdog callback failed")

    def _temperature_finding(self, s: GpuSample, label: str) -> tuple[int, str] | None:
        """Level 2/1/0 with hysteresis: a GPU stays at its level until it is `hysteresis` below the threshold."""
        held = self._temperature_level.get(s.index, 0)
        crit = self.temperature_critical_c - (self.temperature_hysteresis_c if held >= 2 else 0.0)
        warn = self.temperature_warning_c - (self.temperature_hysteresis_c if held >= 1 else 0.0)
        level = 2 if s.temperature_c >= crit else 1 if s.temperature_c >= warn else 0
        self._temperature_level[s.index] = level
        if level == 2:
            return 2, f"{label}: temperature {s.temperature_c:.0f} C >= critical {self.temperature_critical_c:.0f} C"
        if level == 1:
            return 1, f"{label}: temperature {s.temperature_c:.0f} C >= warning {self.temperature_warning_c:.0f} C"
        return None

    def _evaluate(self, samples: list[GpuSample]) -> tuple[str, str, str | None]:
        findings: list[tuple[int, str]] = []
        faults: list[str] = []
        missing = self._known_gpus - {s.index for s in samples}
        for index in sorted(missing):
            findings.append((_SEVERITY[CRITICAL], f"GPU {index} no longer reports"))
            faults.append(f"GPU {index} lost (no longer reports)")
        for s in samples:
            self._known_gpus.add(s.index)
            baseline = self._ecc_baseline.setdefault(s.index, s.ecc_errors)
            label = f"GPU {s.index} ({s.name})"
            finding = self._temperature_finding(s, label)
            if finding is not None:
                findings.append(finding)
            if s.ecc_errors > baseline:
                text = f"{label}: {s.ecc_errors - baseline} new uncorrected ECC error(s)"
                findings.append((2, text))
                faults.append(text)
            if s.memory_total_bytes > 0:
                ratio = s.memory_used_bytes / s.memory_total_bytes
                if ratio >= self.memory_critical_ratio:
                    findings.append((2, f"{label}: memory {ratio:.0%} used >= critical "
                                        f"{self.memory_critical_ratio:.0%}"))
                elif ratio >= self.memory_warning_ratio:
                    findings.append((1, f"{label}: memory {ratio:.0%} used >= warning "
                                        f"{self.memory_warning_ratio:.0%}"))
        self.samples = list(samples)
        self.temperature_c = max(s.temperature_c for s in samples)
        self.memory_used_bytes = sum(s.memory_used_bytes for s in samples)
        self.ecc_errors = sum(s.ecc_errors for s in samples)
        self._publish_gpus(samples)
        fault = "; ".join(faults) if faults else None
        if not findings:
            return OK, "all GPUs within limits", fault
        worst = max(level for level, _ in findings)
        state = {1: WARNING, 2: CRITICAL}[worst]
        return state, "; ".join(text for level, text in sorted(findings, key=lambda f: -f[0])), fault

    # ---- metrics ------------------------------------------------------------------------------------------------

    def _publish_state(self) -> None:
        if self._metrics is not None:
            self._metrics.watchdog_state.set(WATCHDOG_STATES[self.state])

    def _publish_gpus(self, samples: list[GpuSample]) -> None:
        m = self._metrics
        if m is None or not getattr(m, "gpu_present", False):
            return
        for s in samples:
            gpu = str(s.index)
            m.gpu_temperature.labels(gpu).set(s.temperature_c)
            m.gpu_memory_used.labels(gpu).set(s.memory_used_bytes)
            m.gpu_utilization.labels(gpu).set(s.utilization)
            m.gpu_ecc_errors.labels(gpu).set(s.ecc_errors)
            m.gpu_power.labels(gpu).set(s.power_w)

    # ---- the loop -----------------------------------------------------------------------------------------------

    async def run(self, interval_s: float) -> None:
        """Poll every `interval_s` until cancelled. A sample that hangs (a wedged driver) is Critical, and no
        second sampling thread is started while it is stuck."""
        loop = asyncio.get_running_loop()
        while True:
            if self.backend is None:
                self._apply(None, None)
            elif self._pending_sample is not None and self._pending_sample.is_alive():
                self._apply(None, TimeoutError("the previous sample has not returned"))
            else:
                done: asyncio.Future = loop.create_future()
                # Mark an error retrieved even if nobody awaits it any more (timed out, or run() cancelled).
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
                thread = threading.Thread(target=self._sample_into, args=(loop, done), daemon=True,
                                          name="watchdog-sample")
                self._pending_sample = thread
                thread.start()
                try:
                    samples = await asyncio.wait_for(asyncio.shield(done), self.sample_timeout_s)
                    self._apply(samples, None)
                except asyncio.TimeoutError:
                    self._apply(None, TimeoutError(f"no answer within {self.sample_timeout_s:g} s"))
                except Exception as exc:  # noqa: BLE001 - the sample thread's failure, as in poll(): Critical
                    self._apply(None, exc)
            await asyncio.sleep(interval_s)

    def _sample_into(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            result = self.backend.sample()
            outcome = (done.set_result, result)
        except Exception as exc:  # noqa: BLE001 - handed to the loop, where it becomes the Critical state
            outcome = (done.set_exception, exc)

        def deliver():
            if not done.done():
                setter, value = outcome
                setter(value)
        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            pass  # the loop closed while the sample ran

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
