"""`engine.weights: auto`: which way of multiplying a model file's weights is fastest on the CPU it runs on, found
by measuring there, never by a rule about CPU kinds (torch's int4 op, "fast on AVX-512" by one micro-benchmark, made
an AVX-512 EPYC 20x slower than our own fp32 path end to end).

A path is how the weights are held and multiplied:

    blocks/int8/<isa>      the file's GGUF blocks, activations quantized per block of 32, our kernels for <isa>
    blocks/float32/<isa>   the file's GGUF blocks, fp32 activations (the exact path), our kernels for <isa>
    blocks/float32/torch   4-bit blocks through torch's _weight_int4pack_mm_for_cpu (fp32 activations; only where
                           every layer matrix is Q4_0 / Q4_1 / Q4_K)
    float32, bfloat16      the whole file dequantised to dense weights (oneDNN's packed matmuls)

(`int8` / `int4` take the place of `blocks` where engine.weights asks to requantize.)

At the first load of a model file on a machine (and at `appliance models prepare NAME`), `measure` times one
decode step's matmuls of every candidate path at 1 row and at `slots` rows: one layer's matrices (fused as the
model fuses them) times the layer count, plus the output matrix (a slice of it, scaled), each the fastest of
several interleaved trials (the CPU is shared: the least disturbed trial is the truest). `choose` ranks the paths
by the sum of their slowdowns against the fastest at each size and keeps the first that meets the accuracy bar:
exact paths (fp32 activations on the file's own numbers) meet it by construction; approximate ones (int8
activations, bfloat16) are checked by the caller on a fixed text: mean KL divergence of the next-token
distribution to the exact path at most KL_BAR. The choice, every path's figures and the reasons paths were not
available are recorded beside the weight cache, keyed by the model file's content digest and the CPU's model and
features (`Record`), so a later start reads the record instead of measuring.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

# The bar for approximate paths: mean KL divergence (nats per token) of the next-token distribution to the exact
# path over KL_TOKENS tokens of KL_TEXT. llama.cpp's own scheme (int8 activations per block of 32) measured
# 0.0019-0.0061 against our fp32 path on SmolLM2 Q4_1 / Q4_K_M over 2,000 tokens (bench/generate.py; see the
# issue-20 note); ours the same scheme. The bar is set a little above those figures: it keeps a path whose numbers
# are as good as llama.cpp's and refuses one that is broken or much worse (bfloat16 activations).
KL_BAR = 0.01
KL_TOKENS = 256
KL_TEXT = (
    "The pump station lifts water from the river intake to the treatment plant. Each of the three centrifugal "
    "pumps is driven by a 75 kW induction motor through a variable frequency drive. The operator sets the flow "
    "target in cubic metres per hour; the controller adjusts the drive speed to hold the discharge pressure "
    "between 4.2 and 4.8 bar. When the suction level in the wet well falls below 1.5 m, the duty pump slows and "
    "the standby pump is locked out to prevent cavitation. Vibration on the motor bearings is measured in mm/s "
    "and alarmed at 7.1 mm/s (ISO 10816 zone C). A check valve on each discharge line stops reverse flow when a "
    "pump trips. Maintenance replaces mechanical seals every 8,000 running hours or earlier if leakage exceeds "
    "ten drops per minute. The plant historian stores one sample per second for flow, pressure, level, motor "
    "current and bearing temperature; a daily report lists starts, running hours and energy per cubic metre. "
    "If the discharge pressure rises above 6 bar for more than five seconds, the safety relay opens the drive's "
    "enable circuit and the pump coasts to a stop; the event is logged with the last minute of data. Questions "
    "operators ask: why did pump two trip at night, is the seal leaking, how much energy did we use per cubic "
    "metre last week, when is the next inspection due, and what happens if the river level drops in summer? "
    "Answers should be short, name the signal they rely on, and say when the data is not enough to tell."
)


@dataclass(frozen=True)
class PathName:
    weights: str  # blocks | int8 | int4 | float32 | bfloat16
    activations: str  # int8 | float32 | bfloat16
    kernels: str  # an ISA of kernels.cpu_quant, or torch

    def __str__(self) -> str:
        if self.weights in ("float32", "bfloat16"):
            return self.weights
        return f"{self.weights}/{self.activations}/{self.kernels}"

    @classmethod
    def parse(cls, text: str) -> "PathName":
        if text in ("float32", "bfloat16"):
            return cls(text, text, "torch")
        weights, activations, kernels = text.split("/")
        return cls(weights, activations, kernels)

    @property
    def quantized(self) -> bool:
        return self.weights not in ("float32", "bfloat16")

    @property
    def exact(self) -> bool:
        """fp32 activations on the file's own numbers (the dense float32 path included)."""
        return self.activations == "float32"


