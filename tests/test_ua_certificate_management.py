"""Part 12 push certificate management as a GDS meets it, on a real appliance over SignAndEncrypt: a signing request,
a certificate from a CA that is not the appliance's, UpdateCertificate, ApplyChanges, new channels with the new
certificate (no restart, no model reloaded); the TrustList read and rewritten as a file; bad input refused with the
standard status codes and nothing changed; the security_admin right."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import stat
import subprocess
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from asyncua import ua
from asyncua.ua.ua_binary import struct_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from appliance.daemon import certificate_names
from certs.pki import PKI
from certs.x509io import thumbprint
from certificates import make_test_certificate, make_test_crl
from gds import (CERT_TYPE, GROUP, SERVER_CONFIGURATION, TRUST_LIST, byte_string, call, create_signing_request,
                 method, nodeid, outputs, plant_ca, plc_session, read_trust_list, sign_request, u32, update_certificate,
                 write_trust_list)
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call as call_model, floats, run, session, status_name
from worker_probes import wait_for

PLC_URI = "urn:plant:line3:plc7"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("ua_certs")
    affine_model(d / "affine.onnx")
    state = d / "state"
    # A server certificate 10 days from its end: the expiry alarm is on when the appliance starts.
    names = certificate_names(SimpleNamespace(server=SimpleNamespace(
        endpoint="opc.tcp://127.0.0.1:4840", advertised_host=None, dns_names=[], ip_addresses=[])))
    PKI(state).init(f"urn:{socket.gethostname()}:appliance", *names, server_days=10)
    a = RunningAppliance(state, {"affine": {"kind": "tensor", "path": str(d / "affine.onnx")}})
    a.admin = a.issue("gds", "security_admin")
    a.operator = a.issue("plc1", "operator")
    a.engineer = a.issue("eng1", "engineer")
    a.monitor = a.issue("hmi", "monitor")
    yield a
    a.stop()


def metric(app, name: str) -> float:
    with urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def endpoint_certificate(app) -> bytes:
    """The server certificate GetEndpoints carries (its chain, leaf first)."""
    from asyncua import Client
    client = Client(app.endpoint)
    endpoints = await client.connect_and_get_server_endpoints()
    return next(e.ServerCertificate for e in endpoints
                if e.SecurityMode == ua.MessageSecurityMode.SignAndEncrypt)


def leaf(chain: bytes) -> bytes:
    from certs.x509io import split_der_chain
    return split_der_chain(chain)[0]


def audit_records(app) -> list[dict]:
    path = app.state_dir / "audit" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gds_push_renews_the_server_certificate_without_a_restart(app, tmp_path):
    ca = plant_ca()
    old_cert = app.pki.layout.own_cert_der.read_bytes()
    sup = app.app.supervisors[0]
    pid, restarts = sup.process.pid, sup.restarts
    assert metric(app, "appliance_server_certificate_expiring") == 1  # 10 days left: the alarm is on

    async def go():
        async with session(app, *app.operator) as plc:
            assert (await call_model(plc, "affine", "Infer", [floats([1, 2, 3, 4])])).StatusCode.is_good()
            async with session(app, *app.admin) as gds:
                csr = await create_signing_request(gds)
                request = x509.load_der_x509_csr(csr)
                assert request.public_key().public_numbers() == x509.load_der_x509_certificate(
                    old_cert).public_key().public_numbers()
                new_cert = sign_request(ca, csr)
                res = await update_certificate(gds, new_cert, [ca.cert_der])
                assert res.StatusCode.is_good(), res.StatusCode
                assert outputs(res) == [True]  # ApplyChangesRequired
                # staged, not applied: new channels still get the old certificate
                assert leaf(await endpoint_certificate(app)) == old_cert
                res = await call(gds, SERVER_CONFIGURATION, method("ApplyChanges"))
                assert res.StatusCode.is_good(), res.StatusCode
                answered = time.monotonic()
                # the caller got its answer; its channel closes about a second later
                chain = await endpoint_certificate(app)
                assert leaf(chain) == new_cert and chain == new_cert + ca.cert_der
                assert await gds.nodes.server_state.read_value() == ua.ServerState.Running
                while gds.uaclient.protocol.transport is not None and time.monotonic() - answered < 5:
                    await asyncio.sleep(0.02)
                closed_after = time.monotonic() - answered
                assert 0.8 <= closed_after <= 3.0, closed_after
            # a client that trusts only the plant CA connects now, and sees the new certificate on its channel
            async with session(app, *app.admin) as fresh:
                assert fresh.security_policy.peer_certificate == new_cert
            plc_cert, plc_key = make_test_certificate("plc7", application_uri=PLC_URI).write(tmp_path, "plc7")
            app.pki.trust(plc_cert)
            async with plc_session(app.endpoint, plc_cert, plc_key, *app.monitor, PLC_URI, trust_only=ca.cert) as c:
                assert c.security_policy.peer_certificate == new_cert
            # the PLC's channel was closed too; it connects again (GetEndpoints: the new certificate) and calls
            assert plc.uaclient.protocol.transport is None
        async with session(app, *app.operator) as plc:
            assert (await call_model(plc, "affine", "Infer", [floats([1, 2, 3, 4])])).StatusCode.is_good()
        return new_cert
    new_cert = run(go(), 120)
    assert app.pki.layout.own_cert_der.read_bytes() == new_cert
    assert sup.process.pid == pid and sup.restarts == restarts  # no model reloaded
    assert metric(app, "appliance_server_certificate_expiring") == 0
    left = metric(app, "appliance_server_certificate_expiry_seconds")
    assert 364 * 86400 < left <= 365 * 86400
    records = wait_for(lambda: [r for r in audit_records(app) if r["action"] in ("UpdateCertificate", "ApplyChanges")
                                and r["status"] == "Good"], 10, "the Good UpdateCertificate/ApplyChanges records")
    apply = next(r for r in records if r["action"] == "ApplyChanges")
    assert thumbprint(old_cert) in apply["detail"] and thumbprint(new_cert) in apply["detail"]
    assert apply["user"] == f"x509:{thumbprint(app.admin[0].read_bytes())}" and apply["role"] == "security_admin"


def test_trust_list_rewritten_as_a_file_refuses_a_removed_client_at_once(app, tmp_path):
    plc_cert, plc_key = make_test_certificate("plc9", application_uri=PLC_URI).write(tmp_path, "plc9")
    plc_der = plc_cert.read_bytes()

    async def plc_status() -> str:
        try:
            async with plc_session(app.endpoint, plc_cert, plc_key, *app.monitor, PLC_URI):
                return "Good"
        except ua.UaStatusCodeError as e:
            return type(e).__name__

    async def go():
        assert await plc_status() == "BadCertificateUntrusted"  # unknown: refused and filed in pki/rejected
        async with session(app, *app.admin) as gds:
            res = await call(gds, SERVER_CONFIGURATION, method("GetRejectedList"))
            assert res.StatusCode.is_good() and plc_der in outputs(res)[0]
            res = await call(gds, TRUST_LIST, method("AddCertificate"), byte_string(plc_der),
                             ua.Variant(True, ua.VariantType.Boolean))
            assert res.StatusCode.is_good(), res.StatusCode
        assert await plc_status() == "Good"  # added: accepted at the next CreateSession
        async with session(app, *app.admin) as gds:
            tl = await read_trust_list(gds)
            assert tl.SpecifiedLists == 15 and plc_der in tl.TrustedCertificates
            assert app.pki.layout.ca_cert_der.read_bytes() in tl.TrustedCertificates
            assert len(tl.TrustedCrls) == 1  # the appliance CA's CRL goes with it
            tl.TrustedCertificates = [c for c in tl.TrustedCertificates if c != plc_der]
            res = await write_trust_list(gds, tl)
            assert res.StatusCode.is_good(), res.StatusCode
            assert outputs(res) == [False]  # in effect at once
            again = await read_trust_list(gds)
            assert plc_der not in again.TrustedCertificates
            assert sorted(again.TrustedCertificates) == sorted(tl.TrustedCertificates)
            assert again.TrustedCrls == tl.TrustedCrls
            masked = await read_trust_list(gds, masks=1)
            assert masked.SpecifiedLists == 1 and masked.TrustedCrls == [] and masked.TrustedCertificates
        assert await plc_status() == "BadCertificateUntrusted"  # removed: refused, no restart
        async with session(app, *app.admin) as gds:  # the others keep working
            res = await call(gds, SERVER_CONFIGURATION, method("GetRejectedList"))
            assert res.StatusCode.is_good()
    run(go(), 120)
    assert not any(thumbprint(plc_der) in p.name or p.read_bytes() == plc_der
                   for p in app.pki.layout.trusted.iterdir())


def test_trust_list_methods_answer_on_the_types_node_ids(app):
    async def go():
        async with session(app, *app.admin) as gds:
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Open), ua.Variant(1, ua.VariantType.Byte))
            assert res.StatusCode.is_good(), res.StatusCode
            handle = outputs(res)[0]
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Read), u32(handle),
                             ua.Variant(100000, ua.VariantType.Int32))
            data = outputs(res)[0]
            assert res.StatusCode.is_good() and len(data) > 100
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_GetPosition), u32(handle))
            assert outputs(res) == [len(data)]
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_SetPosition), u32(handle),
                             ua.Variant(10, ua.VariantType.UInt64))
            assert res.StatusCode.is_good()
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Read), u32(handle),
                             ua.Variant(5, ua.VariantType.Int32))
            assert outputs(res) == [data[10:15]]
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Close), u32(handle))
            assert res.StatusCode.is_good()
            res = await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.TrustListType_OpenWithMasks), u32(4))
            assert res.StatusCode.is_good()
            assert (await call(gds, TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Close),
                               u32(outputs(res)[0]))).StatusCode.is_good()
            res = await call(gds, SERVER_CONFIGURATION, ua.NodeId(ua.ObjectIds.ServerConfigurationType_GetRejectedList))
            assert res.StatusCode.is_good()
            # another FileType object (the HTTPS group's trust list, which the appliance does not serve)
            https = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultHttpsGroup_TrustList)
            res = await call(gds, https, ua.NodeId(ua.ObjectIds.FileType_Open), ua.Variant(1, ua.VariantType.Byte))
            assert res.StatusCode.name == "BadMethodInvalid"
            res = await call(gds, SERVER_CONFIGURATION, ua.NodeId(ua.ObjectIds.FileType_Open),
                             ua.Variant(1, ua.VariantType.Byte))
            assert res.StatusCode.name == "BadMethodInvalid"
    run(go())


def test_server_configuration_properties(app):
    async def go():
        async with session(app, *app.monitor) as c:
            value = lambda i: c.get_node(ua.NodeId(i)).read_value()  # noqa: E731
            O = ua.ObjectIds
            assert await value(O.ServerConfiguration_SupportedPrivateKeyFormats) == ["PEM", "PFX"]
            assert await value(O.ServerConfiguration_MaxTrustListSize) == 1024 * 1024
            assert await value(O.ServerConfiguration_MulticastDnsEnabled) is False
            assert await value(O.ServerConfiguration_ServerCapabilities) == ["DA", "AC"]
            assert await value(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_CertificateTypes) == [
                ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)]
            assert await value(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_Size) > 0
    run(go())


def _expired(app, ca, csr: bytes) -> bytes:
    return sign_request(ca, csr, days=1, not_before=datetime.now(timezone.utc) - timedelta(days=3))


def test_bad_input_answers_standard_status_codes_and_changes_nothing(app, tmp_path):
    ca = plant_ca("Other Plant CA")

    def snapshot():
        pki = app.pki
        return (pki.layout.own_cert_der.read_bytes(), pki.layout.own_key_pem.read_bytes(),
                sorted(p.read_bytes() for p in pki.layout.trusted.iterdir()),
                (pki.layout.pki_dir / "own" / "pending").exists())

    before = snapshot()

    async def go():
        async with session(app, *app.admin) as gds:
            csr = await create_signing_request(gds)
            good = sign_request(ca, csr)
            other_key = make_test_certificate("x", application_uri=None).cert_der
            bad_uri = sign_request(ca, csr, san=x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("urn:elsewhere"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
            no_host = sign_request(ca, csr, san=x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(app.config.server.application_uri), x509.DNSName("elsewhere")]))
            cases = {
                "another key": (other_key, [ca.cert_der], "BadCertificateInvalid"),
                "expired": (_expired(app, ca, csr), [ca.cert_der], "BadCertificateTimeInvalid"),
                "truncated": (good[:-40], [ca.cert_der], "BadCertificateInvalid"),
                "other ApplicationUri": (bad_uri, [ca.cert_der], "BadCertificateUriInvalid"),
                "no endpoint host": (no_host, [ca.cert_der], "BadCertificateHostNameInvalid"),
                "issuer not sent, unknown": (good, [], "BadSecurityChecksFailed"),
                "wrong issuer": (good, [plant_ca("Third CA").cert_der], "BadSecurityChecksFailed"),
            }
            for name, (cert, issuers, status) in cases.items():
                res = await update_certificate(gds, cert, issuers)
                assert res.StatusCode.name == status, name
            res = await update_certificate(gds, good, [ca.cert_der], "PEM", b"not a key")
            assert res.StatusCode.name == "BadNotSupported"
            res = await update_certificate(gds, good, [ca.cert_der], "DER", b"x")
            assert res.StatusCode.name == "BadNotSupported"
            res = await call(gds, SERVER_CONFIGURATION, method("CreateSigningRequest"), nodeid(GROUP),
                             nodeid(CERT_TYPE), ua.Variant("", ua.VariantType.String),
                             ua.Variant(True, ua.VariantType.Boolean), byte_string(b"short"))
            assert res.StatusCode.name == "BadInvalidArgument"  # a new key needs 32 bytes of the caller's entropy
            res = await call(gds, SERVER_CONFIGURATION, method("UpdateCertificate"), nodeid(ua.NodeId(5, 0)),
                             nodeid(CERT_TYPE), byte_string(good), ua.Variant([], ua.VariantType.ByteString,
                                                                              is_array=True),
                             ua.Variant("", ua.VariantType.String), byte_string(b""))
            assert res.StatusCode.name == "BadInvalidArgument"  # not the DefaultApplicationGroup
            # ApplyChanges with nothing staged changes nothing
            assert (await call(gds, SERVER_CONFIGURATION, method("ApplyChanges"))).StatusCode.is_good()

            # the TrustList file
            res = await call(gds, TRUST_LIST, method("Write"), u32(4242), byte_string(b"x"))
            assert res.StatusCode.name == "BadInvalidArgument"  # Write without Open: no such handle
            res = await call(gds, TRUST_LIST, method("Open"), ua.Variant(2, ua.VariantType.Byte))
            assert res.StatusCode.name == "BadInvalidArgument"  # Write without EraseExisting: not for a TrustList
            res = await call(gds, TRUST_LIST, method("Open"), ua.Variant(6, ua.VariantType.Byte))
            handle = outputs(res)[0]
            res = await call(gds, TRUST_LIST, method("Open"), ua.Variant(6, ua.VariantType.Byte))
            assert res.StatusCode.name == "BadNotWritable"  # a second Open for writing
            res = await call(gds, TRUST_LIST, method("Open"), ua.Variant(1, ua.VariantType.Byte))
            assert res.StatusCode.name == "BadNotReadable"  # nobody reads while it is written
            res = await call(gds, TRUST_LIST, method("Read"), u32(handle), ua.Variant(10, ua.VariantType.Int32))
            assert res.StatusCode.name == "BadInvalidState"  # opened for writing
            res = await call(gds, TRUST_LIST, method("AddCertificate"), byte_string(other_key),
                             ua.Variant(True, ua.VariantType.Boolean))
            assert res.StatusCode.name == "BadInvalidState"  # not while the TrustList is open
            async with session(app, *app.admin) as other:  # a handle belongs to the session that opened it
                res = await call(other, TRUST_LIST, method("Write"), u32(handle), byte_string(b"x"))
                assert res.StatusCode.name == "BadInvalidArgument"
            full = struct_to_binary(ua.TrustListDataType(SpecifiedLists=15, TrustedCertificates=[other_key]))
            res = await call(gds, TRUST_LIST, method("Write"), u32(handle), byte_string(full[:-30]))
            assert res.StatusCode.is_good()
            res = await call(gds, TRUST_LIST, method("CloseAndUpdate"), u32(handle))
            assert res.StatusCode.name == "BadDecodingError"  # a truncated file
            res = await write_trust_list(gds, ua.TrustListDataType(
                SpecifiedLists=1, TrustedCertificates=[other_key, b"\x30\x03\x02\x01\x01"]))
            assert res.StatusCode.name == "BadCertificateInvalid"  # one bad entry: none of it applied
            res = await write_trust_list(gds, ua.TrustListDataType(SpecifiedLists=2, TrustedCrls=[b"nope"]))
            assert res.StatusCode.name == "BadCertificateInvalid"
            res = await call(gds, TRUST_LIST, method("RemoveCertificate"), ua.Variant("00" * 20, ua.VariantType.String),
                             ua.Variant(True, ua.VariantType.Boolean))
            assert res.StatusCode.name == "BadInvalidArgument"
            res = await call(gds, TRUST_LIST, method("AddCertificate"), byte_string(b"\x30\x82garbage"),
                             ua.Variant(True, ua.VariantType.Boolean))
            assert res.StatusCode.name == "BadCertificateInvalid"
    run(go(), 120)
    assert snapshot() == before
    refused = wait_for(lambda: [r for r in audit_records(app) if r["action"] == "UpdateCertificate"
                                and r["status"] == "BadCertificateInvalid"], 10, "the refused UpdateCertificate's record")
    assert all(r["role"] == "security_admin" for r in refused)


def test_only_security_admin_manages_certificates(app):
    async def go():
        for who in (app.operator, app.engineer, app.monitor):
            async with session(app, *who) as c:
                for obj, mid, args in (
                        (SERVER_CONFIGURATION, method("CreateSigningRequest"),
                         [nodeid(GROUP), nodeid(CERT_TYPE), ua.Variant("", ua.VariantType.String),
                          ua.Variant(False, ua.VariantType.Boolean), byte_string(b"")]),
                        (SERVER_CONFIGURATION, method("ApplyChanges"), []),
                        (TRUST_LIST, method("Open"), [ua.Variant(1, ua.VariantType.Byte)]),
                        (TRUST_LIST, ua.NodeId(ua.ObjectIds.FileType_Open), [ua.Variant(6, ua.VariantType.Byte)]),
                        (TRUST_LIST, method("AddCertificate"), [byte_string(b"x"),
                                                                ua.Variant(True, ua.VariantType.Boolean)])):
                    res = await call(c, obj, mid, *args)
                    assert res.StatusCode.name == "BadUserAccessDenied", (who, mid)
        # security_admin is monitor + certificates: no model methods
        async with session(app, *app.admin) as c:
            res = await call_model(c, "affine", "Infer", [floats([1, 2, 3, 4])])
            assert res.StatusCode.name == "BadUserAccessDenied"
    run(go())


def test_engineers_when_the_yaml_says_so_and_never_over_sign_only(tmp_path):
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                         {"security": {"engineers_manage_certificates": True, "modes": ["SignAndEncrypt", "Sign"]}})
    try:
        engineer = a.issue("eng", "engineer")
        admin = a.issue("gds", "security_admin")

        async def go():
            async with session(a, *engineer) as c:
                res = await call(c, SERVER_CONFIGURATION, method("GetRejectedList"))
                assert res.StatusCode.is_good(), res.StatusCode
                assert (await call_model(c, "affine", "Infer", [floats([1, 2, 3, 4])])).StatusCode.is_good()
            async with session(a, *admin, mode="Sign") as c:
                res = await call(c, SERVER_CONFIGURATION, method("GetRejectedList"))
                assert res.StatusCode.name == "BadSecurityModeInsufficient"
        run(go())
    finally:
        a.stop()


def test_a_restart_keeps_the_plant_certificate(tmp_path):
    """pki.ensure at start renews an appliance-CA certificate whose names changed; one from the plant's CA is the
    plant's to renew: it stays, with its chain."""
    state = tmp_path / "state"
    pki = PKI(state)
    uri = f"urn:{socket.gethostname()}:appliance"
    pki.init(uri, ["localhost"], ["127.0.0.1"])
    ca = plant_ca()
    from certs.server_certificate import ServerCertificateStore, ServerIdentity
    store = ServerCertificateStore(pki.layout.pki_dir)
    csr = store.signing_request()
    cert = sign_request(ca, csr, san=x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri),
                                                                  x509.DNSName("line3.plant")]))
    store.stage(ServerIdentity(uri, ("line3.plant",)), cert, [ca.cert_der])
    store.install_staged()
    assert not pki.ensure(uri, ["localhost", "another-name"], ["127.0.0.1"])
    assert pki.layout.own_cert_der.read_bytes() == cert
    assert [c.public_bytes(serialization.Encoding.DER) for c in store.issuers()] == [ca.cert_der]


