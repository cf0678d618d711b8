"""Rate limits over a real server: a call over its role's or its own limit answers BadTooManyOperations at once,
the engine never sees it, the metric counts it, and the session stays usable."""
from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import yaml

from harness import RunningAppliance
from onnx_models import affine_model
from serve_process import Serve
from uaclient import call, floats, read, run, session, status_name


def test_calls_over_the_limit_are_refused_before_the_engine(tmp_path):
    models = {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))}}
    app = RunningAppliance(tmp_path / "state", models, {"security": {"rate_limits": {
        "operator": {"calls_per_s": 1000, "burst": 1000},
        "per_client": {"calls_per_s": 0.5, "burst": 3}}}})
    try:
        plc1, plc2 = app.issue("plc1", "operator"), app.issue("plc2", "operator")

        async def go():
            async with session(app, *plc1) as c1, session(app, *plc2) as c2:
                first = [status_name(await call(c1, "affine", "Infer", [floats([1] * 4)])) for _ in range(5)]
                assert first == ["Good"] * 3 + ["BadTooManyOperations"] * 2, first
                # another identity has a bucket of its own
                assert status_name(await call(c2, "affine", "Infer", [floats([1] * 4)])) == "Good"
                await asyncio.sleep(0.6)
                # the engine saw only the admitted calls; the session still works for reads
                assert await read(c1, "Models", "affine", "RequestCount") == 4
                await asyncio.sleep(1.6)  # 0.5 calls/s: one token back after 2 s
                assert status_name(await call(c1, "affine", "Infer", [floats([1] * 4)])) == "Good"
        run(go())
        text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=5).read().decode()
        assert 'appliance_rate_limited_total{role="operator"} 2.0' in text
    finally:
        app.stop()


def test_sighup_applies_new_rate_limits_to_the_running_process(tmp_path):
    """`systemctl reload` as an operator meets it: a real `appliance serve`, its YAML edited, SIGHUP, and the same
    PLC's next calls meet the new limit (same process, no restart)."""
    serve = Serve(tmp_path, {"affine": {"kind": "tensor", "path": str(affine_model(tmp_path / "a.onnx"))}})
    try:
        plc = serve.issue("plc", "operator")

        async def calls(n: int) -> list[str]:
            async with session(serve, *plc) as c:
                return [status_name(await call(c, "affine", "Infer", [floats([1] * 4)])) for _ in range(n)]
        assert run(calls(4)) == ["Good"] * 4  # no limit configured
        doc = yaml.safe_load(serve.config_path.read_text())
        doc["security"] = {"rate_limits": {"per_client": {"calls_per_s": 0.01, "burst": 2}}}
        serve.config_path.write_text(yaml.safe_dump(doc))
        pid = serve.proc.pid
        serve.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:  # the reload runs as a task of the loop: the limit holds from its end on
            got = run(calls(3))
            if got[-1] == "BadTooManyOperations":
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
        assert run(calls(1)) == ["BadTooManyOperations"]  # the bucket is empty and refills at 0.01/s
        assert serve.proc.poll() is None and serve.proc.pid == pid  # reloaded, not restarted
    finally:
        serve.close()
