"""The appliance watches the line itself: a plant's OPC UA server (asyncua, its own process) replays the Tennessee
Eastman held-out run of fault IDV2 (d02_te: normal for 160 rows, then the fault) over SignAndEncrypt with its own
certificate, trusted through `appliance sources trust --yes`; the appliance subscribes, cuts 20-row windows
(stride 1) and runs the demo TE classifier on them. A SCADA client subscribed to the appliance sees the class alarm
and acknowledges it; the source is killed and restarted mid-run; a node goes Bad; the source presents another
certificate. Beside it, in the same appliance: a source nobody listens for (unreachable from the start) and hostile
ones (an oversized value, a message over the decode limit, a server that never answers).

The alarm: offline, the classifier's third consecutive IDV2 window (the debounce) ends at row 181, 22 windows after
the onset (row 160), 21 rows after it; the test counts windows (not seconds, which a loaded machine stretches),
allows 30 and prints what it measured.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest
from asyncua import ua

import test_alarm_sources_te as te_alarms
import test_ua_alarms as alarm_helpers
from harness import RunningAppliance, free_ports
from source_servers import ROOT, PlantServer, server_certificate
from uaclient import call, floats, read, run, session, status_name

te = pytest.importorskip("models.te_classifier")
V = ua.VariantType
LABEL = te_alarms.LABEL  # IDV2 B composition step
ONSET = te.FAULT_ONSET_ROW
FIRST_ROW, INTERVAL = 100, 0.1
NS_URI = "urn:te-plant"
ALARM_WITHIN_ROWS = 30  # windows (stride 1: rows) after the onset; offline 22


def te_nodes() -> dict:
    nodes = {name: f"nsu={NS_URI};s=TE.{name}" for name in te_alarms_names()}
    nodes["XMV11"] = {"path": [f"nsu={NS_URI};Plant", f"nsu={NS_URI};XMV11"]}  # one by browse path
    return nodes


def te_alarms_names() -> list[str]:
    from te_source_server import NAMES
    return NAMES


def cli(*args: str, env: dict | None = None, timeout: float = 60, answer: str | None = None
        ) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          input=answer if answer is not None else "")


def thumbprint_of(der_path) -> str:
    from certs.x509io import thumbprint
    return thumbprint(der_path.read_bytes())


@pytest.fixture(scope="module")
def plant(tmp_path_factory):
    d = tmp_path_factory.mktemp("sources-te")
    ports = free_ports(5)
    line1_port, hostile_port, silent_port, nowhere_port, flood_port = ports
    cert, key = server_certificate(d / "plant", "te-plant")
    other_cert, other_key = server_certificate(d / "plant", "te-plant-2")  # the certificate it changes to
    hostile_cert, hostile_key = server_certificate(d / "plant", "hostile")
    common = {"sampling_interval_ms": 10, "publishing_interval_ms": 20, "queue_size": 200, "stale_after_s": 60,
              "reconnect_min_s": 0.2, "reconnect_max_s": 2.0, "timeout_s": 2.0}
    sources = {
        "line1": {"endpoint": f"opc.tcp://127.0.0.1:{line1_port}", **common, "nodes": te_nodes(),
                  "feeds": {"line1": {"model": "te", "window": 20, "stride": 1,
                                      "write_back": {"ClassIndex": f"nsu={NS_URI};s=TE.AiClass",
                                                     "Confidence": f"nsu={NS_URI};s=TE.AiConfidence"}}}},
        "nowhere": {"endpoint": f"opc.tcp://127.0.0.1:{nowhere_port}", **common,
                    "nodes": {"x": f"nsu={NS_URI};s=TE.XMEAS1"}},
        "oversized": {"endpoint": f"opc.tcp://127.0.0.1:{hostile_port}", **common, "max_array_length": 1000,
                      "nodes": {"big": f"nsu={NS_URI};s=TE.Big"}},
        "toolarge": {"endpoint": f"opc.tcp://127.0.0.1:{hostile_port}", **common, "max_message_size": 1048576,
                     "max_array_length": 1_000_000, "nodes": {"big": f"nsu={NS_URI};s=TE.Big"}},
        "silent": {"endpoint": f"opc.tcp://127.0.0.1:{silent_port}", **common,
                   "nodes": {"x": f"nsu={NS_URI};s=TE.XMEAS1"}},
        "flood": {"endpoint": f"opc.tcp://127.0.0.1:{flood_port}", **common, "queue_size": 10000,
                  "nodes": {"f": f"nsu={NS_URI};s=TE.Flood"}},
    }
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": te_alarms._labels(),
                     "alarm_classes": te_alarms.ALARM_CLASSES}}
    state = d / "state"
    config = d / "cli.yaml"  # the same sources and state directory as the appliance's YAML, for the CLI
    import yaml
    config.write_text(yaml.safe_dump({"server": {"state_dir": str(state)}, "models": models, "sources": sources}))
    assert cli("certs", "init", "--config", str(config)).returncode == 0

    line1 = PlantServer.asyncua(line1_port, cert, key, fault=2, start_row=FIRST_ROW, rows=120, interval=INTERVAL)
    hostile = PlantServer.asyncua(hostile_port, hostile_cert, hostile_key, hostile="oversized")
    silent = PlantServer.asyncua(silent_port, hostile_cert, hostile_key, hostile="silent")
    flood = PlantServer.asyncua(flood_port, hostile_cert, hostile_key, hostile="flood", rows=6)
    for name, der in (("line1", cert), ("oversized", hostile_cert), ("toolarge", hostile_cert),
                      ("flood", hostile_cert)):
        r = cli("sources", "trust", name, "--yes", thumbprint_of(der), "--config", str(config))
        assert r.returncode == 0, r.stderr
        assert "ApplicationUri  urn:te-plant:server" in r.stdout and thumbprint_of(der) in r.stdout
    app = RunningAppliance(state, models, {"sources": sources})
    app.scada = app.issue("scada", "engineer")  # subscribes to alarms and acknowledges them
    app.plc = app.issue("plc", "operator")
    p = type("Plant", (), {})()
    p.app, p.line1, p.hostile, p.silent, p.config, p.dir = app, line1, hostile, silent, config, d
    p.flood = flood
    p.cert, p.key, p.other_cert, p.other_key, p.port = cert, key, other_cert, other_key, line1_port
    yield p
    app.stop()
    for server in (p.line1, hostile, silent, flood):
        server.kill()


def _unix(when) -> float:
    from datetime import timezone
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


async def source_value(client, source: str, name: str):
    return await read(client, "Sources", source, name)


async def wait_value(client, path: tuple, predicate, timeout: float = 60.0):
    end = time.monotonic() + timeout
    value = None
    while time.monotonic() < end:
        value = await read(client, *path)
        if predicate(value):
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"{'/'.join(path)} stayed {value!r}")


def plant_endpoint(plant):
    """What `session` needs to connect to the plant's server instead of the appliance."""
    return type("Endpoint", (), {"endpoint": f"opc.tcp://127.0.0.1:{plant.port}"})()