ROOT = Path(__file__).resolve().parent.parent


def node_step(app, client, step: str, *args: str, pki_dir: Path | None = None) -> dict:
    """One step of tests/node/gds_push.js (node-opcua, calling the standard methods by NodeId)."""
    cert_der, key = client
    uri = f"urn:{socket.gethostname()}:appliance:client:{cert_der.stem}"
    proc = subprocess.run(["node", str(ROOT / "tests" / "node" / "gds_push.js"), step, app.endpoint,
                           str(cert_der.with_suffix(".pem")), str(key), uri,
                           str(pki_dir or app.state_dir / f"node-pki-{cert_der.stem}"), *args],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, (proc.stdout, proc.stderr)
    return json.loads(lines[-1])


def test_gds_push_from_node_opcua(tmp_path):
    """node-opcua as the GDS: CSR, a certificate from its CA, UpdateCertificate, ApplyChanges; a client that trusts
    only that CA connects afterwards (not before); the TrustList rewritten without a PLC's certificate refuses it."""
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}})
    try:
        gds = a.issue("gdsnode", "security_admin")
        ca = plant_ca("Node GDS CA")
        strict = tmp_path / "strict-pki"
        (strict / "trusted" / "certs").mkdir(parents=True)
        (strict / "trusted" / "certs" / "plant-ca.der").write_bytes(ca.cert_der)
        (strict / "trusted" / "crl").mkdir()  # node-opcua checks revocation: the plant CA's (empty) CRL
        (strict / "trusted" / "crl" / "plant-ca.crl").write_bytes(make_test_crl(ca, []))
        refused = node_step(a, gds, "connect", pki_dir=strict)
        # the server's chain ends in the appliance CA, which this client neither trusts nor has a CRL for: node-opcua
        # checks revocation first and names that, not a hang or any other error
        assert refused.get("error", "").endswith("BadCertificateRevocationUnknown (0x801b0000)"), refused

        csr = tmp_path / "server.csr"
        assert node_step(a, gds, "csr", str(csr))["status"] == "Good"
        new_cert = tmp_path / "server.der"
        new_cert.write_bytes(sign_request(ca, csr.read_bytes()))
        (tmp_path / "ca.der").write_bytes(ca.cert_der)
        out = node_step(a, gds, "update", str(new_cert), str(tmp_path / "ca.der"))
        assert out == {"step": "update", "update": "Good", "applyChangesRequired": True, "apply": "Good",
                       "serverCertificate": out["serverCertificate"]}, out
        time.sleep(1.5)  # the channels opened before ApplyChanges are closed by now
        connected = node_step(a, gds, "connect", pki_dir=strict)
        assert connected.get("status") == "Good", connected
        assert connected["serverCertificate"] == thumbprint(new_cert.read_bytes())

        plc_cert, plc_key = make_test_certificate("plc5", application_uri=PLC_URI).write(tmp_path, "plc5")
        a.pki.trust(plc_cert)  # trusted by the CLI's folder

        async def plc_status() -> str:
            try:
                async with plc_session(a.endpoint, plc_cert, plc_key, *gds, PLC_URI, trust_only=ca.cert):
                    return "Good"
            except ua.UaStatusCodeError as e:
                return type(e).__name__
        assert run(plc_status()) == "Good"
        thumb = thumbprint(plc_cert.read_bytes())
        out = node_step(a, gds, "remove-trusted", thumb)
        assert out["status"] == "Good" and out["applyChangesRequired"] is False, out
        assert thumb in out["before"] and thumb not in out["after"] and len(out["after"]) == len(out["before"]) - 1
        assert run(plc_status()) == "BadCertificateUntrusted"
    finally:
        a.stop()