def candidates(weights: str, activations: str, quant_kernels: str, isas: list[str], layer_types: set[str],
               four_bit: tuple[str, ...]) -> list[PathName]:
    """Every path the settings allow for a file whose layer matrices have `layer_types`, on a CPU whose kernels
    run `isas`. weights: auto (the file's blocks, or dense), or one format; activations / quant_kernels: auto or
    one value (they narrow the quantized paths)."""
    formats = ["blocks", "float32", "bfloat16"] if weights == "auto" else [weights]
    out = []
    for fmt in formats:
        if fmt in ("float32", "bfloat16"):
            out.append(PathName(fmt, fmt, "torch"))
            continue
        for isa in isas:
            for act in ("int8", "float32"):
                out.append(PathName(fmt, act, isa))
        if layer_types and layer_types <= set(four_bit) or fmt == "int4":
            out.append(PathName(fmt, "float32", "torch"))
    return [p for p in out if not p.quantized or (
        (activations == "auto" or p.activations == activations)
        and (quant_kernels == "auto" or p.kernels == quant_kernels))]


# ---- timing ------------------------------------------------------------------------------------------------------

Timings = dict[str, tuple[float, float]]  # path -> (ms per decode step's matmuls at 1 row, at `slots` rows)


def time_best(fn: Callable[[], object], trials: int, inner: int) -> float:
    """Seconds per call: the fastest of `trials` runs of `inner` calls."""
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


# After RACE_TRIALS trials, a path over OUT_OF_RACE times the fastest at both row counts is timed no further: its
# figures stay those of its first trials. Both, not the sum: on a CPU shared with other work one trial can fall on a
# lost time slice (under --isa avx2 on a loaded box, blocks/int8/avx2 read 520 ms at 1 row in two trials where the
# kernels take 4; fastest at 16 rows, it must stay in the race to get its true figure). Under --isa avx2 the exact block paths and torch's
# int4 op took 0.4-7 s a step, most of a 56 s measurement, for paths 20-400x slower than the chosen one.
OUT_OF_RACE = 4.0
RACE_TRIALS = 2


def measure(step_parts: dict[str, "StepMatmuls"], slots: int, trials: int = 5, inner: int = 3) -> Timings:
    """step_parts: path -> its StepMatmuls. A step's time = layers x one layer's matmuls + head_scale x the head
    slice's, each the fastest of `trials`; trials interleave the paths, so a burst of load elsewhere falls on all
    of them alike. Paths far out of the race after the first trial (OUT_OF_RACE) are not timed again."""
    calls = {}
    for p, parts in step_parts.items():
        for r in sorted({1, slots}):
            layer, head = parts.make(r)
            calls[(p, r, "layer")], calls[(p, r, "head")] = layer, head
    for fn in calls.values():  # warm-up: first-touch pages, thread pools, packing
        fn()
    best = {key: float("inf") for key in calls}

    def step_ms() -> Timings:
        out = {}
        for p, parts in step_parts.items():
            ms = [(parts.layers * best[(p, r, "layer")] + parts.head_scale * best[(p, r, "head")]) * 1e3
                  for r in (1, slots)]
            out[p] = (ms[0], ms[1])
        return out

    racing = set(step_parts)
    with torch.no_grad():
        for trial in range(trials):
            for key, fn in calls.items():
                if key[0] not in racing:
                    continue
                # one untimed call first: the path before this one may have evicted these weights (a 1-row product
                # reads them from memory), and the path after would find them warm: a bias by order alone (SmolLM2:
                # the first block path measured 15% slower at 1 row than the same code next in line)
                fn()
                best[key] = min(best[key], time_best(fn, 1, inner))
            if trial + 1 == RACE_TRIALS and len(racing) > 1:
                now = step_ms()
                b1, bs = min(t[0] for t in now.values()), min(t[1] for t in now.values())
                racing = {p for p in racing if min(now[p][0] / b1, now[p][1] / bs) <= OUT_OF_RACE}
    return step_ms()


