"""The appliance PKI (certs/): layout, certificate contents, issuing, trust list upkeep and OPC UA validation."""
from __future__ import annotations

import hashlib
import shutil
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs import PKI, PKIError, TrustList
from certs import validate as validate_mod
from certs.builder import new_rsa_key
from certificates import make_test_certificate, make_test_crl

URI = "urn:plant-box:appliance"
HOST = "plant-box"
NOW = datetime.now(timezone.utc)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _der(path: Path) -> x509.Certificate:
    return x509.load_der_x509_certificate(path.read_bytes())


def _client_uri(name: str) -> str:
    return f"urn:{HOST}:appliance:client:{name}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One initialised PKI with two issued clients, copied per test that changes it."""
    state = tmp_path_factory.mktemp("base")
    pki = PKI(state)
    pki.init(URI, [HOST, "plant-box.local"], ["10.0.0.5"])
    pki.issue("plc1", "operator", state / "clients", HOST)
    pki.issue("eng", "engineer", state / "clients", HOST, password="s3cret-pass")
    return state


@pytest.fixture
def pki(base, tmp_path) -> PKI:
    state = tmp_path / "state"
    shutil.copytree(base, state)
    return PKI(state)


@pytest.fixture(scope="module")
def key():
    return new_rsa_key(2048)


@pytest.fixture(scope="module")
def ca_key():
    return new_rsa_key(2048)


@pytest.fixture(scope="module")
def ca2_key():
    return new_rsa_key(2048)


def _trust_file(pki: PKI, cert_der: bytes, stem: str, folder: str = "trusted") -> Path:
    path = pki.layout.pki_dir / folder / f"{stem}.der"
    path.write_bytes(cert_der)
    return path


def _empty_crls(pki: PKI, *cas) -> None:
    """Each CA's (empty) CRL in pki/crl: a CA without one is revocation-unknown (security.require_crl)."""
    for ca in cas:
        (pki.layout.crl / f"{ca.cert.subject.rfc4514_string()[:20]}-{ca.cert.serial_number % 9999}.crl").write_bytes(
            make_test_crl(ca, []))


# -- layout and contents ----------------------------------------------------------------------------------------
def test_init_writes_the_documented_layout(base):
    pki = PKI(base)
    assert pki.exists()
    own = base / "pki" / "own"
    for name in ("cert.der", "cert.pem", "key.pem", "ca.der", "ca.pem"):
        assert (own / name).is_file(), name
    for folder in ("trusted", "issuers", "crl", "rejected", "private"):
        assert (base / "pki" / folder).is_dir(), folder
    assert _mode(own / "key.pem") == 0o600
    assert _mode(base / "pki" / "private" / "ca.key.pem") == 0o600
    assert _mode(base / "pki" / "private") == 0o700
    assert (base / "pki" / "trusted" / "appliance-ca.der").read_bytes() == (own / "ca.der").read_bytes()
    pem = x509.load_pem_x509_certificate((own / "cert.pem").read_bytes())
    assert pem == _der(own / "cert.der")
    key = serialization.load_pem_private_key((own / "key.pem").read_bytes(), password=None)
    assert key.key_size == 2048
    assert b"BEGIN PRIVATE KEY" in (own / "key.pem").read_bytes()  # PKCS#8, unencrypted
    assert key.public_key().public_numbers() == _der(own / "cert.der").public_key().public_numbers()