def test_an_install_interrupted_half_way_is_finished_at_the_next_start(tmp_path):
    """ApplyChanges moves the key, then the certificate: a power cut between the two leaves a key that does not fit
    the certificate, and the staged files; the next start finishes the install instead of failing to serve."""
    state = tmp_path / "state"
    pki = PKI(state)
    uri = f"urn:{socket.gethostname()}:appliance"
    pki.init(uri, ["localhost"], ["127.0.0.1"])
    from certs.server_certificate import ServerCertificateStore, ServerIdentity
    store = ServerCertificateStore(pki.layout.pki_dir)
    csr = store.signing_request(regenerate_key=True, nonce=bytes(32))
    ca = plant_ca()
    cert = sign_request(ca, csr)
    store.stage(ServerIdentity(uri, ("127.0.0.1",)), cert, [ca.cert_der])
    pki.layout.own_key_pem.write_bytes((store.pending_dir / "key.pem").read_bytes())  # the key moved, then the cut
    assert not pki.ensure(uri, ["localhost"], ["127.0.0.1"])
    assert pki.layout.own_cert_der.read_bytes() == cert and not store.pending_dir.exists()
    key = serialization.load_pem_private_key(pki.layout.own_key_pem.read_bytes(), None)
    assert key.public_key().public_numbers() == x509.load_der_x509_certificate(cert).public_key().public_numbers()