@dataclass
class StepMatmuls:
    """One decode step's matmuls for timing: one layer's weights (as the model fuses them), run `layers` times in
    a step, and a slice of the output matrix standing for `head_scale` times itself. `linears` and `head` are
    callables x -> y."""
    linears: list
    in_features: list[int]
    layers: int
    head: object
    head_in: int
    head_scale: float
    dtype: torch.dtype = torch.float32

    def make(self, rows: int) -> tuple[Callable[[], object], Callable[[], object]]:
        xs = [torch.randn(rows, k).to(self.dtype) for k in self.in_features]
        xh = torch.randn(rows, self.head_in).to(self.dtype)

        def layer() -> None:
            for lin, x in zip(self.linears, xs):
                lin(x)
        return layer, lambda: self.head(xh)


# ---- choosing ----------------------------------------------------------------------------------------------------

def rank(timings: Timings) -> list[str]:
    """Paths by the sum of their slowdowns against the fastest at 1 row and at `slots` rows (ties: name order)."""
    if not timings:
        return []
    best1 = min(t[0] for t in timings.values())
    best_s = min(t[1] for t in timings.values())
    return sorted(timings, key=lambda p: (timings[p][0] / best1 + timings[p][1] / best_s, p))


def choose(timings: Timings, accurate: Callable[[str], bool]) -> str | None:
    """The fastest path (rank) that meets the accuracy bar; `accurate(path)` is asked only as far down the ranking
    as needed (approximate paths cost a check). None when no path qualifies."""
    for path in rank(timings):
        if accurate(path):
            return path
    return None


# ---- the accuracy check ------------------------------------------------------------------------------------------

def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_reference || p), nats."""
    lp = torch.log_softmax(reference_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double(), dim=-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


# ---- the record ----------------------------------------------------------------------------------------------------

@dataclass
class Record:
    """What was measured for one model file on one kind of CPU, and what was chosen."""
    digest: str  # the model file's content digest
    cpu_key: str  # kernels.cpu_isa.CpuInfo.key(): CPU model and features
    cpu: str  # the brand string, for people
    setting: str  # the candidate set: weights/activations/quant_kernels as configured
    slots: int
    threads: int
    chosen: str
    timings_ms: dict[str, list[float]] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    accuracy: dict[str, dict] = field(default_factory=dict)  # path -> {"kl": ..., "bar": ..., "ok": ...}
    measured_at: float = 0.0
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)  # torch, kernels' sources, weight layout

    def matches(self, digest: str, cpu_key: str, setting: str, slots: int, threads: int,
                versions: dict[str, str]) -> bool:
        return (self.digest, self.cpu_key, self.setting, self.slots, self.threads, self.versions) == \
            (digest, cpu_key, setting, slots, threads, versions)

    def summary(self) -> str:
        """"measured 1.9 / 6.1 ms per step at 1 / 16 rows; next: float32 3.0 / 9.9" for Backend."""
        t = self.timings_ms.get(self.chosen)
        if not t:
            return "not measured"
        order = [p for p in rank({k: tuple(v) for k, v in self.timings_ms.items()}) if p != self.chosen]
        text = f"measured {t[0]:.1f} / {t[1]:.1f} ms per step's matmuls at 1 / {self.slots} rows"
        if order:
            nxt = self.timings_ms[order[0]]
            text += f"; next {order[0]} {nxt[0]:.1f} / {nxt[1]:.1f}"
        return text


def record_path(cache_dir: Path, digest: str, cpu_key: str) -> Path:
    return Path(cache_dir) / f"choice-{digest[:16]}-{cpu_key}.json"


def load_record(path: Path) -> Record | None:
    try:
        return Record(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def save_record(path: Path, record: Record) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record), indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only state directory costs the next start a measurement
        log.warning("could not record the measured path choice in %s: %s", path.parent, exc)


def dense_linear(w: torch.Tensor, dtype: torch.dtype):
    """The dense matmul the model would run for this weight in dtype (oneDNN-packed where it packs)."""
    from models.llama import Linear
    lin = Linear.build(w.to(dtype).contiguous(), pack=True)
    return lambda x: lin(x)