async def windows_handled(client) -> int:
    """Windows of line1 cut and given to the model: run, or dropped for a newer one while the model was busy."""
    return await source_value(client, "line1", "WindowsRun") + await source_value(client, "line1", "WindowsDropped")


async def settled(read_value, quiet_s: float = 2.5, timeout: float = 30.0):
    """A figure once it stopped changing for quiet_s (counters reach /metrics within about a second)."""
    value, since, end = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        now = read_value()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return value
        await asyncio.sleep(0.25)
    return value


async def settled_async(read_value, quiet_s: float = 2.5, timeout: float = 30.0):
    """As settled, for a value read over OPC UA."""
    value, since, end = None, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        now = await read_value()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return value
        await asyncio.sleep(0.25)
    return value


def metric(app, name: str, **labels) -> float:
    text = urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_fault_alarm_rises_from_the_data_alone_and_the_source_restarts_without_a_window_across_the_gap(plant):
    app = plant.app

    async def go():
        async with session(app, *app.scada) as scada:
            events = await alarm_helpers.alarm_events(scada)
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connected")
            plant.line1.go()
            raised = await events.next(alarm_helpers.is_condition(f"te.line1.{LABEL}", True, False), timeout=90)
            # counted in windows, not in time (the machine may lag): the rows are the server's initial values (row
            # FIRST_ROW's), then rows FIRST_ROW, FIRST_ROW + 1, ...; the k-th window ends at row FIRST_ROW + k + 17.
            # Read after the event, the count holds every window run since, but perhaps not yet the alarm's own (it
            # is counted once its result is written): k <= count + 1, an upper bound of the alarm's row.
            handled = await windows_handled(scada)
            alarm_row = FIRST_ROW + handled + 18
            print(f"IDV2 alarm raised at most {alarm_row - ONSET} windows after the onset at row {ONSET} "
                  f"(by the clock: row {plant.line1.row_at(_unix(alarm_helpers.field(raised, 'Time')))})")
            assert ONSET < alarm_row <= ONSET + ALARM_WITHIN_ROWS
            condition = alarm_helpers.field(raised, "NodeId")
            assert condition.Identifier == f"Appliance/Conditions/te/line1/{LABEL}"
            ack = await alarm_helpers.acknowledge(scada, condition, alarm_helpers.field(raised, "EventId"),
                                                  "seen on the line")
            assert ack.StatusCode.is_good(), ack.StatusCode
            await events.next(alarm_helpers.is_condition(f"te.line1.{LABEL}", True, True))
            assert await read(scada, "Models", "te", "Last", "line1", "Label") == LABEL
            assert await read(scada, "Alarms", "line1", LABEL) is True
            # the result written back into the plant's own server, only where write_back says
            async with session(plant_endpoint(plant), *app.plc, anonymous=True) as line:
                ns = await line.get_namespace_index(NS_URI)
                ai_class = line.get_node(ua.NodeId("TE.AiClass", ns))
                end = time.monotonic() + 15
                while await ai_class.read_value() != te_alarms.FAULT and time.monotonic() < end:
                    await asyncio.sleep(0.1)
                assert await ai_class.read_value() == te_alarms.FAULT
                assert 0.5 < await line.get_node(ua.NodeId("TE.AiConfidence", ns)).read_value() <= 1.0

            # the plant server dies mid-run and comes back: SourceFault, a reconnect, no window across the gap
            plant.line1.wait_for("row 205")
            run_before = await windows_handled(scada)
            events.events.clear()  # a loaded machine may have made the source flap (a probe timed out) before
            plant.line1.kill()
            fault = await events.next(alarm_helpers.is_condition("SourceFault.line1", True, False), timeout=30)
            assert alarm_helpers.field(fault, "SourceName") == "line1"
            assert "Connecting" in alarm_helpers.field(fault, "Message").Text, alarm_helpers.field(fault, "Message")
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connecting", timeout=10)
            plant.line1 = PlantServer.asyncua(plant.port, plant.cert, plant.key, fault=2, start_row=230, rows=40,
                                              interval=INTERVAL)
            listening = time.monotonic()
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connected")
            print(f"Connected again {time.monotonic() - listening:.2f} s after the plant server listened again "
                  "(back-off 0.2 s doubling to 2 s in this test)")
            await events.next(alarm_helpers.is_condition("SourceFault.line1", False, False), timeout=30)
            assert await source_value(scada, "line1", "Reconnects") >= 1
            run_at_reconnect = await windows_handled(scada)
            plant.line1.go()
            plant.line1.wait_for("done", 60)
            run_after = await settled_async(lambda: windows_handled(scada))
            # the new subscription's first values (the server's current ones) and the 40 rows written make 41 rows,
            # 41 - 19 = 22 windows (run, or dropped for a newer one while the model was busy): none spans the gap
            assert run_after - run_at_reconnect == 41 - 19, (run_before, run_at_reconnect, run_after)
            assert metric(app, "appliance_source_windows_skipped_total", source="line1", reason="gap") >= 1
            assert await read(scada, "Models", "te", "Last", "line1", "Label") == LABEL

            # the last window watched (rows 250..269) gives what Infer / Classify give for it
            window = te.load_te_rows(2, test=True)[250:270].reshape(-1)
            async with session(app, *app.plc) as plc:
                r = await call(plc, "te", "Classify", [floats(window)])
                assert status_name(r) == "Good"
            index, label, confidence = r.OutputArguments[0].Value, r.OutputArguments[1].Value, \
                r.OutputArguments[2].Value
            assert await read(scada, "Models", "te", "Last", "line1", "Label") == label[0]
            assert await read(scada, "Models", "te", "Last", "line1", "ClassIndex") == index[0]
            assert await read(scada, "Models", "te", "Last", "line1", "Confidence") == confidence[0]
    run(go(), timeout=300)
    delay = metric(app, "appliance_source_delay_seconds_count", feed="line1")
    assert delay > 0
    app.run(asyncio.sleep(0.5))
    writes = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()
              if '"source_write"' in line]
    statuses = [w["status"] for w in writes]
    # every write audited with the server's answer: Good, or the connection's failure while the plant was killed
    assert statuses.count("Good") >= 40, statuses
    assert set(statuses) <= {"Good", "BadCommunicationError", "BadNotConnected", "BadTimeout"}, set(statuses)
    assert any("ClassIndex 2 -> nsu=urn:te-plant;s=TE.AiClass" in w["detail"] for w in writes)