def test_close_and_update_of_a_large_list_answers_other_sessions_meanwhile(app, tmp_path):
    """A list of 1,000 certificates written, parsed and fsynced by CloseAndUpdate: an HMI's reads go on being
    answered."""
    key = make_test_certificate("bulk-0").key
    bulk = [make_test_certificate(f"bulk-{i}", key=key, application_uri=f"urn:bulk:{i}").cert_der
            for i in range(990)]

    async def go():
        async with session(app, *app.admin) as gds, session(app, *app.monitor) as hmi:
            tl = await read_trust_list(gds)
            original = ua.TrustListDataType(SpecifiedLists=15, TrustedCertificates=list(tl.TrustedCertificates),
                                            TrustedCrls=list(tl.TrustedCrls),
                                            IssuerCertificates=list(tl.IssuerCertificates),
                                            IssuerCrls=list(tl.IssuerCrls))
            tl.TrustedCertificates = (list(tl.TrustedCertificates) + bulk)[:1000]  # MAX_ENTRIES a list
            state = hmi.get_node(ua.NodeId(ua.ObjectIds.Server_ServerStatus_State))
            answered: list[float] = []
            done = asyncio.Event()

            async def poll():
                while not done.is_set():
                    await state.read_value()
                    answered.append(time.monotonic())

            poller = asyncio.create_task(poll())
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            res = await write_trust_list(gds, tl, piece=200_000)
            t1 = time.monotonic()
            done.set()
            await poller
            assert res.StatusCode.is_good(), res.StatusCode
            assert len((await read_trust_list(gds)).TrustedCertificates) == len(tl.TrustedCertificates)
            assert (await write_trust_list(gds, original, piece=200_000)).StatusCode.is_good()
            return t0, t1, answered

    t0, t1, answered = run(go(), 300)
    during = [t for t in answered if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0, *during], [*during, t1])]
    print(f"CloseAndUpdate of a 1,000-certificate list (with the writes): {t1 - t0:.2f} s; {len(during)} reads "
          f"answered meanwhile, the longest wait {max(gaps) * 1000:.0f} ms")
    assert t1 - t0 > 0.5  # long enough to tell a blocked loop from a free one
    assert max(gaps) < (t1 - t0) / 3, "the event loop stood still while the trust list was written"