def test_ca_and_server_certificate_contents(base):
    ca = _der(base / "pki" / "own" / "ca.der")
    server = _der(base / "pki" / "own" / "cert.der")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert ca.public_key().key_size in (2048, 3072)
    assert isinstance(ca.signature_hash_algorithm, hashes.SHA256)
    assert timedelta(days=3640) < ca.not_valid_after_utc - NOW < timedelta(days=3660)

    server.verify_directly_issued_by(ca)
    assert isinstance(server.signature_hash_algorithm, hashes.SHA256)
    assert server.public_key().key_size == 2048
    assert timedelta(days=725) < server.not_valid_after_utc - NOW < timedelta(days=735)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [URI]
    assert set(san.get_values_for_type(x509.DNSName)) == {HOST, "plant-box.local", "localhost"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    ku = server.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.content_commitment and ku.key_encipherment and ku.data_encipherment
    assert not ku.key_cert_sign
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert server.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "OPC UA Inference Appliance"
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == HOST


def test_empty_crl_created_and_signed_by_the_ca(base):
    ca = _der(base / "pki" / "own" / "ca.der")
    crl = x509.load_der_x509_crl((base / "pki" / "crl" / "appliance-ca.crl.der").read_bytes())
    assert crl.is_signature_valid(ca.public_key())
    assert crl.issuer == ca.subject and len(crl) == 0
    assert crl.next_update_utc - NOW > timedelta(days=360)


def test_server_chain_and_expiry(base):
    pki = PKI(base)
    chain = pki.server_chain_der()
    own, ca = pki.layout.own_cert_der.read_bytes(), pki.layout.ca_cert_der.read_bytes()
    assert chain == own + ca
    assert pki.server_cert_not_after() == _der(pki.layout.own_cert_der).not_valid_after_utc
    # the chain the server presents passes our own validation (as a peer would check it)
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(chain, URI).ok


def test_init_refuses_an_existing_pki_and_force_keeps_the_ca(pki):
    ca_before = pki.layout.ca_cert_der.read_bytes()
    server_before = pki.layout.own_cert_der.read_bytes()
    with pytest.raises(PKIError, match="--force"):
        pki.init(URI, [HOST], [])
    assert pki.layout.own_cert_der.read_bytes() == server_before
    pki.init("urn:renamed:appliance", [HOST], [], force=True)
    assert pki.layout.ca_cert_der.read_bytes() == ca_before  # PLCs trusting the CA keep working
    assert pki.layout.own_cert_der.read_bytes() != server_before
    # a client issued before still validates
    tl = TrustList(pki.layout.pki_dir)
    plc1 = (pki.state_dir / "clients" / "plc1.der").read_bytes()
    assert tl.validate_application_certificate(plc1, _client_uri("plc1")).ok
    pki.init(URI, [HOST], [], force=True, new_ca=True)
    assert pki.layout.ca_cert_der.read_bytes() != ca_before
    assert pki.layout.ca_trusted_der.read_bytes() == pki.layout.ca_cert_der.read_bytes()


def test_init_rejects_bad_identity(tmp_path):
    pki = PKI(tmp_path)
    with pytest.raises(PKIError, match="ApplicationUri"):
        pki.init("not a uri", [HOST], [])
    with pytest.raises(PKIError, match="IP address"):
        pki.init(URI, [HOST], ["10.0.0.300"])
    with pytest.raises(PKIError, match="host name"):
        pki.init(URI, ["bad host"], [])
    assert not pki.exists()


def test_ensure_creates_once_then_renews_only_on_a_uri_change(tmp_path):
    pki = PKI(tmp_path)
    assert pki.ensure(URI, [HOST], []) is True
    first = pki.layout.own_cert_der.read_bytes()
    ca = pki.layout.ca_cert_der.read_bytes()
    assert pki.ensure(URI, [HOST], []) is False
    assert pki.layout.own_cert_der.read_bytes() == first
    assert pki.ensure("urn:other:appliance", [HOST], []) is True
    renewed = _der(pki.layout.own_cert_der)
    assert URI not in renewed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier)
    assert pki.layout.ca_cert_der.read_bytes() == ca


def test_ensure_renews_an_expired_server_certificate_and_a_stale_crl(pki):
    later = NOW + timedelta(days=740)
    old_server, old_crl = pki.layout.own_cert_der.read_bytes(), pki.layout.ca_crl_der.read_bytes()
    assert PKI(pki.state_dir, clock=lambda: later).ensure(URI, [HOST, "plant-box.local"], ["10.0.0.5"]) is True
    assert pki.layout.own_cert_der.read_bytes() != old_server
    assert _der(pki.layout.own_cert_der).not_valid_after_utc > later
    crl = x509.load_der_x509_crl(pki.layout.ca_crl_der.read_bytes())
    assert pki.layout.ca_crl_der.read_bytes() != old_crl and crl.next_update_utc > later + timedelta(days=300)


def test_ensure_serves_without_the_ca_key(pki):
    """Plants may keep the CA key offline: the server still starts with its certificate."""
    pki.layout.ca_key_pem.unlink()
    assert pki.ensure(URI, [HOST], []) is False
    with pytest.raises(PKIError, match="ca.key.pem"):
        pki.issue("late", "monitor", pki.state_dir / "c", HOST)


