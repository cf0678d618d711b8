"""OPC UA certificate validation (Part 4, 6.1.3) against the pki folders, which are re-read whenever they change.

asyncua's own trust store is too weak (no issuers list, CRLs checked by serial only, no rejected folder), so
the server calls this for application certificates and X509 user identities. It never raises: every failure
is a ValidationResult carrying the OPC UA status name a client receives.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from .layout import PkiLayout
from .store import CRL_NONE, CRL_REVOKED, CRL_UNKNOWN, CachedStore, StoredCert, StoreSnapshot, is_ca
from .x509io import (
    MALFORMED,
    MAX_CERT_BYTES,
    CertificateFormatError,
    common_name,
    parse_certificates,
    safe_file_stem,
    san_uris,
    write_atomic,
)

log = logging.getLogger("appliance.certs")

MAX_CHAIN = 5  # leaf + 4 issuers: bounds work on hostile chains and ends loops
MAX_REJECTED_FILES = 256  # a flood of rogue certificates must not fill the disk
MIN_RSA_BITS, MAX_RSA_BITS = 2048, 4096  # Basic256Sha256 / Aes*_Sha256 policies
WEAK_HASHES = (hashes.SHA1, hashes.MD5)
CLIENT_EKU = (ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE)

GOOD = "Good"
INVALID = "BadCertificateInvalid"
POLICY = "BadCertificatePolicyCheckFailed"
TIME = "BadCertificateTimeInvalid"
ISSUER_TIME = "BadCertificateIssuerTimeInvalid"
URI = "BadCertificateUriInvalid"
USE = "BadCertificateUseNotAllowed"
UNTRUSTED = "BadCertificateUntrusted"
REVOKED = "BadCertificateRevoked"
ISSUER_REVOKED = "BadCertificateIssuerRevoked"
REVOCATION_UNKNOWN = "BadCertificateRevocationUnknown"
ISSUER_REVOCATION_UNKNOWN = "BadCertificateIssuerRevocationUnknown"
SECURITY_CHECKS_FAILED = "BadSecurityChecksFailed"


@dataclass
class ValidationResult:
    ok: bool
    status: str  # OPC UA status name (an attribute of asyncua's ua.StatusCodes), "Good" if ok
    reason: str  # for logs and the audit trail; never a file path
    thumbprint: str  # SHA-1 of the leaf DER, lower-case hex ("" if unparseable)
    subject: str = ""


class _Refused(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TrustList:
    def __init__(
        self,
        pki_dir: Path,
        clock: Callable[[], datetime] | datetime | None = None,
        copy_rejected: bool = True,
        require_crl: bool = True,
    ):
        self.layout = PkiLayout(Path(pki_dir))
        self.require_crl = require_crl  # security.require_crl: a stored CA without a CRL is revocation-unknown
        self._store = CachedStore(self.layout)
        self._clock = clock  # None: the wall clock; tests pass a datetime or a callable
        self._copy_rejected_enabled = copy_rejected  # the CLI checks certificates without filing them

    def validate_application_certificate(self, cert_der: bytes, application_uri: str | None) -> ValidationResult:
        """A client's application instance certificate (CreateSession); application_uri is the client's
        ApplicationDescription.ApplicationUri, or None to skip that comparison."""
        return self._validate(cert_der, application_uri, application=True)

    def validate_user_certificate(self, cert_der: bytes) -> ValidationResult:
        """An X509 user identity token's certificate (ActivateSession)."""
        return self._validate(cert_der, None, application=False)

    def issuing_ca(self, cert_der: bytes) -> tuple[str | None, int]:
        """For a role mapped by subject: the thumbprint of the CA in trusted/ or issuers/ that signed this (leaf)
        certificate, or None; and how many CA certificates those folders hold."""
        snap = self._store.get()
        cas = sum(1 for c in snap.trusted + snap.issuers if is_ca(c.cert))
        try:
            leaf = _parse(cert_der)[0]
        except _Refused:
            return None, cas
        issuer = next((c for c in snap.candidates_for(leaf.cert)
                       if c.thumbprint != leaf.thumbprint and _may_issue(c.cert, 0) and _signed_by(leaf.cert, c.cert)),
                      None)
        return (issuer.thumbprint if issuer else None), cas

    # -- the steps of Part 4 Table 106, in its order ---------------------------------------------------------
    def _validate(self, cert_der: bytes, application_uri: str | None, application: bool) -> ValidationResult:
        thumb, subject = "", ""
        try:
            chain_in = _parse(cert_der)
            leaf = chain_in[0]
            thumb, subject = leaf.thumbprint, leaf.cert.subject.rfc4514_string()
            snap = self._store.get()
            chain = _build_chain(leaf, chain_in[1:], snap)
            anchor = next((i for i, c in enumerate(chain) if c.thumbprint in snap.trusted_thumbprints), None)
            # policy before signature: a SHA-1 or weak-key signature is refused as such, not as "invalid"
            _check_policy(chain[: len(chain) if anchor is None else anchor + 1])
            _check_signature(chain)
            if anchor is None:
                self._copy_to_rejected(leaf)
                raise _Refused(UNTRUSTED, "not in the trust list and not issued by a trusted CA")
            _check_time(chain[: anchor + 1], self._now())
            if application:
                _check_uri(leaf.cert, application_uri)
            _check_usage(leaf.cert, application)
            _check_revocation(chain, anchor, snap, self.require_crl)
            return ValidationResult(True, GOOD, "trusted", thumb, subject)
        except _Refused as refused:
            return ValidationResult(False, refused.status, refused.reason, thumb, subject)
        except Exception:  # noqa: BLE001 - a validator must never take the server down: refused, logged with the cause
            log.exception("certificate validation failed unexpectedly")
            return ValidationResult(False, SECURITY_CHECKS_FAILED, "internal validation error", thumb, subject)

    def _now(self) -> datetime:
        if self._clock is None:
            return datetime.now(timezone.utc)
        return self._clock if isinstance(self._clock, datetime) else self._clock()

    def _copy_to_rejected(self, leaf: StoredCert) -> None:
        """So an engineer can trust the certificate by moving the file into trusted/."""
        if not self._copy_rejected_enabled:
            return
        folder = self.layout.rejected
        target = folder / f"{safe_file_stem(common_name(leaf.cert) or 'cert', 48)}_{leaf.thumbprint}.der"
        try:
            if target.exists():
                return
            folder.mkdir(parents=True, exist_ok=True)
            old = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
            for stale in old[: max(0, len(old) - MAX_REJECTED_FILES + 1)]:
                stale.unlink(missing_ok=True)
            write_atomic(target, leaf.der, 0o644)
            log.warning("rejected untrusted certificate %s (%s), copied to pki/rejected/%s",
                        leaf.cert.subject.rfc4514_string(), leaf.thumbprint, target.name)
        except OSError as exc:
            log.warning("could not copy a rejected certificate to pki/rejected: %s", exc.strerror)