def test_a_replaced_list_with_a_non_ca_issuer_is_refused_and_changes_nothing(app, tmp_path):
    leaf = make_test_certificate("not-a-ca", application_uri=None)

    async def go():
        async with session(app, *app.admin) as gds:
            tl = await read_trust_list(gds)
            before = sorted(tl.IssuerCertificates)
            tl.IssuerCertificates = list(tl.IssuerCertificates) + [leaf.cert_der]
            res = await write_trust_list(gds, tl)
            assert res.StatusCode.name == "BadCertificateInvalid", res.StatusCode
            assert sorted((await read_trust_list(gds)).IssuerCertificates) == before
    run(go(), 120)


def test_close_and_update_without_the_appliance_cas_crl_says_so_and_revokes_nothing(tmp_path):
    """A GDS push that leaves out the appliance CA's CRL: answered Good (the list is the GDS's), audited and raised
    as an event naming the CA; the CA's clients are then refused as revocation-unknown, not silently un-revoked."""
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}})
    try:
        admin = a.issue("gds", "security_admin")
        plc = a.issue("plc1", "operator")
        ca_subject = x509.load_der_x509_certificate(a.pki.layout.ca_cert_der.read_bytes()).subject.rfc4514_string()

        async def go():
            async with session(a, *plc):
                pass  # the CA's CRL in place: connected
            async with session(a, *admin) as gds:
                tl = await read_trust_list(gds)
                assert len(tl.TrustedCrls) == 1
                tl.TrustedCrls = []
                res = await write_trust_list(gds, tl)
                assert res.StatusCode.is_good(), res.StatusCode
            with pytest.raises(ua.UaStatusCodeError) as refused:
                async with session(a, *plc):
                    pass
            return refused.value
        refused = run(go(), 120)
        assert type(refused).__name__ == "BadCertificateRevocationUnknown"
        update = [r for r in audit_records(a) if r["action"] == "TrustList.CloseAndUpdate"][-1]
        assert update["status"] == "Good" and "CAs without a CRL" in update["detail"] and ca_subject in \
            update["detail"]
    finally:
        a.stop()