# -- issuing ----------------------------------------------------------------------------------------------------
def test_issue_writes_every_file_and_maps_the_role(base):
    pki = PKI(base)
    out = base / "clients"
    for suffix in (".der", ".pem", ".key.pem", ".p12", ".ca.der"):
        assert (out / f"plc1{suffix}").is_file(), suffix
    assert _mode(out / "plc1.key.pem") == 0o600 and _mode(out / "plc1.p12") == 0o600
    cert = _der(out / "plc1.der")
    ca = _der(pki.layout.ca_cert_der)
    cert.verify_directly_issued_by(ca)
    assert (out / "plc1.ca.der").read_bytes() == pki.layout.ca_cert_der.read_bytes()
    assert x509.load_pem_x509_certificate((out / "plc1.pem").read_bytes()) == cert
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [_client_uri("plc1")]
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.content_commitment and ku.key_encipherment and ku.data_encipherment
    assert ExtendedKeyUsageOID.CLIENT_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    key = serialization.load_pem_private_key((out / "plc1.key.pem").read_bytes(), password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    p12 = pkcs12.load_pkcs12((out / "plc1.p12").read_bytes(), None)
    assert p12.cert.certificate == cert
    assert [c.certificate for c in p12.additional_certs] == [ca]
    assert (base / "pki" / "trusted" / "plc1.der").read_bytes() == (out / "plc1.der").read_bytes()
    assert pki.role_for_certificate((out / "plc1.der").read_bytes()) == "operator"
    assert pki.role_for_certificate((out / "eng.der").read_bytes()) == "engineer"
    assert pki.role_for_certificate(pki.layout.own_cert_der.read_bytes()) is None
    assert pki.role_for_certificate(b"garbage") is None


def test_issue_with_password_encrypts_key_and_p12(base):
    out = base / "clients"
    key_pem = (out / "eng.key.pem").read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in key_pem
    with pytest.raises(TypeError):
        serialization.load_pem_private_key(key_pem, password=None)
    serialization.load_pem_private_key(key_pem, password=b"s3cret-pass")
    with pytest.raises(ValueError):
        pkcs12.load_pkcs12((out / "eng.p12").read_bytes(), None)
    with pytest.raises(ValueError):
        pkcs12.load_pkcs12((out / "eng.p12").read_bytes(), b"wrong")
    p12 = pkcs12.load_pkcs12((out / "eng.p12").read_bytes(), b"s3cret-pass")
    assert p12.cert.certificate == _der(out / "eng.der")


def test_issue_refuses_bad_role_name_and_duplicates(pki):
    with pytest.raises(PKIError, match="monitor, operator, engineer"):
        pki.issue("x", "admin", pki.state_dir / "c", HOST)
    for name in ("../evil", "a/b", "", "appliance-ca", "x" * 65):
        with pytest.raises(PKIError, match="bad certificate name"):
            pki.issue(name, "monitor", pki.state_dir / "c", HOST)
    with pytest.raises(PKIError, match="already issued"):
        pki.issue("plc1", "monitor", pki.state_dir / "c", HOST)
    with pytest.raises(PKIError, match="password"):
        pki.issue("y", "monitor", pki.state_dir / "c", HOST, password="")
    assert not (pki.state_dir / "c").exists()


# -- validation: each OPC UA code ------------------------------------------------------------------------------
def test_issued_certificate_is_good_and_uri_is_compared(base):
    tl = TrustList(base / "pki")
    der = (base / "clients" / "plc1.der").read_bytes()
    good = tl.validate_application_certificate(der, _client_uri("plc1"))
    assert (good.ok, good.status) == (True, "Good")
    assert good.thumbprint == hashlib.sha1(der).hexdigest()
    assert tl.validate_user_certificate(der).ok
    assert tl.validate_application_certificate(der, None).ok
    bad = tl.validate_application_certificate(der, _client_uri("other"))
    assert (bad.ok, bad.status) == (False, "BadCertificateUriInvalid")


@pytest.mark.parametrize("blob", [b"", b"\x30\x03abc", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                                  b"\x30\x82\xff\xff" + b"\x00" * 10, "not bytes"])
def test_unparseable_is_invalid(base, blob):
    result = TrustList(base / "pki").validate_application_certificate(blob, None)
    assert (result.ok, result.status) == (False, "BadCertificateInvalid")


def test_untrusted_is_copied_to_rejected_and_moving_it_makes_it_pass(pki, key):
    tl = TrustList(pki.layout.pki_dir)
    rogue = make_test_certificate("rogue-hmi", key=key)
    result = tl.validate_application_certificate(rogue.cert_der, "urn:test:client")
    assert result.status == "BadCertificateUntrusted"
    rejected = list(pki.layout.rejected.iterdir())
    assert [p.read_bytes() for p in rejected] == [rogue.cert_der]
    assert result.thumbprint in rejected[0].name
    # the engineer trusts it by moving the file; the SAME TrustList sees it
    rejected[0].rename(pki.layout.trusted / rejected[0].name)
    assert tl.validate_application_certificate(rogue.cert_der, "urn:test:client").ok
    # and moving it back makes it untrusted again
    (pki.layout.trusted / rejected[0].name).rename(rejected[0])
    assert tl.validate_application_certificate(rogue.cert_der, "urn:test:client").status == "BadCertificateUntrusted"


def test_forged_issuer_name_is_untrusted(pki, key):
    """A certificate naming the appliance CA as issuer but signed by another key."""
    ca = _der(pki.layout.ca_cert_der)
    forged = make_test_certificate("forged", key=key, issuer_name=ca.subject)
    tl = TrustList(pki.layout.pki_dir)
    assert tl.validate_application_certificate(forged.cert_der, None).status == "BadCertificateUntrusted"


def test_leaf_cannot_act_as_ca(pki, key):
    """An issued client (CA:FALSE) signing a certificate does not make it trusted."""
    out = pki.state_dir / "clients"
    plc1 = (_der(out / "plc1.der"), serialization.load_pem_private_key((out / "plc1.key.pem").read_bytes(), None))
    child = make_test_certificate("child", key=key, issuer=plc1)
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(child.cert_der, None).status == \
        "BadCertificateUntrusted"


@pytest.mark.parametrize("before,after", [(-400, -1), (1, 400)], ids=["expired", "not-yet-valid"])
def test_time_invalid(pki, key, before, after):
    cert = make_test_certificate("clock", key=key, not_before=NOW + timedelta(days=before),
                                 not_after=NOW + timedelta(days=after))
    _trust_file(pki, cert.cert_der, "clock")
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(cert.cert_der, None).status == \
        "BadCertificateTimeInvalid"


def test_injected_clock_expires_issued_certificate(base):
    der = (base / "clients" / "plc1.der").read_bytes()
    later = TrustList(base / "pki", clock=lambda: NOW + timedelta(days=800))
    assert later.validate_application_certificate(der, None).status == "BadCertificateTimeInvalid"
    much_later = TrustList(base / "pki", clock=NOW + timedelta(days=4000))  # the CA has expired too
    assert much_later.validate_application_certificate(der, None).status == "BadCertificateTimeInvalid"


def test_weak_key_and_sha1_fail_the_policy_even_when_trusted(pki):
    weak = make_test_certificate("weak", key_bits=1024)
    _trust_file(pki, weak.cert_der, "weak")
    tl = TrustList(pki.layout.pki_dir)
    assert tl.validate_application_certificate(weak.cert_der, None).status == "BadCertificatePolicyCheckFailed"
    untrusted_weak = make_test_certificate("weak2", key=weak.key)
    assert tl.validate_application_certificate(untrusted_weak.cert_der, None).status == \
        "BadCertificatePolicyCheckFailed"
    assert list(pki.layout.rejected.iterdir()) == []  # trusting it would not help: not filed


def test_sha1_signature_fails_the_policy(pki, key):
    sha1 = make_test_certificate("sha1", key=key, hash_algorithm=hashes.SHA1())
    # a genuine SHA-1 signature (cryptography itself no longer makes or checks these)
    cert = sha1.cert
    key.public_key().verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), hashes.SHA1())
    _trust_file(pki, sha1.cert_der, "sha1")
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(sha1.cert_der, None).status == \
        "BadCertificatePolicyCheckFailed"


