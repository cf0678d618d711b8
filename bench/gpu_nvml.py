"""The NVML watchdog backend sampled for real: every field read, a Watchdog poll, and sampling cost.

    python bench/gpu_nvml.py        (prints SKIP and exits 0 without a CUDA device)
"""
from __future__ import annotations

import time

from gpu_common import Results, require_cuda

require_cuda("NVML watchdog")

from appliance.watchdog import NvmlBackend, Watchdog  # noqa: E402


def main():
    res = Results("NVML backend")
    backend = NvmlBackend()
    try:
        samples = backend.sample()
        res.check(len(samples) >= 1, "NVML reports GPUs", ", ".join(f"{s.index}: {s.name}" for s in samples))
        for s in samples:
            res.check(0 < s.temperature_c < 120, f"GPU {s.index} temperature", f"{s.temperature_c:.0f} C")
            res.check(0 < s.memory_used_bytes <= s.memory_total_bytes, f"GPU {s.index} memory",
                      f"{s.memory_used_bytes / 2**30:.1f} / {s.memory_total_bytes / 2**30:.1f} GiB")
            res.check(0 <= s.utilization <= 1, f"GPU {s.index} utilisation", f"{s.utilization:.0%}")
            res.check(s.ecc_errors >= 0, f"GPU {s.index} uncorrected ECC errors", str(s.ecc_errors))
            res.check(s.power_w >= 0, f"GPU {s.index} power", f"{s.power_w:.0f} W")
        states = []
        dog = Watchdog(backend, on_state=lambda *e: states.append(e))
        state = dog.poll()
        res.check(state in ("Ok", "Warning", "Critical") and dog.fault is None, "watchdog poll",
                  f"{state}: {dog.message}")
        t0 = time.perf_counter()
        for _ in range(20):
            backend.sample()
        res.figure("NVML sample of all GPUs", f"{(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")
    finally:
        backend.close()
    res.finish()


if __name__ == "__main__":
    main()
