"""The read-only status page at GET / of the monitoring port, for the engineer at the line with a browser and no
Grafana: the appliance's state, each model's state, version, backend, calls and p99 latency over the last minutes
(small inline SVG charts), slots, workers, alarms and certificate expiry.

Plain HTML with inline CSS and SVG: no script, nothing loaded from elsewhere (the page is served with a
Content-Security-Policy that forbids both), no secrets (no paths, thumbprints or user names). It refreshes itself
every 5 s with a meta tag.
"""
from __future__ import annotations

import collections
import html
import math
import time
from dataclasses import dataclass, field

HISTORY_S = 15 * 60
SAMPLE_S = 5.0
CONTENT_SECURITY_POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'none'; " \
                          "frame-ancestors 'none'"


@dataclass
class _Sample:
    time: float
    calls: dict[str, float]  # model -> calls answered so far
    buckets: dict[str, list[tuple[float, float]]]  # model -> cumulative (le, count) of the latency histogram


@dataclass
class StatusHistory:
    """Samples of the call counters and the latency histogram, so the page can show rates and p99 over time."""
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=int(HISTORY_S / SAMPLE_S)))

    def add(self, calls: dict[str, float], buckets: dict[str, list[tuple[float, float]]],
            now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.samples and now - self.samples[-1].time < SAMPLE_S:
            return
        self.samples.append(_Sample(now, calls, buckets))

    def series(self, model: str) -> tuple[list[float], list[float]]:
        """(calls per second, p99 seconds) between consecutive samples, oldest first."""
        rates, p99s = [], []
        pairs = list(zip(self.samples, list(self.samples)[1:]))
        for a, b in pairs:
            dt = max(b.time - a.time, 1e-9)
            rates.append(max(0.0, b.calls.get(model, 0.0) - a.calls.get(model, 0.0)) / dt)
            p99s.append(_quantile(a.buckets.get(model, []), b.buckets.get(model, []), 0.99))
        return rates, p99s


def _quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The bucket bound below which q of the observations between two histogram snapshots fell (NaN if none)."""
    prior = dict(before)
    deltas = [(le, count - prior.get(le, 0.0)) for le, count in after]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return math.nan
    for le, count in deltas:
        if count >= q * total:
            return le
    return deltas[-1][0]


def _sparkline(values: list[float], width: int = 160, height: int = 28, unit: str = "") -> str:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return '<span class="muted">collecting…</span>'
    top = max(finite) or 1.0
    step = width / max(len(values) - 1, 1)
    points = " ".join(f"{i * step:.1f},{height - (v / top) * (height - 2) - 1:.1f}"
                      for i, v in enumerate(values) if math.isfinite(v))
    last = finite[-1]
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
            f'<polyline fill="none" stroke="#2a6ebb" stroke-width="1.5" points="{points}"/></svg>'
            f' <span class="value">{_number(last)}{unit}</span>')


def _number(v: float) -> str:
    if not math.isfinite(v):
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


STATE_CLASS = {"Ready": "ok", "Loading": "warn", "Starting": "warn", "Degraded": "warn", "Failed": "bad",
               "Fault": "bad"}


def _backend(backend: str) -> str:
    """A generative model's weight format in bold, then how it was chosen (measured figures, anything faster that
    was not available and why): appliance/engine/llm/weight_plan.py writes "<device> <format>: <how>"."""
    from appliance.metrics import weight_format_of
    fmt = weight_format_of(backend)
    if not fmt:
        return html.escape(backend or "–")
    return f'<b>{html.escape(fmt)}</b><div class="muted">{html.escape(backend.partition(": ")[2])}</div>'


SOURCE_CLASS = {"Connected": "ok", "Disabled": "muted", "Connecting": "warn", "BadData": "warn", "Refused": "bad"}


def render(status: dict, history: StatusHistory) -> str:
    """The page for one status snapshot (appliance.daemon.Appliance.status_snapshot)."""
    e = html.escape
    rows = []
    for m in status["models"]:
        rates, p99s = history.series(m["name"])
        worker = ("up" if m["worker_up"] else "restarting" if m["restarting"] else "down")
        reason = f'<div class="muted">{e(m["failure_reason"])}</div>' if m["failure_reason"] else ""
        rows.append(
            f'<tr><td><b>{e(m["name"])}</b><div class="muted">{e(m["kind"])}</div></td>'
            f'<td class="{STATE_CLASS.get(m["state"], "")}">{e(m["state"])}{reason}</td>'
            f'<td>{e(m["version"] or "–")}</td><td>{_backend(m["backend"])}</td>'
            f'<td>{m["requests"]} / {m["errors"]}</td>'
            f'<td>{_sparkline(rates, unit=" /s")}</td>'
            f'<td>{_sparkline([p * 1000 for p in p99s], unit=" ms")}</td>'
            f'<td>{worker}, {m["worker_restarts"]} restarts, heartbeat {m["heartbeat"]}</td></tr>')
    alarms = "".join(f'<li class="{"bad" if active else "ok"}">{e(name)}: {"active" if active else "clear"}</li>'
                     for name, active in status["alarms"].items())
    sources = "".join(
        f'<tr><td><b>{e(src["name"])}</b></td><td class="{SOURCE_CLASS.get(src["state"], "bad")}">{e(src["state"])}</td>'
        f'<td>{src["samples"]}</td><td>{src["windows"]}</td><td>{src["skipped"]}</td><td>{src["reconnects"]}</td></tr>'
        for src in status.get("sources", []))
    sources_table = ("<h2>Sources</h2>\n<table><tr><th>source</th><th>state</th><th>samples</th><th>windows cut</th>"
                     f"<th>windows skipped</th><th>reconnects</th></tr>\n{sources}\n</table>" if sources else "")
    eng = status["engine"]
    days = status["certificate_expiry_s"] / 86400
    cert_class = "bad" if days < 30 else "ok"
    state = status["state"]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>Appliance {e(state)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 0.35em 0.7em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }} .ok {{ color: #17702e; }} .warn {{ color: #a05a00; }} .bad {{ color: #b00020; }}
.muted {{ color: #777; font-size: 0.85em; }} .value {{ font-size: 0.85em; }} ul {{ columns: 2; }}
h1 span {{ font-size: 0.6em; }}
</style></head><body>
<h1>OPC UA inference appliance <span class="{STATE_CLASS.get(state, "")}">{e(state)}</span></h1>
<p>Device {e(status["device"])} · heartbeat {status["heartbeat"]} · queue {eng["queue_depth"]} ·
KV slots {eng["slots_in_use"]} of {eng["slots_total"]} in use ·
<span class="{cert_class}">server certificate expires in {days:.0f} days</span></p>
<h2>Models</h2>
<table><tr><th>model</th><th>state</th><th>version</th><th>backend</th><th>calls / errors</th>
<th>calls per second (15 min)</th><th>p99 latency (15 min)</th><th>worker</th></tr>
{"".join(rows)}
</table>
{sources_table}
<h2>Alarms</h2><ul>{alarms}</ul>
<p class="muted">Read-only. Prometheus metrics at <a href="/metrics">/metrics</a>, readiness at
<a href="/readyz">/readyz</a>.</p>
</body></html>
"""