def _parse(cert_der: bytes) -> list[StoredCert]:
    if not isinstance(cert_der, (bytes, bytearray, memoryview)) or not cert_der:
        raise _Refused(INVALID, "no certificate")
    try:
        parts = parse_certificates(bytes(cert_der))
    except CertificateFormatError:
        raise _Refused(INVALID, "not a valid X.509 certificate") from None
    if len(parts) > MAX_CHAIN or len(parts[0][0]) > MAX_CERT_BYTES:
        raise _Refused(INVALID, "certificate chain too long or too large")
    out = []
    for der, cert in parts:
        try:
            cert.extensions  # malformed or duplicate extensions raise here
            cert.not_valid_after_utc
        except MALFORMED:
            raise _Refused(INVALID, "malformed certificate extensions") from None
        out.append(StoredCert(der, cert, Path("<peer>")))
    return out


def _self_signed(cert: x509.Certificate) -> bool:
    return cert.subject == cert.issuer and _signed_by(cert, cert)


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def _may_issue(issuer: x509.Certificate, intermediates_below: int) -> bool:
    """CA:TRUE, keyCertSign (when keyUsage is present) and a path length that allows this depth."""
    try:
        bc = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (x509.ExtensionNotFound, ValueError):
        return False
    if not bc.ca or (bc.path_length is not None and bc.path_length < intermediates_below):
        return False
    try:
        return issuer.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    except x509.ExtensionNotFound:
        return True


def _build_chain(leaf: StoredCert, supplied: list[StoredCert], snap: StoreSnapshot) -> list[StoredCert]:
    """Leaf first, then each issuer whose signature verifies, from the store (trust anchors preferred) or the
    chain the peer sent; stops at a self-signed root, a missing issuer, a loop or MAX_CHAIN."""
    chain = [leaf]
    seen = {leaf.thumbprint}
    while len(chain) < MAX_CHAIN and not _self_signed(chain[-1].cert):
        current = chain[-1].cert
        peers = [s for s in supplied if s.cert.subject == current.issuer]
        issuer = next(
            (
                c
                for c in snap.candidates_for(current) + peers
                if c.thumbprint not in seen and _may_issue(c.cert, len(chain) - 1) and _signed_by(current, c.cert)
            ),
            None,
        )
        if issuer is None:
            break
        chain.append(issuer)
        seen.add(issuer.thumbprint)
    return chain