def test_a_requested_key_goes_with_cancel_apply_and_age_and_its_late_certificate_is_refused_saying_why(tmp_path):
    """CreateSigningRequest with RegeneratePrivateKey keeps a new key (0600, in a 0700 folder) only while its
    request is pending: a second request, CancelChanges, ApplyChanges of another certificate and 24 hours each end
    it, and a certificate issued for it afterwards is refused with the reason in the audit trail."""
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                         extra={"security": {"crl_check_interval_s": 1}})
    ca = plant_ca("Pending CA")
    key_file = a.pki.layout.private / "requested-key.pem"
    try:
        admin = a.issue("gds", "security_admin")

        def refusal() -> str:
            return [r for r in audit_records(a) if r["action"] == "UpdateCertificate"][-1]["detail"]

        async def go():
            async with session(a, *admin) as gds:
                first = await create_signing_request(gds, new_key=True, nonce=bytes(range(32)))
                assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
                assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
                second = await create_signing_request(gds, new_key=True, nonce=bytes(range(32)))
                res = await update_certificate(gds, sign_request(ca, first), [ca.cert_der])
                assert res.StatusCode.name == "BadCertificateInvalid"
                await asyncio.sleep(0.3)  # audited once the answer is out
                assert "superseded by a later CreateSigningRequest" in refusal()

                assert (await call(gds, SERVER_CONFIGURATION, method("CancelChanges"))).StatusCode.is_good()
                assert not key_file.exists()
                res = await update_certificate(gds, sign_request(ca, second), [ca.cert_der])
                assert res.StatusCode.name == "BadCertificateInvalid"
                await asyncio.sleep(0.3)
                assert "cancelled by CancelChanges" in refusal()

                third = await create_signing_request(gds, new_key=True, nonce=bytes(range(32)))
                same_key = await create_signing_request(gds, new_key=False)
                res = await update_certificate(gds, sign_request(ca, same_key), [ca.cert_der])
                assert res.StatusCode.is_good(), res.StatusCode
                assert (await call(gds, SERVER_CONFIGURATION, method("ApplyChanges"))).StatusCode.is_good()
                assert not key_file.exists()
            await asyncio.sleep(1.5)  # ApplyChanges closes the channels opened before it
            async with session(a, *admin) as gds:
                res = await update_certificate(gds, sign_request(ca, third), [ca.cert_der])
                assert res.StatusCode.name == "BadCertificateInvalid"
                await asyncio.sleep(0.3)
                assert "superseded by ApplyChanges of another certificate" in refusal()

                fourth = await create_signing_request(gds, new_key=True, nonce=bytes(range(32)))
                old = time.time() - 25 * 3600
                os.utime(key_file, (old, old))
                res = await update_certificate(gds, sign_request(ca, fourth), [ca.cert_der])
                assert res.StatusCode.name == "BadCertificateInvalid"
                await asyncio.sleep(0.3)
                assert "expired 24 hours after its CreateSigningRequest" in refusal()
                assert not key_file.exists()

                # nobody calls: serve's timer deletes a key that waited too long all the same
                await create_signing_request(gds, new_key=True, nonce=bytes(range(32)))
                os.utime(key_file, (old, old))
                end = time.monotonic() + 15
                while key_file.exists() and time.monotonic() < end:
                    await asyncio.sleep(0.2)
                assert not key_file.exists()
        run(go(), 240)
    finally:
        a.stop()