def _usage(digital_signature=True, encipherment=True) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False,
                         key_encipherment=encipherment, data_encipherment=False, key_agreement=False,
                         key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False)


@pytest.mark.parametrize("kwargs,app_status,user_status", [
    (dict(key_usage=None), "BadCertificateUseNotAllowed", "BadCertificateUseNotAllowed"),
    (dict(key_usage="no-signature"), "BadCertificateUseNotAllowed", "BadCertificateUseNotAllowed"),
    (dict(key_usage="signature-only"), "BadCertificateUseNotAllowed", "Good"),
    (dict(extended_key_usage=[ExtendedKeyUsageOID.SERVER_AUTH]), "BadCertificateUseNotAllowed",
     "BadCertificateUseNotAllowed"),
    (dict(extended_key_usage=None), "Good", "Good"),
])
def test_key_usage(pki, key, kwargs, app_status, user_status):
    if kwargs.get("key_usage") == "no-signature":
        kwargs = dict(key_usage=_usage(digital_signature=False))
    elif kwargs.get("key_usage") == "signature-only":
        kwargs = dict(key_usage=_usage(encipherment=False))
    cert = make_test_certificate("usage", key=key, **kwargs)
    _trust_file(pki, cert.cert_der, "usage")
    tl = TrustList(pki.layout.pki_dir)
    assert tl.validate_application_certificate(cert.cert_der, "urn:test:client").status == app_status
    assert tl.validate_user_certificate(cert.cert_der).status == user_status


