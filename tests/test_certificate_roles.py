"""`security.certificate_roles` by subject, bound to the CA that issued the certificate, the way a plant meets it:
two CAs trusted (the appliance's and a plant CA, or two plant CAs), a SCADA client's X509 user certificate mapped by
its subject; a certificate with the same subject from the other CA gets no role. A subject mapped without its CA is
refused by the configuration check while more than one CA is trusted. Thumbprint mappings are unchanged."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import yaml
from asyncua import ua

from certs.pki import PKI
from certs.x509io import thumbprint
from certificates import make_test_certificate, make_test_crl
from gds import plc_session
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run

SUBJECT = "CN=scada-01,O=Test Plant"


def _plant_ca(pki: PKI, name: str):
    ca = make_test_certificate(name, is_ca=True, application_uri=None)
    (pki.layout.trusted / f"{name.replace(' ', '-')}.der").write_bytes(ca.cert_der)
    (pki.layout.crl / f"{name.replace(' ', '-')}.crl").write_bytes(make_test_crl(ca, []))
    return ca


@pytest.fixture(scope="module")
def plant(tmp_path_factory):
    """A box whose trust list holds its own CA and two plant CAs; scada-01's certificate from each plant CA."""
    d = tmp_path_factory.mktemp("roles")
    state = d / "state"
    pki = PKI(state)
    pki.init(f"urn:{socket.gethostname()}:appliance", ["localhost"], ["127.0.0.1"])
    line3, line4 = _plant_ca(pki, "Line3 CA"), _plant_ca(pki, "Line4 CA")
    users = {}
    for ca, stem in ((line3, "scada-line3"), (line4, "scada-line4"), (line3, "scada-other")):
        cn = "scada-02" if stem == "scada-other" else "scada-01"
        users[stem] = make_test_certificate(cn, issuer=line3 if ca is line3 else line4,
                                            application_uri=None).write(d, stem)
    affine_model(d / "affine.onnx")
    return d, state, line3, line4, users


async def _infer_as(app, hmi, user) -> str:
    """An HMI's channel, the user certificate as identity; Infer (operator) answered, or the activation refused."""
    uri = f"urn:{socket.gethostname()}:appliance:client:{hmi[0].stem}"
    try:
        async with plc_session(app.endpoint, *hmi, *user, uri) as client:
            return (await call(client, "affine", "Infer", [floats([1.0, 2.0, 3.0, 4.0])])).StatusCode.name
    except ua.UaStatusCodeError as e:
        return type(e).__name__


def test_a_subject_counts_only_with_the_ca_named_for_it(plant):
    d, state, line3, line4, users = plant
    roles = {SUBJECT: {"role": "operator", "issuer": thumbprint(line3.cert_der)},
             thumbprint(users["scada-other"][0].read_bytes()): "operator"}  # a thumbprint mapping, as before
    app = RunningAppliance(state, {"affine": {"kind": "tensor", "path": str(d / "affine.onnx")}},
                           extra={"security": {"certificate_roles": roles}})
    try:
        hmi = app.issue("hmi", "monitor")

        async def go():
            return {stem: await _infer_as(app, hmi, users[stem]) for stem in users}
        outcome = run(go(), 120)
        assert outcome["scada-line3"] == "Good"
        # the same subject from another trusted CA: no role, so no session
        assert outcome["scada-line4"] in ("BadIdentityTokenRejected", "BadUserAccessDenied",
                                          "BadIdentityTokenInvalid"), outcome
        assert outcome["scada-other"] == "Good"
    finally:
        app.stop()


def _yaml(d, state, roles) -> str:
    path = d / "roles.yaml"
    path.write_text(yaml.safe_dump({"server": {"state_dir": str(state)},
                                    "security": {"certificate_roles": roles},
                                    "models": {"affine": {"kind": "tensor", "path": str(d / "affine.onnx")}}},
                                   sort_keys=False))
    return str(path)


def test_a_subject_without_its_ca_is_refused_by_the_configuration_check(plant):
    d, state, line3, _, _ = plant
    path = _yaml(d, state, {SUBJECT: "operator"})
    done = subprocess.run([sys.executable, "-m", "appliance", "check-config", path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    line = next(i for i, text in enumerate(open(path).read().splitlines(), 1) if "scada-01" in text)
    assert f"{path}:{line}: security.certificate_roles['{SUBJECT}']: 3 CAs are trusted" in done.stderr
    assert "issuer" in done.stderr
    bound = _yaml(d, state, {SUBJECT: {"role": "operator", "issuer": thumbprint(line3.cert_der).upper()}})
    assert subprocess.run([sys.executable, "-m", "appliance", "check-config", bound], capture_output=True,
                          text=True, timeout=120).returncode == 0


def test_a_subject_alone_is_enough_while_one_ca_is_trusted(tmp_path):
    from core.config import load_config
    state = tmp_path / "state"
    PKI(state).init(f"urn:{socket.gethostname()}:appliance", ["localhost"], ["127.0.0.1"])
    affine_model(tmp_path / "affine.onnx")
    cfg = load_config(_yaml(tmp_path, state, {SUBJECT: "operator"}))
    sec = cfg.security
    assert sec.role_for_certificate("00" * 20, "O=Test Plant,CN=scada-01", "ab" * 20, 1) == "operator"
    assert sec.role_for_certificate("00" * 20, "O=Test Plant,CN=scada-01", "ab" * 20, 2) is None  # a second CA came


@pytest.mark.parametrize("value, message", [
    ({"role": "operator", "issuer": "nope"}, "expected the SHA-1 thumbprint"),
    ({"issuer": "ab" * 20}, "a role is required"),
    ({"role": "operator", "issuer": "ab" * 20, "extra": 1}, "unknown key 'extra'"),
])
def test_bad_bound_mappings_name_the_key(tmp_path, value, message):
    from core.config import ConfigError, load_config
    affine_model(tmp_path / "affine.onnx")
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, tmp_path / "state", {SUBJECT: value}))
    assert any(f"security.certificate_roles['{SUBJECT}']" in line and message in line for line in e.value.errors), \
        e.value.errors