def test_get_certificates_from_node_opcua(app):
    """Part 12 1.05's GetCertificates, called by node-opcua (generic session.call by NodeId: its push-management
    client has no method for it) as a GDS reads which certificates the server holds; security_admin only."""
    out = node_step(app, app.admin, "get-certificates")
    assert out["status"] == "Good", out
    assert out["certificateTypes"] == ["ns=0;i=12560"]  # RsaSha256ApplicationCertificateType
    assert out["certificates"] == [thumbprint(app.pki.layout.own_cert_der.read_bytes())]
    assert out["serverCertificate"] == out["certificates"][0]  # the one its channel presented
    assert node_step(app, app.engineer, "get-certificates")["status"] == "BadUserAccessDenied"

    async def go():
        async with session(app, *app.admin) as gds:
            node = gds.get_node(ua.NodeId(ua.ObjectIds.ServerConfiguration_GetCertificates))
            assert (await node.read_browse_name()).Name == "GetCertificates"
            wrong = await call(gds, SERVER_CONFIGURATION, node.nodeid, nodeid(ua.NodeId(5, 0)))
            assert wrong.StatusCode.name == "BadInvalidArgument"
            # by the type's method NodeId too, with a null group (the default group)
            type_method = ua.NodeId(ua.ObjectIds.ServerConfigurationType_GetCertificates)
            by_type = await call(gds, SERVER_CONFIGURATION, type_method, nodeid(ua.NodeId()))
            assert by_type.StatusCode.is_good(), by_type.StatusCode
            assert outputs(by_type)[1] == [app.pki.layout.own_cert_der.read_bytes()]
    run(go(), 60)