def test_a_node_that_goes_bad_skips_windows_and_raises_source_fault_until_it_is_good_again(plant):
    app = plant.app

    async def go():
        async with session(app, *app.scada) as scada:
            events = await alarm_helpers.alarm_events(scada)
            skipped = metric(app, "appliance_source_windows_skipped_total", source="line1", reason="bad")
            plant.line1.kill()
            plant.line1 = PlantServer.asyncua(plant.port, plant.cert, plant.key, fault=2, start_row=300, rows=60,
                                              interval=INTERVAL, bad_rows="320:330")
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connected")
            await asyncio.sleep(0.5)
            events.events.clear()
            plant.line1.go()
            await events.next(alarm_helpers.is_condition("SourceFault.line1", True, False), timeout=30)
            assert "BadSensorFailure" in await source_value(scada, "line1", "LastError")
            await events.next(alarm_helpers.is_condition("SourceFault.line1", False, False), timeout=30)
            plant.line1.wait_for("done", 60)
            await asyncio.sleep(1.0)
            assert await source_value(scada, "line1", "State") == "Connected"
            # 10 bad rows, each a window not run; the 19 rows after them refill the window, skipped too
            bad = await settled(lambda: metric(app, "appliance_source_windows_skipped_total", source="line1",
                                               reason="bad") - skipped)
            assert bad == 10 + 19
    run(go(), timeout=180)