def _check_signature(chain: list[StoredCert]) -> None:
    leaf = chain[0].cert
    if len(chain) == 1 and leaf.subject == leaf.issuer and not _signed_by(leaf, leaf):
        raise _Refused(INVALID, "the self-signed certificate's signature does not verify")


def _check_policy(chain: list[StoredCert]) -> None:
    for index, stored in enumerate(chain):
        cert = stored.cert
        key = cert.public_key()
        who = "certificate" if index == 0 else "issuer certificate"
        if isinstance(key, rsa.RSAPublicKey):
            if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
                raise _Refused(POLICY, f"{who} RSA key of {key.key_size} bits (allowed {MIN_RSA_BITS}-{MAX_RSA_BITS})")
        elif index == 0 or not isinstance(key, ec.EllipticCurvePublicKey):
            raise _Refused(POLICY, f"{who} key type {type(key).__name__} not allowed by the security policies")
        is_root = index > 0 and index == len(chain) - 1 and _self_signed(cert)
        if not is_root and isinstance(cert.signature_hash_algorithm, WEAK_HASHES):
            raise _Refused(POLICY, f"{who} signed with {cert.signature_hash_algorithm.name}")


def _check_time(chain: list[StoredCert], now: datetime) -> None:
    for index, stored in enumerate(chain):
        cert = stored.cert
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            when = "expired" if now > cert.not_valid_after_utc else "not yet valid"
            if index == 0:
                raise _Refused(TIME, f"certificate {when}")
            raise _Refused(ISSUER_TIME, f"issuer certificate {common_name(cert)!r} {when}")


def _check_uri(cert: x509.Certificate, application_uri: str | None) -> None:
    uris = san_uris(cert)
    if not uris:
        raise _Refused(URI, "certificate has no ApplicationUri in its SubjectAltName")
    if application_uri is not None and application_uri not in uris:
        raise _Refused(URI, "certificate's SubjectAltName URI differs from the client's ApplicationUri")


def _check_usage(cert: x509.Certificate, application: bool) -> None:
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        raise _Refused(USE, "certificate has no keyUsage") from None
    if not ku.digital_signature:
        raise _Refused(USE, "keyUsage lacks digitalSignature")
    if application and not (ku.key_encipherment or ku.data_encipherment):
        raise _Refused(USE, "keyUsage lacks keyEncipherment and dataEncipherment")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not any(oid in eku for oid in CLIENT_EKU):
        raise _Refused(USE, "extendedKeyUsage lacks clientAuth")


def _check_revocation(chain: list[StoredCert], anchor: int, snap: StoreSnapshot, require_crl: bool) -> None:
    """Each certificate up to the trust anchor against its issuer's CRLs. Revocation is checked even above a
    directly trusted leaf, so a revoked certificate copied back into trusted/ stays refused. An issuer whose CRLs
    all fail to verify is revocation-unknown; so is a CA of the trust list or the issuers list that has no CRL at
    all (Part 4, 6.1.3: each CA shall have one), unless require_crl is off: every CA between the leaf and the
    trust anchor, and a stored CA above a directly trusted certificate. A CA only the peer sent, above a directly
    trusted certificate, is not asked for one: nobody here could have given it."""
    for index in reversed(range(min(anchor + 1, len(chain) - 1))):  # from the anchor down: a revoked CA first
        cert, issuer = chain[index].cert, chain[index + 1]
        status = snap.crl_status(cert, issuer)
        if status == CRL_NONE and require_crl and (index < anchor or snap.stores(issuer)):
            if index == 0:
                raise _Refused(REVOCATION_UNKNOWN, f"the issuer {common_name(issuer.cert)!r} has no CRL")
            raise _Refused(ISSUER_REVOCATION_UNKNOWN,
                           f"the CA {common_name(issuer.cert)!r} that issued {common_name(cert)!r} has no CRL")
        if status == CRL_REVOKED:
            if index == 0:
                raise _Refused(REVOKED, "certificate revoked")
            raise _Refused(ISSUER_REVOKED, f"issuer certificate {common_name(cert)!r} revoked")
        if status == CRL_UNKNOWN:
            if index == 0:
                raise _Refused(REVOCATION_UNKNOWN, "the issuer's CRL does not verify")
            raise _Refused(ISSUER_REVOCATION_UNKNOWN, f"the CRL for issuer {common_name(cert)!r} does not verify")