def test_certificate_without_uri_is_uri_invalid(pki, key):
    cert = make_test_certificate("nouri", key=key, application_uri=None)
    _trust_file(pki, cert.cert_der, "nouri")
    tl = TrustList(pki.layout.pki_dir)
    assert tl.validate_application_certificate(cert.cert_der, "urn:x").status == "BadCertificateUriInvalid"
    assert tl.validate_user_certificate(cert.cert_der).ok


# -- chains -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plant_ca(ca_key, ca2_key, key):
    """A plant root (path length 1) -> intermediate -> leaf."""
    root = make_test_certificate("Plant Root", key=ca_key, is_ca=True, path_length=1, application_uri=None)
    inter = make_test_certificate("Plant Issuing", key=ca2_key, issuer=root, is_ca=True, path_length=0,
                                  application_uri=None)
    leaf = make_test_certificate("hmi-7", key=key, issuer=inter, application_uri="urn:hmi-7")
    return root, inter, leaf


def test_chain_through_an_intermediate_in_issuers(pki, plant_ca):
    root, inter, leaf = plant_ca
    tl = TrustList(pki.layout.pki_dir)
    _trust_file(pki, root.cert_der, "plant-root")
    assert tl.validate_application_certificate(leaf.cert_der, "urn:hmi-7").status == "BadCertificateUntrusted"
    _trust_file(pki, inter.cert_der, "plant-issuing", folder="issuers")
    _empty_crls(pki, root, inter)
    assert tl.validate_application_certificate(leaf.cert_der, "urn:hmi-7").ok
    # an intermediate in issuers/ is not itself a trust anchor
    (pki.layout.trusted / "plant-root.der").unlink()
    assert tl.validate_application_certificate(leaf.cert_der, "urn:hmi-7").status == "BadCertificateUntrusted"


def test_chain_sent_by_the_peer_supplies_the_intermediate(pki, plant_ca):
    root, inter, leaf = plant_ca
    _trust_file(pki, root.cert_der, "plant-root")
    _empty_crls(pki, root, inter)
    tl = TrustList(pki.layout.pki_dir)
    result = tl.validate_application_certificate(leaf.cert_der + inter.cert_der, "urn:hmi-7")
    assert result.ok and result.thumbprint == hashlib.sha1(leaf.cert_der).hexdigest()


def test_path_length_constraint(pki, ca_key, ca2_key, key):
    root = make_test_certificate("Strict Root", key=ca_key, is_ca=True, path_length=0, application_uri=None)
    inter = make_test_certificate("Strict Issuing", key=ca2_key, issuer=root, is_ca=True, application_uri=None)
    leaf = make_test_certificate("deep", key=key, issuer=inter)
    _trust_file(pki, root.cert_der, "strict-root")
    _trust_file(pki, inter.cert_der, "strict-issuing", folder="issuers")
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(leaf.cert_der, None).status == \
        "BadCertificateUntrusted"


