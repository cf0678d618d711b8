"""Monitoring for real: Debian's Prometheus scrapes a running appliance; its HTTP API shows up == 1, a request
counter that moves and a heartbeat timestamp that is the loop's last tick; `promtool check metrics` passes on
/metrics; the alerting rules pass `promtool test rules` (one stalled box among live ones among them).

The Grafana dashboard: no registry this project installs from carries a Grafana server, so it is not imported into a
real Grafana; instead every variable it references is defined (a missing one fails the import), every panel and
query names the datasource variable, every series selector is narrowed by $instance, each panel's quantiles are the
ones its title names, and every panel's queries, with the variables substituted as Grafana substitutes them, return
data from the live Prometheus for the appliance's instance and none for another (GPU panels: only with a GPU)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from asyncua import ua

from harness import RunningAppliance, free_ports
from onnx_models import affine_model
from uaclient import call, floats, run, session
from worker_probes import wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "appliance-dashboard.json"
pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="Prometheus is not installed (Debian package prometheus; "
                                       "scripts/setup-system.sh installs it)")


def test_rules_pass_promtool():
    # the unit tests include boxes whose clocks are off (no NTP): one 60 s behind that ticks and must not alert, one
    # 10 min ahead that stalls and must; a rule comparing the box's clock with Prometheus's fails both
    for args in (["check", "rules", "appliance-rules.yml"], ["test", "rules", "appliance-rules.test.yml"],
                 ["check", "config", "prometheus.yml"]):
        out = subprocess.run(["promtool", *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    d = tmp_path_factory.mktemp("prometheus")
    make_model_dir(d / "chat")
    a = RunningAppliance(d / "state", {"classifier": {"kind": "tensor", "path": str(affine_model(d / "a.onnx"))},
                                       "chat": {"kind": "generative", "path": str(d / "chat")}})
    a.operator = a.issue("plc", "operator")
    yield a
    a.stop()


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory):
    d = tmp_path_factory.mktemp("prom")
    port, = free_ports(1)
    (d / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: appliance\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{app.metrics_port}']\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/-/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def query(url: str, expr: str) -> list:
    body = urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10).read()
    reply = json.loads(body)
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def traffic(app, n: int = 20) -> None:
    async def go():
        async with session(app, *app.operator) as c:
            for _ in range(n):
                await call(c, "classifier", "Infer", [floats([1, 2, 3, 4])])
            await call(c, "chat", "Generate", [ua.Variant("Pump status?", ua.VariantType.String),
                                               ua.Variant(4, ua.VariantType.UInt32),
                                               ua.Variant(0.0, ua.VariantType.Float)])
    run(go())


def test_metrics_pass_promtool(app):
    text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10).read()
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).decode().splitlines() if line.strip()]
    # The one lint left: the contract names the gauge appliance_kv_slots_total (CONTRACT.md, "HTTP for
    # monitoring"), and promtool's naming convention reserves _total for counters. Anything else fails.
    allowed = 'appliance_kv_slots_total non-counter metrics should not have "_total" suffix'
    assert [p for p in problems if p != allowed] == [], problems


def test_scraped_and_a_counter_moves(app, prometheus):
    wait_for(lambda: query(prometheus, 'up{job="appliance"} == 1'), 30, "Prometheus to scrape the appliance")
    traffic(app)
    expr = 'sum(appliance_requests_total{model="classifier",status="Good"})'
    first = float(wait_for(lambda: query(prometheus, expr), 30, expr)[0]["value"][1])
    traffic(app, 10)
    wait_for(lambda: float(query(prometheus, expr)[0]["value"][1]) >= first + 10, 30, f"{expr} to count 10 more")


def test_heartbeat_timestamp_is_the_loops_last_tick(app, prometheus):
    text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10).read().decode()
    assert "# TYPE appliance_heartbeat_timestamp_seconds gauge" in text
    expr = 'appliance_heartbeat_timestamp_seconds{job="appliance"}'
    first = float(wait_for(lambda: query(prometheus, expr), 30, expr)[0]["value"][1])
    assert abs(time.time() - first) < 10  # the loop ticks every second; the scrape is at most a second old
    wait_for(lambda: float(query(prometheus, expr)[0]["value"][1]) >= first + 2, 20, f"{expr} to move 2 s on")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def grafana_regex(*instances: str) -> str:
    """$instance as Grafana writes a multi-value variable into a PromQL regex: values escaped, joined by |."""
    escaped = [re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\\\1", i) for i in instances]
    return "(" + "|".join(escaped) + ")"


def test_dashboard_variables_are_defined_and_every_panel_uses_them():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    assert variables["instance"]["includeAll"] and variables["instance"]["multi"]
    referenced = set(re.findall(r"\$\{?(\w+)", DASHBOARD.read_text()))
    assert referenced <= set(variables), referenced - set(variables)  # Grafana refuses what is not defined
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            for metric in re.finditer(r"appliance_\w+", target["expr"]):
                rest = target["expr"][metric.end():]
                assert rest.startswith('{instance=~"$instance"'), (panel["title"], target["expr"])


def test_dashboard_quantiles_are_the_ones_titled():
    for panel in dashboard()["panels"]:
        titled = {int(p) / 100 for p in re.findall(r"\bp(\d\d)\b", panel["title"])}
        titled |= {0.5} if "median" in panel["title"] else set()
        queried = {float(q) for t in panel["targets"] for q in re.findall(r"histogram_quantile\(([0-9.]+)", t["expr"])}
        assert queried == titled, (panel["title"], queried)


def test_instance_variable_lists_the_appliance(app, prometheus):
    instance = f"127.0.0.1:{app.metrics_port}"
    wait_for(lambda: query(prometheus, "appliance_model_info"), 30, "appliance_model_info in Prometheus")
    body = urllib.request.urlopen(prometheus + "/api/v1/label/instance/values?" + urllib.parse.urlencode(
        {"match[]": "appliance_model_info"}), timeout=10).read()
    assert json.loads(body)["data"] == [instance]


def test_every_dashboard_panel_has_data_for_its_instance_only(app, prometheus):
    os.kill(app.app.services["classifier"].supervisor.process.pid, signal.SIGKILL)  # a restart to count
    wait_for(lambda: app.app.services["classifier"].status().state == "Ready", 30, "the classifier to be Ready")
    for _ in range(3):
        traffic(app)
        time.sleep(1.0)
    this, other = grafana_regex(f"127.0.0.1:{app.metrics_port}"), grafana_regex("line9.example:9464")
    empty, leaked = [], []
    for panel in dashboard()["panels"]:
        if "GPU" in panel["description"]:
            continue  # no GPU here: appliance_gpu_* exist only with one
        for target in panel["targets"]:
            try:
                wait_for(lambda: query(prometheus, target["expr"].replace("$instance", this)), 20, target["expr"])
            except AssertionError:
                empty.append(panel["title"])
            if query(prometheus, target["expr"].replace("$instance", other)):
                leaked.append(panel["title"])
    assert not empty and not leaked, (empty, leaked)
