"""Odd certificates and CRLs for tests of validation and attack handling (never used at run time).

make_test_certificate builds self-signed, expired, not-yet-valid, wrong-URI, weak-key, missing-key-usage,
CA and intermediate-signed certificates; pass `key=` to reuse a key, since RSA key generation is the slow part."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.builder import APPLICATION_KEY_USAGE, CA_KEY_USAGE, new_rsa_key, private_key_pem
from certs.x509io import write_atomic

DEFAULT = object()  # "the usual value for this kind of certificate"; None means "leave the extension out"
CLIENT_EKU = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]


class MadeCertificate(NamedTuple):
    cert_der: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(self.cert_der)

    @property
    def key(self) -> rsa.RSAPrivateKey:
        return serialization.load_pem_private_key(self.key_pem, password=None)

    def write(self, folder: Path, stem: str) -> tuple[Path, Path]:
        """stem.der and stem.key.pem in folder."""
        cert_path, key_path = Path(folder) / f"{stem}.der", Path(folder) / f"{stem}.key.pem"
        write_atomic(cert_path, self.cert_der)
        write_atomic(key_path, self.key_pem, 0o600)
        return cert_path, key_path


def _as_key(key) -> rsa.RSAPrivateKey:
    return serialization.load_pem_private_key(key, password=None) if isinstance(key, bytes) else key


def make_test_certificate(
    common_name: str = "test-client",
    *,
    issuer: MadeCertificate | tuple[x509.Certificate, rsa.RSAPrivateKey] | None = None,
    key: rsa.RSAPrivateKey | bytes | None = None,
    key_bits: int = 2048,
    application_uri: str | None = "urn:test:client",
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    key_usage=DEFAULT,
    extended_key_usage=DEFAULT,
    is_ca: bool = False,
    path_length: int | None = None,
    hash_algorithm: hashes.HashAlgorithm | None = None,
    issuer_name: x509.Name | None = None,
    out_dir: Path | None = None,
) -> MadeCertificate:
    """A certificate as asked; self-signed unless `issuer` is given. issuer_name overrides the issuer field
    (for forged certificates that claim a CA they were not signed by)."""
    now = datetime.now(timezone.utc)
    private = _as_key(key) if key is not None else new_rsa_key(key_bits)
    subject = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Test Plant"),
    ])
    if issuer is None:
        signer_name, signer_key = subject, private
    elif isinstance(issuer, MadeCertificate):
        signer_name, signer_key = issuer.cert.subject, issuer.key
    else:
        signer_name, signer_key = issuer[0].subject, issuer[1]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or signer_name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - timedelta(hours=1))
        .not_valid_after(not_after or now + timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=path_length if is_ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
    )
    if key_usage is DEFAULT:
        key_usage = CA_KEY_USAGE if is_ca else APPLICATION_KEY_USAGE
    if key_usage is not None:
        builder = builder.add_extension(key_usage, critical=True)
    if extended_key_usage is DEFAULT:
        extended_key_usage = None if is_ca else CLIENT_EKU
    if extended_key_usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(extended_key_usage), critical=False)
    if application_uri is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(application_uri)]), critical=False
        )
    if isinstance(hash_algorithm, hashes.SHA1):
        cert_der = _signed_with_sha1(builder.sign(signer_key, hashes.SHA256()), signer_key)
    else:
        cert_der = builder.sign(signer_key, hash_algorithm or hashes.SHA256()).public_bytes(serialization.Encoding.DER)
    made = MadeCertificate(cert_der, private_key_pem(private))
    if out_dir is not None:
        made.write(Path(out_dir), common_name)
    return made


_SHA256_RSA = bytes.fromhex("06092a864886f70d01010b")  # OID sha256WithRSAEncryption
_SHA1_RSA = bytes.fromhex("06092a864886f70d010105")  # OID sha1WithRSAEncryption


def _tlv(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes([tag, n]) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(size)]) + size + content


def _signed_with_sha1(cert: x509.Certificate, signer_key: rsa.RSAPrivateKey) -> bytes:
    """cryptography no longer signs certificates with SHA-1, but PLC vendors' old tools still do: re-sign the
    to-be-signed part by hand, with the algorithm identifier swapped (same length, so no re-encoding)."""
    tbs = cert.tbs_certificate_bytes.replace(_SHA256_RSA, _SHA1_RSA, 1)
    signature = signer_key.sign(tbs, padding.PKCS1v15(), hashes.SHA1())
    algorithm = _tlv(0x30, _SHA1_RSA + b"\x05\x00")
    return _tlv(0x30, tbs + algorithm + _tlv(0x03, b"\x00" + signature))


def make_test_crl(
    issuer: MadeCertificate | tuple[x509.Certificate, rsa.RSAPrivateKey],
    revoked_serials: list[int],
    signing_key: rsa.RSAPrivateKey | None = None,
    next_update_days: int = 30,
) -> bytes:
    """A DER CRL in the issuer's name; signing_key other than the issuer's forges it."""
    cert, key = (issuer.cert, issuer.key) if isinstance(issuer, MadeCertificate) else issuer
    now = datetime.now(timezone.utc)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(cert.subject)
        .last_update(now - timedelta(minutes=1))
        .next_update(now + timedelta(days=next_update_days))
    )
    for serial in revoked_serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    return builder.sign(signing_key or key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)