def test_security_admin_calls_have_a_rate_limit_bucket(tmp_path):
    affine_model(tmp_path / "affine.onnx")
    a = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(tmp_path / "affine.onnx")}},
                         extra={"security": {"rate_limits": {"security_admin": {"calls_per_s": 0.2, "burst": 3}}}})
    try:
        gds1, gds2, plc = a.issue("gds1", "security_admin"), a.issue("gds2", "security_admin"), \
            a.issue("plc1", "operator")

        async def go():
            async with session(a, *gds1) as c1, session(a, *gds2) as c2, session(a, *plc) as p:
                statuses = [(await call(c1, SERVER_CONFIGURATION, method("GetRejectedList"))).StatusCode.name
                            for _ in range(4)]
                assert statuses == ["Good"] * 3 + ["BadTooManyOperations"], statuses
                # one bucket for the role: the other GDS client is over it too; operators are not
                assert (await call(c2, SERVER_CONFIGURATION, method("GetRejectedList"))).StatusCode.name == \
                    "BadTooManyOperations"
                assert status_name(await call_model(p, "affine", "Infer", [floats([1] * 4)])) == "Good"
        run(go(), 60)
        assert metric_line(a, 'appliance_rate_limited_total{role="security_admin"}') == 2.0
    finally:
        a.stop()


def metric_line(app, prefix: str) -> float:
    with urllib.request.urlopen(app.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix + " "))