def test_cross_signed_loop_terminates_untrusted(pki, ca_key, ca2_key, key):
    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),  # noqa: E731
                                 x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Test Plant")])
    dummy = make_test_certificate("dummy", key=key)
    a = make_test_certificate("Loop A", key=ca_key, issuer=(dummy.cert, ca2_key), issuer_name=name("Loop B"),
                              is_ca=True, application_uri=None)
    b = make_test_certificate("Loop B", key=ca2_key, issuer=(dummy.cert, ca_key), issuer_name=name("Loop A"),
                              is_ca=True, application_uri=None)
    leaf = make_test_certificate("looped", key=key, issuer=a)
    _trust_file(pki, a.cert_der, "loop-a", folder="issuers")
    _trust_file(pki, b.cert_der, "loop-b", folder="issuers")
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(leaf.cert_der, None).status == \
        "BadCertificateUntrusted"


def test_expired_intermediate_is_issuer_time_invalid(pki, plant_ca, ca2_key, key):
    root, _, _ = plant_ca
    old = make_test_certificate("Plant Issuing", key=ca2_key, issuer=root, is_ca=True, application_uri=None,
                                not_before=NOW - timedelta(days=400), not_after=NOW - timedelta(days=1))
    leaf = make_test_certificate("hmi-8", key=key, issuer=old, not_before=NOW - timedelta(days=10))
    _trust_file(pki, root.cert_der, "plant-root")
    _trust_file(pki, old.cert_der, "old-issuing", folder="issuers")
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(leaf.cert_der, None).status == \
        "BadCertificateIssuerTimeInvalid"


# -- revocation -------------------------------------------------------------------------------------------------
def test_revoke_takes_effect_on_the_same_trust_list(pki):
    tl = TrustList(pki.layout.pki_dir)
    der = (pki.state_dir / "clients" / "plc1.der").read_bytes()
    assert tl.validate_application_certificate(der, _client_uri("plc1")).ok
    revoked = pki.revoke("plc1")
    assert revoked.on_crl and revoked.name == "plc1"
    assert tl.validate_application_certificate(der, _client_uri("plc1")).status == "BadCertificateRevoked"
    assert tl.validate_user_certificate(der).status == "BadCertificateRevoked"
    assert not (pki.layout.trusted / "plc1.der").exists()
    assert pki.role_for_certificate(der) is None
    crl = x509.load_der_x509_crl(pki.layout.ca_crl_der.read_bytes())
    assert crl.is_signature_valid(_der(pki.layout.ca_cert_der).public_key())
    assert crl.get_revoked_certificate_by_serial_number(_der(pki.state_dir / "clients" / "plc1.der").serial_number)
    assert crl.next_update_utc - NOW > timedelta(days=360)
    # copying it back into trusted/ does not undo a revocation
    (pki.layout.trusted / "plc1.der").write_bytes(der)
    assert tl.validate_application_certificate(der, _client_uri("plc1")).status == "BadCertificateRevoked"
    # others are unaffected, and the name can be issued again
    assert tl.validate_user_certificate((pki.state_dir / "clients" / "eng.der").read_bytes()).ok
    pki.issue("plc1", "monitor", pki.state_dir / "clients2", HOST)
    assert tl.validate_user_certificate((pki.state_dir / "clients2" / "plc1.der").read_bytes()).ok


def test_revoke_by_thumbprint_and_unknown(pki):
    der = (pki.state_dir / "clients" / "eng.der").read_bytes()
    thumb = hashlib.sha1(der).hexdigest()
    pki.revoke(":".join(thumb[i:i + 2] for i in range(0, 40, 2)).upper())
    assert TrustList(pki.layout.pki_dir).validate_user_certificate(der).status == "BadCertificateRevoked"
    with pytest.raises(PKIError, match="no issued or trusted certificate"):
        pki.revoke("nobody")


