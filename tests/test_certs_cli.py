"""`appliance certs ...` functions: output, exit codes and the files they leave behind."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509

from certs import PKI, TrustList
from appliance.cli.certs import (cmd_export_server, cmd_init, cmd_issue, cmd_list, cmd_reject, cmd_revoke,
                                 cmd_trust)
from certificates import make_test_certificate

URI = "urn:line3:appliance"


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    """One PKI for the whole module; tests below run in order and build on each other."""
    return tmp_path_factory.mktemp("cli") / "state"


def test_init_prints_what_it_made_and_refuses_twice(state, capsys):
    assert cmd_init(state, URI, ["line3"], ["192.168.0.20"], force=False) == 0
    out = capsys.readouterr().out
    assert URI in out and "192.168.0.20" in out and "ca.der" in out
    assert PKI(state).exists()
    before = (state / "pki" / "own" / "cert.der").read_bytes()
    assert cmd_init(state, URI, ["line3"], [], force=False) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--force" in err and "cert.der" in err
    assert (state / "pki" / "own" / "cert.der").read_bytes() == before


def test_init_bad_arguments_exit_2(tmp_path, capsys):
    assert cmd_init(tmp_path, URI, ["line3"], ["not-an-ip"], force=False) == 2
    assert "not-an-ip" in capsys.readouterr().err


def test_issue_default_out_dir_and_role_map(state, capsys):
    assert cmd_issue(state, "s7-line3", "operator", None, "line3", None) == 0
    out = capsys.readouterr().out
    assert "urn:line3:appliance:client:s7-line3" in out and "not encrypted" in out
    clients = state / "clients"
    assert sorted(p.name for p in clients.iterdir()) == [
        "s7-line3.ca.crl", "s7-line3.ca.der", "s7-line3.der", "s7-line3.key.pem", "s7-line3.p12", "s7-line3.pem"]
    roles = json.loads((state / "access" / "certificates.json").read_text())
    (entry,) = roles.values()
    assert entry["name"] == "s7-line3" and entry["role"] == "operator" and "CN=s7-line3" in entry["subject"]
    assert TrustList(state / "pki").validate_application_certificate(
        (clients / "s7-line3.der").read_bytes(), "urn:line3:appliance:client:s7-line3").ok


def test_issue_errors_exit_2(state, tmp_path, capsys):
    assert cmd_issue(state, "hmi", "superuser", tmp_path, "line3", None) == 2
    assert "monitor, operator, engineer" in capsys.readouterr().err
    assert cmd_issue(state, "s7-line3", "monitor", tmp_path, "line3", None) == 2
    assert "already issued" in capsys.readouterr().err
    assert cmd_issue(tmp_path / "empty", "hmi", "monitor", tmp_path, "line3", None) == 2
    assert "certs init" in capsys.readouterr().err
    assert list(tmp_path.glob("hmi*")) == []


def test_issue_with_password_to_chosen_dir(state, tmp_path, capsys):
    assert cmd_issue(state, "scada", "engineer", tmp_path / "out", "line3", "pw-for-scada") == 0
    assert "not encrypted" not in capsys.readouterr().out
    assert b"ENCRYPTED" in (tmp_path / "out" / "scada.key.pem").read_bytes()


def test_list_shows_certificates_with_roles(state, capsys):
    assert cmd_list(state) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert "operator" in lines["s7-line3.der"] and "engineer" in lines["scada.der"]
    assert "[CA]" in lines["appliance-ca.der"] and "[NO CRL]" not in lines["appliance-ca.der"]
    plant = make_test_certificate("Plant CA", is_ca=True, application_uri=None)
    (state / "pki" / "trusted" / "plant-ca.der").write_bytes(plant.cert_der)
    assert cmd_list(state) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "[CA] [NO CRL]" in lines["plant-ca.der"]
    (state / "pki" / "trusted" / "plant-ca.der").unlink()


def test_untrusted_then_trust_then_reject(state, tmp_path, capsys):
    rogue = make_test_certificate("panel-pc", key_bits=2048)
    tl = TrustList(state / "pki")
    assert tl.validate_application_certificate(rogue.cert_der, None).status == "BadCertificateUntrusted"
    (rejected,) = (state / "pki" / "rejected").iterdir()
    assert cmd_list(state) == 0
    assert "rejected" in capsys.readouterr().out
    assert cmd_trust(state, rejected) == 0
    assert "trusted:" in capsys.readouterr().out
    assert tl.validate_application_certificate(rogue.cert_der, None).ok
    assert not rejected.exists()
    assert cmd_reject(state, rejected.stem) == 0
    captured = capsys.readouterr()
    assert "rejected" in captured.out and "still accepted" not in captured.err
    assert tl.validate_application_certificate(rogue.cert_der, None).status == "BadCertificateUntrusted"


def test_trust_warns_when_the_certificate_will_still_fail(state, tmp_path, capsys):
    weak = make_test_certificate("old-hmi", key_bits=1024)
    path = tmp_path / "old-hmi.der"
    path.write_bytes(weak.cert_der)
    assert cmd_trust(state, path) == 0
    assert "BadCertificatePolicyCheckFailed" in capsys.readouterr().err


def test_trust_errors_name_the_file(state, tmp_path, capsys):
    assert cmd_trust(state, tmp_path / "absent.der") == 2
    assert "absent.der" in capsys.readouterr().err
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    assert cmd_trust(state, junk) == 2
    err = capsys.readouterr().err
    assert "junk.pem" in err and "not a DER or PEM" in err


def test_reject_of_an_issued_certificate_warns_to_revoke(state, capsys):
    assert cmd_reject(state, "s7-line3") == 0
    assert "certs revoke" in capsys.readouterr().err
    assert cmd_trust(state, state / "pki" / "rejected" / "s7-line3.der") == 0
    capsys.readouterr()


def test_revoke_blocks_and_updates_list(state, capsys):
    der = (state / "clients" / "s7-line3.der").read_bytes()
    assert cmd_revoke(state, "s7-line3") == 0
    assert "CRL" in capsys.readouterr().out
    assert TrustList(state / "pki").validate_user_certificate(der).status == "BadCertificateRevoked"
    assert cmd_list(state) == 0
    assert "s7-line3" not in capsys.readouterr().out
    assert cmd_revoke(state, "s7-line3") == 2
    assert "s7-line3" in capsys.readouterr().err


def test_export_server(state, tmp_path, capsys):
    assert cmd_export_server(state, tmp_path / "plc") == 0
    printed = capsys.readouterr().out
    for name in ("appliance-server.der", "appliance-server.pem", "appliance-ca.der", "appliance-ca.pem"):
        assert name in printed and (tmp_path / "plc" / name).is_file()
    server = x509.load_der_x509_certificate((tmp_path / "plc" / "appliance-server.der").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "plc" / "appliance-ca.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    assert cmd_export_server(tmp_path / "nothing", tmp_path / "x") == 2
    assert "certs init" in capsys.readouterr().err