def test_a_crash_of_the_sources_client_process_is_restarted_and_visible(plant):
    import os
    import signal

    from serve_process import children, command_line
    app = plant.app
    pids = [pid for pid in children(os.getpid()) if "appliance.sources.process" in command_line(pid)]
    assert len(pids) == 1, pids
    restarts = metric(app, "appliance_source_process_restarts_total")

    async def go():
        async with session(app, *app.scada) as scada:
            events = await alarm_helpers.alarm_events(scada)
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connected")
            samples = await source_value(scada, "line1", "SamplesReceived")
            events.events.clear()
            os.kill(pids[0], signal.SIGKILL)
            raised = await events.next(alarm_helpers.is_condition("SourceFault.line1", True, False), timeout=30)
            condition = alarm_helpers.field(raised, "NodeId")
            assert condition.Identifier == "Appliance/Conditions/SourceFault/line1"
            ack = await alarm_helpers.acknowledge(scada, condition, alarm_helpers.field(raised, "EventId"), "seen")
            assert ack.StatusCode.is_good(), ack.StatusCode  # a SCADA acknowledges a source's fault
            await events.next(alarm_helpers.is_condition("SourceFault.line1", True, True), timeout=30)
            error = await source_value(scada, "line1", "LastError")
            assert "sources client process stopped (killed by signal SIGKILL)" in error, error
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Connected", timeout=60)
            await events.next(alarm_helpers.is_condition("SourceFault.line1", False, True), timeout=30)
            assert await source_value(scada, "line1", "SamplesReceived") >= samples  # kept across the restart
    run(go(), timeout=120)
    assert metric(app, "appliance_source_process_restarts_total") == restarts + 1
    assert [pid for pid in children(os.getpid()) if "appliance.sources.process" in command_line(pid)] != pids