def test_forged_crl_is_ignored_and_leaves_revocation_unknown(pki, plant_ca, ca2_key, key):
    root, inter, leaf = plant_ca
    _trust_file(pki, root.cert_der, "plant-root")
    _trust_file(pki, inter.cert_der, "plant-issuing", folder="issuers")
    _empty_crls(pki, root)
    tl = TrustList(pki.layout.pki_dir)
    forged = make_test_crl(inter, [leaf.cert.serial_number], signing_key=key)  # not the issuer's key
    (pki.layout.crl / "plant-issuing.crl").write_bytes(forged)
    result = tl.validate_application_certificate(leaf.cert_der, None)
    assert result.status == "BadCertificateRevocationUnknown"  # not Revoked: the forged list counts for nothing
    genuine_empty = make_test_crl(inter, [])
    (pki.layout.crl / "plant-issuing-real.crl").write_bytes(genuine_empty)
    assert tl.validate_application_certificate(leaf.cert_der, None).ok
    (pki.layout.crl / "plant-issuing-real.crl").write_bytes(make_test_crl(inter, [leaf.cert.serial_number]))
    assert tl.validate_application_certificate(leaf.cert_der, None).status == "BadCertificateRevoked"


def test_a_crl_file_that_does_not_parse_is_ignored(pki, plant_ca):
    """Whatever cryptography raises for a damaged CRL (here InvalidVersion: not a ValueError) leaves that one file
    out, never every validation with it."""
    root, inter, leaf = plant_ca
    _trust_file(pki, root.cert_der, "plant-root")
    _trust_file(pki, inter.cert_der, "plant-issuing", folder="issuers")
    genuine = make_test_crl(inter, [])
    (pki.layout.crl / "plant-issuing.crl").write_bytes(genuine)
    _empty_crls(pki, root)
    at = genuine.find(b"\x02\x01\x01")  # TBSCertList's version: v2
    (pki.layout.crl / "damaged.crl").write_bytes(genuine[:at] + b"\x02\x01\x05" + genuine[at + 3:])
    assert TrustList(pki.layout.pki_dir).validate_application_certificate(leaf.cert_der, None).ok


def test_revoked_intermediate_is_issuer_revoked(pki, plant_ca):
    root, inter, leaf = plant_ca
    _trust_file(pki, root.cert_der, "plant-root")
    _trust_file(pki, inter.cert_der, "plant-issuing", folder="issuers")
    tl = TrustList(pki.layout.pki_dir)
    pem_crl = x509.load_der_x509_crl(make_test_crl(root, [inter.cert.serial_number]))
    (pki.layout.crl / "plant-root.crl.pem").write_bytes(pem_crl.public_bytes(serialization.Encoding.PEM))
    assert tl.validate_application_certificate(leaf.cert_der, None).status == "BadCertificateIssuerRevoked"
    forged = make_test_crl(root, [inter.cert.serial_number], signing_key=leaf.key)
    (pki.layout.crl / "plant-root.crl.pem").write_bytes(forged)
    assert tl.validate_application_certificate(leaf.cert_der, None).status == \
        "BadCertificateIssuerRevocationUnknown"


def test_a_ca_without_a_crl_is_revocation_unknown_unless_the_yaml_says_otherwise(pki, plant_ca):
    """Part 4: each CA of the chain needs its CRL. A GDS push that leaves a CA's CRL out does not un-revoke."""
    root, inter, leaf = plant_ca
    _trust_file(pki, root.cert_der, "plant-root")
    _trust_file(pki, inter.cert_der, "plant-issuing", folder="issuers")
    strict = TrustList(pki.layout.pki_dir)
    lax = TrustList(pki.layout.pki_dir, require_crl=False)
    result = strict.validate_application_certificate(leaf.cert_der, None)
    assert (result.status, result.reason) == ("BadCertificateIssuerRevocationUnknown",
                                              "the CA 'Plant Root' that issued 'Plant Issuing' has no CRL")
    assert lax.validate_application_certificate(leaf.cert_der, None).ok
    _empty_crls(pki, root)
    result = strict.validate_application_certificate(leaf.cert_der, None)
    assert (result.status, result.reason) == ("BadCertificateRevocationUnknown",
                                              "the issuer 'Plant Issuing' has no CRL")
    _empty_crls(pki, inter)
    assert strict.validate_application_certificate(leaf.cert_der, None).ok
    # the appliance CA's own CRL removed: its clients are revocation-unknown, not silently un-revoked
    client = (pki.state_dir / "clients" / "plc1.der").read_bytes()
    pki.layout.ca_crl_der.unlink()
    assert strict.validate_user_certificate(client).status == "BadCertificateRevocationUnknown"
    assert lax.validate_user_certificate(client).ok


