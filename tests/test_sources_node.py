"""A second, independent plant server: node-opcua (tests/node/te_source.js), shaped like an S7-1500's OPC UA server:
SignAndEncrypt only, user name + password only (no anonymous), 8 KiB transport buffers, and a PKI of its own that
trusts the appliance's source client certificate explicitly. The appliance trusts it with `appliance sources trust`,
keeps the user's password from `appliance sources passwd` (never in the YAML), `appliance sources test` reads every
node once, and the demo TE classifier watching the replayed IDV2 run raises the fault's alarm from the data alone."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import test_alarm_sources_te as te_alarms
import test_sources_te as te_sources
from harness import RunningAppliance, free_ports
from source_servers import HERE, PlantServer, server_certificate
from uaclient import read, run, session

te = pytest.importorskip("models.te_classifier")
NS_URI = "urn:te-plant-node"
USER, PASSWORD = "ai-reader", "s7 line password"
FIRST_ROW, LAST_ROW = 130, 230


@pytest.fixture(scope="module")
def node_plant(tmp_path_factory):
    assert (HERE / "node" / "node_modules" / "node-opcua-server").exists(), "run `npm ci` in tests/node"
    d = tmp_path_factory.mktemp("sources-node")
    port = free_ports(1)[0]
    cert_der, key = server_certificate(d / "plant", "s7-like", uri="urn:te-plant-node:server")
    cert_pem = d / "plant" / "s7-like.pem"
    cert_pem.write_bytes(x509.load_der_x509_certificate(cert_der.read_bytes()).public_bytes(
        serialization.Encoding.PEM))
    from te_source_server import NAMES
    sources = {"s7": {"endpoint": f"opc.tcp://127.0.0.1:{port}", "user": USER, "sampling_interval_ms": 0,
                      "publishing_interval_ms": 50, "queue_size": 100, "stale_after_s": 60,
                      "reconnect_min_s": 0.2, "reconnect_max_s": 2.0,
                      "nodes": {name: f"nsu={NS_URI};s=TE.{name}" for name in NAMES},
                      "feeds": {"s7line": {"model": "te", "window": 20}}}}
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": te_alarms._labels(),
                     "alarm_classes": te_alarms.ALARM_CLASSES}}
    state = d / "state"
    config = d / "cli.yaml"
    config.write_text(yaml.safe_dump({"server": {"state_dir": str(state)}, "models": models, "sources": sources}))
    assert te_sources.cli("certs", "init", "--config", str(config)).returncode == 0
    # the plant's own PKI trusts the appliance's client certificate for this source and knows its issuer
    from appliance.sources.identity import SourceFiles
    from certs.pki import PKI
    files = SourceFiles.of(state, "s7")
    files.ensure_client_certificate(state, "s7")
    layout = PKI(state).layout
    pki = d / "plant-pki"
    for folder, src, name in (("trusted/certs", files.client_cert, "appliance-source.der"),
                              ("issuers/certs", layout.ca_cert_der, "appliance-ca.der"),
                              ("issuers/crl", layout.ca_crl_der, "appliance-ca.crl")):
        (pki / folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, pki / folder / name)
    rows_file = d / "rows.json"
    rows_file.write_text(json.dumps(te.load_te_rows(2, test=True)[FIRST_ROW:LAST_ROW].tolist()))
    server = PlantServer(["node", str(HERE / "node" / "te_source.js"), str(port), str(cert_pem), str(key), str(pki),
                          str(rows_file), USER, PASSWORD, "0.1"], cwd=HERE / "node")
    r = te_sources.cli("sources", "trust", "s7", "--yes", te_sources.thumbprint_of(cert_der), "--config", str(config))
    assert r.returncode == 0, r.stderr
    r = te_sources.cli("sources", "passwd", "s7", "--config", str(config), env={"APPLIANCE_PASSWORD": PASSWORD})
    assert r.returncode == 0, r.stderr
    assert PASSWORD not in config.read_text()
    app = RunningAppliance(state, models, {"sources": sources})
    app.scada = app.issue("scada", "monitor")
    yield app, server, config
    app.stop()
    server.kill()


def test_sources_test_reads_every_node_through_user_name_and_8_kib_buffers(node_plant):
    app, server, config = node_plant
    r = te_sources.cli("sources", "test", "s7", "--config", str(config), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "XMV11" in r.stdout and "Good" in r.stdout and "every node resolved and read" in r.stdout


def test_the_s7_like_node_opcua_server_feeds_the_classifier_and_its_alarm_rises(node_plant):
    app, server, config = node_plant

    async def go():
        async with session(app, *app.scada) as scada:
            await te_sources.wait_value(scada, ("Sources", "s7", "State"), lambda v: v == "Connected")
            server.go()
            server.wait_for("done", 120)
            await te_sources.wait_value(scada, ("Alarms", "s7line", te_alarms.LABEL), lambda v: v is True,
                                        timeout=30)
            assert await read(scada, "Models", "te", "Last", "s7line", "Label") == te_alarms.LABEL
            assert await read(scada, "Sources", "s7", "WindowsSkipped") == 0
            # every row's 52 values (the counters reach the address space within about a second)
            await te_sources.wait_value(scada, ("Sources", "s7", "SamplesReceived"),
                                        lambda v: v >= 52 * (LAST_ROW - FIRST_ROW), timeout=15)
    run(go(), timeout=240)