def test_a_source_that_presents_another_certificate_is_refused_and_alarmed(plant):
    app = plant.app

    async def go():
        async with session(app, *app.scada) as scada:
            plant.line1.kill()
            plant.line1 = PlantServer.asyncua(plant.port, plant.other_cert, plant.other_key, fault=0, rows=10)
            await wait_value(scada, ("Sources", "line1", "State"), lambda v: v == "Refused", timeout=30)
            error = await source_value(scada, "line1", "LastError")
            assert "another certificate" in error and thumbprint_of(plant.other_cert) in error
            assert await read(scada, "Alarms", "SourceFault", "line1") is True
            await asyncio.sleep(3)  # retried with back-off, never trusted on its own
            assert await source_value(scada, "line1", "State") == "Refused"
    run(go(), timeout=120)
    from appliance.sources.identity import SourceFiles
    assert SourceFiles.of(plant.app.state_dir, "line1").trusted.read_bytes() == plant.cert.read_bytes()


def test_unreachable_and_hostile_sources_never_stop_the_methods_and_readyz_names_them(plant):
    app = plant.app

    async def go():
        async with session(app, *app.plc) as plc:
            for name, words in (("nowhere", "does not answer"), ("silent", "does not answer"),
                                ("oversized", "max_array_length 1000"), ("toolarge", "")):
                await wait_value(plc, ("Sources", name, "State"), lambda v: v == "Connecting")
                error = await wait_value(plc, ("Sources", name, "LastError"), lambda v: bool(v), timeout=30)
                assert words in error, (name, error)
            assert await read(plc, "Alarms", "SourceFault", "silent") is True
            window = te.load_te_rows(0, test=True)[:20].reshape(-1)
            await wait_value(plc, ("Sources", "flood", "State"), lambda v: v == "Connected")
            plant.flood.go()  # and one source floods its publishes meanwhile
            slowest = 0.0
            for _ in range(20):  # served while a source never answers, others are refused and one floods
                started = time.monotonic()
                r = await call(plc, "te", "Infer", [floats(window)])
                slowest = max(slowest, time.monotonic() - started)
                assert status_name(r) == "Good"
                await asyncio.sleep(0.2)
            print(f"slowest Infer during the flood: {slowest * 1000:.0f} ms")
            assert slowest < 3.0
            flooded = int(plant.flood.wait_for("done", 30).split()[1])
            received = await wait_value(plc, ("Sources", "flood", "SamplesReceived"), lambda v: v > 1000)
            print(f"the flood: {flooded} writes, {received} samples taken in (the server's queue keeps 10000 per "
                  "publish)")
    run(go(), timeout=120)
    body = json.loads(urllib.request.urlopen(app.metrics_url + "/readyz", timeout=10).read())
    assert body["ready"] is True
    assert {"nowhere", "silent", "oversized", "toolarge"} <= set(body["sources_down"])
    assert metric(app, "appliance_source_state", source="silent") == 1
    page = urllib.request.urlopen(app.metrics_url + "/", timeout=10).read().decode()
    assert "<h2>Sources</h2>" in page and ">nowhere</b>" in page and ">line1</b>" in page


def test_sources_test_names_what_failed_and_list_shows_the_trust(plant):
    r = cli("sources", "test", "silent", "--config", str(plant.config), timeout=60)
    assert r.returncode == 2 and "does not answer" in r.stderr, r.stderr
    r = cli("sources", "test", "oversized", "--config", str(plant.config), timeout=60)
    assert r.returncode == 2 and "max_array_length" in r.stderr, r.stderr
    # trust shows the certificate and stores it only on confirmation; a wrong --yes stores nothing either
    from appliance.sources.identity import SourceFiles
    trusted = SourceFiles.of(plant.app.state_dir, "line1").trusted
    before = trusted.read_bytes()
    r = cli("sources", "trust", "line1", "--config", str(plant.config), answer="n\n")
    assert r.returncode == 2 and "not trusted" in r.stderr and thumbprint_of(plant.other_cert) in r.stdout
    assert "it replaces the certificate trusted until now" in r.stdout
    r = cli("sources", "trust", "line1", "--yes", "00" * 20, "--config", str(plant.config))
    assert r.returncode == 2 and "does not name this certificate" in r.stderr
    assert trusted.read_bytes() == before
    r = cli("sources", "list", "--config", str(plant.config))
    assert r.returncode == 0 and "server certificate not trusted yet" in r.stdout  # nowhere, silent
    assert thumbprint_of(plant.cert) in r.stdout