def test_unexpected_failure_is_security_checks_failed(base):
    def broken_clock():
        raise RuntimeError("clock source gone")

    tl = TrustList(base / "pki", clock=broken_clock)
    result = tl.validate_application_certificate((base / "clients" / "plc1.der").read_bytes(), None)
    assert (result.ok, result.status) == (False, "BadSecurityChecksFailed")
    assert "clock source" not in result.reason


def test_rejected_folder_is_bounded(pki, key, monkeypatch):
    monkeypatch.setattr(validate_mod, "MAX_REJECTED_FILES", 3)
    tl = TrustList(pki.layout.pki_dir)
    for i in range(5):
        rogue = make_test_certificate(f"flood-{i}", key=key)
        assert tl.validate_application_certificate(rogue.cert_der, None).status == "BadCertificateUntrusted"
    assert len(list(pki.layout.rejected.iterdir())) == 3


# -- trust list upkeep ------------------------------------------------------------------------------------------
def test_trust_pem_file_and_reject_again(pki, key, tmp_path):
    rogue = make_test_certificate("scada-2", key=key)
    pem = tmp_path / "scada-2.pem"
    pem.write_bytes(rogue.cert.public_bytes(serialization.Encoding.PEM))
    tl = TrustList(pki.layout.pki_dir)
    target = pki.trust(pem)
    assert target.parent == pki.layout.trusted and target.read_bytes() == rogue.cert_der  # stored as DER
    assert tl.validate_application_certificate(rogue.cert_der, "urn:test:client").ok
    moved = pki.reject("scada-2")
    assert moved.parent == pki.layout.rejected and not target.exists()
    assert tl.validate_application_certificate(rogue.cert_der, "urn:test:client").status == "BadCertificateUntrusted"
    # trusting the rejected copy by its file name moves it out of rejected/
    pki.trust(Path(moved.name))
    assert list(pki.layout.rejected.iterdir()) == []
    assert tl.validate_application_certificate(rogue.cert_der, "urn:test:client").ok


def test_trust_refuses_non_certificates_and_reject_refuses_the_ca(pki, tmp_path):
    junk = tmp_path / "junk.der"
    junk.write_bytes(b"\x00\x01 not a cert")
    with pytest.raises(PKIError, match="junk.der"):
        pki.trust(junk)
    with pytest.raises(PKIError, match="no such file"):
        pki.trust(tmp_path / "missing.der")
    with pytest.raises(PKIError, match="appliance CA"):
        pki.reject("appliance-ca")
    with pytest.raises(PKIError, match="no trusted certificate"):
        pki.reject("nothing-here")


def test_list_shows_roles_revocations_and_rejected(pki, key):
    stranger = make_test_certificate("stranger", key=key).cert_der
    TrustList(pki.layout.pki_dir).validate_application_certificate(stranger, None)
    revoked_der = (pki.state_dir / "clients" / "plc1.der").read_bytes()
    pki.revoke("plc1")
    (pki.layout.trusted / "plc1-again.der").write_bytes(revoked_der)
    (pki.layout.trusted / "broken.der").write_bytes(b"nope")
    entries = {e.file: e for e in pki.list()}
    assert entries["appliance-ca.der"].is_ca and entries["appliance-ca.der"].location == "trusted"
    assert entries["eng.der"].role == "engineer" and entries["eng.der"].name == "eng"
    assert entries["plc1-again.der"].revoked and entries["plc1-again.der"].role is None
    assert not entries["eng.der"].revoked
    assert entries["broken.der"].error
    assert [e.location for e in entries.values() if "stranger" in e.subject] == ["rejected"]


def test_export_server(base, tmp_path):
    files = PKI(base).export_server(tmp_path / "export")
    assert sorted(p.name for p in files) == ["appliance-ca.crl", "appliance-ca.der", "appliance-ca.pem",
                                              "appliance-server.der", "appliance-server.pem"]
    crl = x509.load_der_x509_crl((tmp_path / "export" / "appliance-ca.crl").read_bytes())
    assert crl.is_signature_valid(_der(PKI(base).layout.ca_cert_der).public_key())
    assert (tmp_path / "export" / "appliance-server.der").read_bytes() == PKI(base).layout.own_cert_der.read_bytes()
    assert x509.load_pem_x509_certificate((tmp_path / "export" / "appliance-ca.pem").read_bytes()) == \
        _der(PKI(base).layout.ca_cert_der)
