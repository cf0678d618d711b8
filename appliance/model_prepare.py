"""`appliance models prepare NAME`: make a generative model's every start serve at full speed from Ready.

It runs, on this box and with the YAML's engine settings, what the first start would otherwise do on the way:
measures the weight paths this CPU can run and records the choice (appliance/engine/llm/weight_plan.py), writes the
chosen weights in their kernel layout to the weight cache, and compiles the decode step into its package
(engine.compile). The Debian package's postinst may call it; a deploy of a new version may too. It prints the
Backend the model will show, and the measured figures.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def prepare(config, name: str) -> tuple[int, str]:
    """(exit status, what to print)."""
    from appliance.device import resolve_device
    from appliance.model_specs import model_spec
    from appliance.workers.cpu_share import planned_threads
    from appliance.engine.llm.loading import prepare_model
    from appliance.engine.llm.settings import GenerativeSettings
    from core.errors import ApplianceError

    m = config.models.get(name)
    if m is None:
        return 2, f"no model '{name}' in {config.source}; models: {', '.join(config.models)}"
    if m.kind != "generative":
        return 2, f"model '{name}' is a {m.kind} model: only generative models have weights to prepare"
    state_dir = Path(config.server.state_dir)
    spec = model_spec(m, config.engine, resolve_device(config.engine.device).split(" ")[0], state_dir)
    if spec.refused:
        return 2, spec.refused
    # the threads serve's worker will have (its CPU share of the cores): the measurements and the compiled step
    # are kept per thread count
    settings = GenerativeSettings(**{**spec.settings, "threads": planned_threads(config, name)})
    started = time.monotonic()
    try:
        engine = prepare_model(name, Path(spec.path), settings)
    except (ApplianceError, ValueError, OSError) as exc:
        return 2, f"{name}: preparing failed: {exc}"
    lines = [f"{name}: {engine.backend}"]
    record = engine.path_record
    if record is not None:
        lines.append(f"  measured on {record.cpu} ({record.threads} threads, 1 and {record.slots} rows), "
                     f"ms per decode step's matmuls:")
        for path, (one, many) in sorted(record.timings_ms.items(), key=lambda kv: kv[1][0] + kv[1][1]):
            mark = "  <- chosen" if path == record.chosen else ""
            acc = record.accuracy.get(path)
            check = f"  KL {acc['kl']:.4f} (bar {acc['bar']})" if acc and "kl" in acc else ""
            lines.append(f"    {path:28s} {one:8.2f} {many:8.2f}{check}{mark}")
        for path, reason in sorted(record.unavailable.items()):
            lines.append(f"    {path:28s} unavailable: {reason}")
    compiled = engine.compiled_decode
    if compiled is not None:
        lines.append(f"  decode step compiled in {compiled.compile_seconds:.0f} s" if compiled.ready
                     else "  decode step stays eager (see the log)")
    lines.append(f"  prepared in {time.monotonic() - started:.0f} s")
    return 0, "\n".join(lines)
