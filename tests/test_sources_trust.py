"""A source trusted for the first time while serve runs: Refused until `appliance sources trust NAME --yes THUMB`
(the CLI, in a process of its own, as an engineer runs it), then Connected at the source client's next attempt,
without restarting serve. A real plant server (asyncua, SignAndEncrypt, its own self-signed certificate), the
appliance in a process of its own, State read over OPC UA by a real client.
"""
from __future__ import annotations

import pytest

from harness import RunningAppliance, free_ports
from source_servers import PlantServer, server_certificate
from test_sources_te import NS_URI, cli, thumbprint_of, wait_value
from uaclient import read, run, session

pytest.importorskip("models.te_classifier")


@pytest.fixture
def untrusted_plant(tmp_path):
    port = free_ports(1)[0]
    cert, key = server_certificate(tmp_path / "plant", "te-plant")
    sources = {"line9": {"endpoint": f"opc.tcp://127.0.0.1:{port}", "sampling_interval_ms": 100,
                         "publishing_interval_ms": 100, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0,
                         "timeout_s": 2.0, "nodes": {"x": f"nsu={NS_URI};s=TE.XMEAS1"}}}
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier"}}
    state = tmp_path / "state"
    config = tmp_path / "cli.yaml"  # the same sources and state directory as the appliance's YAML, for the CLI
    import yaml
    config.write_text(yaml.safe_dump({"server": {"state_dir": str(state)}, "models": models, "sources": sources}))
    assert cli("certs", "init", "--config", str(config)).returncode == 0
    server = PlantServer.asyncua(port, cert, key, fault=0, rows=10, interval=0.1)
    app = RunningAppliance(state, models, {"sources": sources})
    app.scada = app.issue("scada", "engineer")
    try:
        yield app, config, cert
    finally:
        app.stop()
        server.kill()


def test_a_source_trusted_while_serve_runs_connects_at_its_next_attempt(untrusted_plant):
    app, config, cert = untrusted_plant

    async def refused():
        async with session(app, *app.scada) as scada:
            await wait_value(scada, ("Sources", "line9", "State"), lambda v: v == "Refused", timeout=30)
            assert "not trusted" in await read(scada, "Sources", "line9", "LastError")
    run(refused(), timeout=60)

    r = cli("sources", "trust", "line9", "--yes", thumbprint_of(cert), "--config", str(config))
    assert r.returncode == 0, r.stderr

    async def connected():
        async with session(app, *app.scada) as scada:  # back-off at most 2 s: well within 30 s
            await wait_value(scada, ("Sources", "line9", "State"), lambda v: v == "Connected", timeout=30)
            assert await read(scada, "Alarms", "SourceFault", "line9") is False
    run(connected(), timeout=60)
