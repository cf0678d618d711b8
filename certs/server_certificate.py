"""Renewing the server certificate the Part 12 way: a signing request for the server's key (or a new one), a new
certificate checked before anything changes, staged under pki/own/pending/, and installed by one rename per file.

Used by the ServerConfiguration object (uaserver/server_configuration.py) and by `appliance certs csr |
install-server` when no appliance runs. Every refusal is a CertificateRefused carrying the OPC UA status name a
GDS receives and a reason for the log and the audit trail (never a path).
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12

from . import builder
from .layout import PkiLayout
from .x509io import MALFORMED, CertificateFormatError, parse_certificates, thumbprint, to_der, to_pem, write_atomic

log = logging.getLogger("appliance.certs")

PRIVATE_KEY_FORMATS = ("PEM", "PFX")
MIN_RSA_BITS, MAX_RSA_BITS = 2048, 4096  # what the offered security policies can use
MIN_NONCE_BYTES = 32  # Part 12: the caller's entropy when a new key is asked for
MAX_ISSUERS = 4
# A key made for CreateSigningRequest (RegeneratePrivateKey) waits this long for its certificate, then is deleted:
# a private key that serves nothing must not stay on the box. A GDS that needs longer asks again.
REQUESTED_KEY_MAX_AGE = timedelta(hours=24)
MAX_FORMER_REQUESTS = 16  # public-key digests of former requests kept, to say why their certificate is refused


class CertificateRefused(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class ServerIdentity:
    """What a server certificate must name: the ApplicationUri and the host names / IPs clients dial."""

    application_uri: str
    required_names: tuple[str, ...]  # DNS names or IP addresses, each must be in the SubjectAltName
    any_of: tuple[str, ...] = ()  # when no name is required (a server on 0.0.0.0): one of these (the host's names)


@dataclass
class StagedCertificate:
    cert: x509.Certificate
    issuers: list[x509.Certificate]
    new_key: bool  # a private key other than the one in use comes with it

    @property
    def thumbprint(self) -> str:
        return thumbprint(to_der(self.cert))


class ServerCertificateStore:
    """The server's certificate, key and issuer chain in pki/own, and what is staged for ApplyChanges."""

    def __init__(self, pki_dir: Path, clock=None):
        self.layout = PkiLayout(Path(pki_dir))
        self._clock = clock or (lambda: datetime.now(timezone.utc))

    # -- paths ---------------------------------------------------------------------------------------------------
    @property
    def pending_dir(self) -> Path:
        return self.layout.own / "pending"

    @property
    def chain_path(self) -> Path:
        """The issuers installed with the certificate (DER, concatenated); absent: the appliance CA issued it."""
        return self.layout.own_issuers_der

    @property
    def requested_key_path(self) -> Path:
        """A key made for a signing request with RegeneratePrivateKey, kept until its certificate arrives (at most
        REQUESTED_KEY_MAX_AGE)."""
        return self.layout.private / "requested-key.pem"

    @property
    def former_requests_path(self) -> Path:
        """Public-key digests of requested keys that were dropped, and why: no private material."""
        return self.layout.private / "former-requests.json"

    # -- the requested key's life --------------------------------------------------------------------------------
    def _requested_key(self) -> rsa.RSAPrivateKey | None:
        """The pending requested key, unless it is older than REQUESTED_KEY_MAX_AGE (then it is deleted)."""
        self.expire_requested_key()
        try:
            return serialization.load_pem_private_key(self.requested_key_path.read_bytes(), None)
        except FileNotFoundError:
            return None

    def expire_requested_key(self) -> bool:
        """Delete the requested key once it is older than REQUESTED_KEY_MAX_AGE. True if it was."""
        try:
            made = datetime.fromtimestamp(self.requested_key_path.stat().st_mtime, timezone.utc)
        except FileNotFoundError:
            return False
        if self._clock() - made <= REQUESTED_KEY_MAX_AGE:
            return False
        hours = REQUESTED_KEY_MAX_AGE.total_seconds() / 3600
        return self.drop_requested_key(f"expired {hours:g} hours after its CreateSigningRequest")

    def drop_requested_key(self, why: str) -> bool:
        """Delete the requested key, remembering its public key's digest and why (for the refusal of a certificate
        issued for it later). True if there was one."""
        try:
            key = serialization.load_pem_private_key(self.requested_key_path.read_bytes(), None)
        except FileNotFoundError:
            return False
        except (ValueError, TypeError):
            key = None  # unreadable: deleted all the same
        if key is not None:
            former = self._former_requests()
            former[_key_digest(key.public_key())] = {"why": why, "when": self._clock().isoformat(timespec="seconds")}
            kept = dict(list(former.items())[-MAX_FORMER_REQUESTS:])
            write_atomic(self.former_requests_path, json.dumps(kept, indent=1).encode(), 0o600)
        self.requested_key_path.unlink(missing_ok=True)
        log.info("deleted the key of the pending signing request: %s", why)
        return True

    def _former_requests(self) -> dict[str, dict]:
        try:
            data = json.loads(self.former_requests_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    # -- what is in use ------------------------------------------------------------------------------------------
    def certificate(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(self.layout.own_cert_der.read_bytes())

    def private_key(self) -> rsa.RSAPrivateKey:
        return serialization.load_pem_private_key(self.layout.own_key_pem.read_bytes(), password=None)

    def issuers(self) -> list[x509.Certificate]:
        """The chain the server presents after its certificate: the installed issuers, else the appliance CA."""
        try:
            return [c for _, c in parse_certificates(self.chain_path.read_bytes())]
        except FileNotFoundError:
            pass
        except CertificateFormatError:
            log.warning("pki/own/issuers.der is unreadable: presenting the appliance CA instead")
        try:
            return [x509.load_der_x509_certificate(self.layout.ca_cert_der.read_bytes())]
        except (OSError, ValueError):
            return []

    # -- CreateSigningRequest ------------------------------------------------------------------------------------
    def signing_request(self, subject_name: str = "", regenerate_key: bool = False, nonce: bytes = b"") -> bytes:
        """A PKCS#10 request (DER) naming the current certificate's SubjectAltName, for the server's key or, with
        regenerate_key, a new one kept in pki/private until UpdateCertificate installs its certificate."""
        current = self.certificate()
        if subject_name:
            try:
                subject = x509.Name.from_rfc4514_string(_as_rfc4514(subject_name))
            except ValueError:
                raise CertificateRefused("BadInvalidArgument", "the SubjectName is not a distinguished name") from None
        else:
            subject = current.subject
        if regenerate_key:
            if len(nonce or b"") < MIN_NONCE_BYTES:
                raise CertificateRefused("BadInvalidArgument",
                                         f"a new key needs a Nonce of at least {MIN_NONCE_BYTES} bytes")
            key = builder.new_rsa_key(builder.SERVER_KEY_BITS)
            self.drop_requested_key("superseded by a later CreateSigningRequest with a new key")
            self.layout.private.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(self.requested_key_path, builder.private_key_pem(key), 0o600)
        else:
            key = self.private_key()
        request = x509.CertificateSigningRequestBuilder().subject_name(subject)
        try:
            san = current.extensions.get_extension_for_class(x509.SubjectAlternativeName)
            request = request.add_extension(san.value, critical=False)
        except x509.ExtensionNotFound:
            pass
        request = request.add_extension(builder.APPLICATION_KEY_USAGE, critical=True)
        return request.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)

    # -- UpdateCertificate ---------------------------------------------------------------------------------------
    def stage(self, identity: ServerIdentity, cert_der: bytes, issuer_ders: list[bytes], key_format: str = "",
              key_data: bytes = b"") -> StagedCertificate:
        """Check a new server certificate and stage it for ApplyChanges; nothing in use changes. The key is the one
        given, else the key of the last signing request with a new key, else the key in use."""
        cert = _one_certificate(cert_der)
        issuers = [_one_certificate(d, issuer=True) for d in issuer_ders]
        if len(issuers) > MAX_ISSUERS:
            raise CertificateRefused("BadInvalidArgument", f"more than {MAX_ISSUERS} issuer certificates")
        key, new_key = self._key_for(cert, key_format, key_data)
        now = self._clock()
        _check_key(cert)
        _check_time(cert, now, "the certificate")
        _check_names(cert, identity)
        _check_chain(cert, issuers, now, self._anchors())
        staged = StagedCertificate(cert, issuers, new_key)
        self.discard(requested_key_too=False)
        folder = self.pending_dir
        write_atomic(folder / "key.pem", builder.private_key_pem(key), 0o600)
        write_atomic(folder / "issuers.der", b"".join(to_der(c) for c in issuers), 0o644)
        write_atomic(folder / "cert.der", to_der(cert), 0o644)  # last: its presence means complete
        return staged

    def _key_for(self, cert: x509.Certificate, key_format: str, key_data: bytes):
        public = cert.public_key()
        if not isinstance(public, rsa.RSAPublicKey):
            raise CertificateRefused("BadCertificatePolicyCheckFailed", "the certificate's key is not RSA")
        if key_data:
            key = _load_private_key(key_format, key_data)
            if key.public_key().public_numbers() != public.public_numbers():
                raise CertificateRefused("BadCertificateInvalid", "the private key does not belong to the certificate")
            return key, True
        if key_format:
            raise CertificateRefused("BadInvalidArgument", "a PrivateKeyFormat without a PrivateKey")
        candidates = []
        requested = self._requested_key()
        if requested is not None:
            candidates.append((requested, True))
        candidates.append((self.private_key(), False))
        for key, new in candidates:
            if key.public_key().public_numbers() == public.public_numbers():
                return key, new
        former = self._former_requests().get(_key_digest(public))
        if former is not None:
            raise CertificateRefused("BadCertificateInvalid", "the certificate is for the key of an earlier signing "
                                     f"request, which was {former['why']} ({former['when']}): its key is gone; ask "
                                     "for a new CreateSigningRequest")
        raise CertificateRefused("BadCertificateInvalid",
                                 "the certificate is for another key than the server's (or the requested one)")

    def _anchors(self) -> list[x509.Certificate]:
        """Issuers a certificate may chain to without sending them: the trust list's CAs and the appliance CA."""
        out = []
        for folder in (self.layout.trusted, self.layout.issuers):
            for path in sorted(folder.glob("*")) if folder.is_dir() else []:
                try:
                    out += [c for _, c in parse_certificates(path.read_bytes())]
                except (OSError, CertificateFormatError):
                    continue
        return out

    def staged(self) -> StagedCertificate | None:
        folder = self.pending_dir
        try:
            cert = x509.load_der_x509_certificate((folder / "cert.der").read_bytes())
            chain = (folder / "issuers.der").read_bytes()
            issuers = [c for _, c in parse_certificates(chain)] if chain else []
            key = serialization.load_pem_private_key((folder / "key.pem").read_bytes(), password=None)
        except (OSError, ValueError, CertificateFormatError):
            return None
        return StagedCertificate(cert, issuers, key.public_key().public_numbers() !=
                                 self.private_key().public_key().public_numbers())

    def discard(self, requested_key_too: bool = True) -> bool:
        """CancelChanges: forget what is staged and the pending request's key. True if something was."""
        had = (self.pending_dir / "cert.der").is_file()
        shutil.rmtree(self.pending_dir, ignore_errors=True)
        if requested_key_too:
            had = self.drop_requested_key("cancelled by CancelChanges") or had
        return had

    # -- ApplyChanges --------------------------------------------------------------------------------------------
    def install_staged(self) -> StagedCertificate | None:
        """Move the staged certificate, key and chain into pki/own (each file by rename). None if nothing is staged."""
        staged = self.staged()
        if staged is None:
            return None
        folder, own = self.pending_dir, self.layout
        key_pem = (folder / "key.pem").read_bytes()
        write_atomic(own.own_key_pem, key_pem, 0o600)
        if staged.issuers:
            write_atomic(self.chain_path, b"".join(to_der(c) for c in staged.issuers), 0o644)
        else:
            self.chain_path.unlink(missing_ok=True)
        write_atomic(own.own_cert_pem, to_pem(staged.cert), 0o644)
        write_atomic(own.own_cert_der, to_der(staged.cert), 0o644)
        shutil.rmtree(folder, ignore_errors=True)
        if self.requested_key_path.exists():
            # whatever was installed, the pending request is over: its key went in, or it will never be used
            in_use = serialization.load_pem_private_key(key_pem, None).public_key().public_numbers()
            requested = self._requested_key()
            if requested is not None and requested.public_key().public_numbers() == in_use:
                self.requested_key_path.unlink(missing_ok=True)
            else:
                self.drop_requested_key("superseded by ApplyChanges of another certificate")
        log.info("installed the server certificate %s (%s)", staged.cert.subject.rfc4514_string(), staged.thumbprint)
        return staged


    def finish_interrupted_install(self) -> bool:
        """At start: an install stopped half-way (the key moved, the certificate not yet) is completed from the staged
        files, which stay until the install ends. True if one was."""
        try:
            matches = self.private_key().public_key().public_numbers() == \
                self.certificate().public_key().public_numbers()
        except (OSError, ValueError, TypeError):
            matches = False
        if matches or self.staged() is None:
            return False
        log.warning("finishing the installation of the staged server certificate that was interrupted")
        return self.install_staged() is not None


def _key_digest(public_key) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def required_names(hosts: list[str]) -> tuple[str, ...]:
    """The names a new server certificate must carry: the endpoint's host (or advertised host) and the YAML's
    dns_names / ip_addresses; unspecified addresses (0.0.0.0) name nothing."""
    out = []
    for host in hosts:
        if not host:
            continue
        try:
            ip = ipaddress.ip_address(host)
            if ip.is_unspecified:
                continue
            host = str(ip)
        except ValueError:
            host = host.lower()
        if host not in out:
            out.append(host)
    return tuple(out)


def _as_rfc4514(name: str) -> str:
    """'/CN=a/O=b' (OpenSSL's way, which some GDS send) or 'CN=a, O=b' -> RFC 4514."""
    name = name.strip()
    if name.startswith("/"):
        return ",".join(reversed([p for p in name.split("/") if p]))
    return name


def _one_certificate(der: bytes, issuer: bool = False) -> x509.Certificate:
    what = "an issuer certificate" if issuer else "the certificate"
    if not isinstance(der, (bytes, bytearray)) or not der:
        raise CertificateRefused("BadCertificateInvalid", f"{what} is empty")
    try:
        parts = parse_certificates(bytes(der))
        cert = parts[0][1]
        cert.extensions  # parsed lazily: malformed extensions raise here
    except (CertificateFormatError, *MALFORMED):
        raise CertificateRefused("BadCertificateInvalid", f"{what} is not a DER X.509 certificate") from None
    if len(parts) != 1:
        raise CertificateRefused("BadCertificateInvalid", f"{what} holds more than one certificate")
    return cert


def _load_private_key(key_format: str, data: bytes) -> rsa.RSAPrivateKey:
    if key_format not in PRIVATE_KEY_FORMATS:
        raise CertificateRefused("BadNotSupported", f"private key format {key_format[:16]!r} (PEM or PFX)")
    try:
        if key_format == "PEM":
            key = serialization.load_pem_private_key(bytes(data), password=None)
        else:
            key = pkcs12.load_key_and_certificates(bytes(data), None)[0]
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise CertificateRefused("BadNotSupported", "the private key is unreadable (or encrypted)") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise CertificateRefused("BadNotSupported", "the private key is not an RSA key")
    return key


def _check_key(cert: x509.Certificate) -> None:
    bits = cert.public_key().key_size
    if not MIN_RSA_BITS <= bits <= MAX_RSA_BITS:
        raise CertificateRefused("BadCertificatePolicyCheckFailed",
                                 f"an RSA key of {bits} bits (the policies allow {MIN_RSA_BITS}-{MAX_RSA_BITS})")
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        ok = usage.digital_signature and usage.key_encipherment
    except x509.ExtensionNotFound:
        ok = False
    if not ok:
        raise CertificateRefused("BadCertificateUseNotAllowed", "keyUsage lacks digitalSignature or keyEncipherment")


def _check_time(cert: x509.Certificate, now: datetime, what: str) -> None:
    if now > cert.not_valid_after_utc:
        raise CertificateRefused("BadCertificateTimeInvalid", f"{what} has expired")
    if now < cert.not_valid_before_utc:
        raise CertificateRefused("BadCertificateTimeInvalid", f"{what} is not valid yet")


def _check_names(cert: x509.Certificate, identity: ServerIdentity) -> None:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateRefused("BadCertificateUriInvalid", "the certificate has no SubjectAltName") from None
    if identity.application_uri not in san.get_values_for_type(x509.UniformResourceIdentifier):
        raise CertificateRefused("BadCertificateUriInvalid", "the certificate does not carry the ApplicationUri")
    names = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    names |= {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    missing = [n for n in identity.required_names if n not in names]
    if not identity.required_names and identity.any_of and not names & {n.lower() for n in identity.any_of}:
        missing = [" or ".join(identity.any_of)]
    if missing:
        raise CertificateRefused("BadCertificateHostNameInvalid",
                                 f"the certificate lacks {', '.join(missing)} in its SubjectAltName")


def _check_chain(cert: x509.Certificate, issuers: list[x509.Certificate], now: datetime,
                 anchors: list[x509.Certificate]) -> None:
    """The certificate is signed by its first issuer (or, when none is sent, by a CA the server knows, or itself);
    each issuer by the next; every issuer is a CA and valid now."""
    if not issuers:
        if cert.issuer == cert.subject and _signed_by(cert, cert):
            return
        if not any(_is_ca(a) and _signed_by(cert, a) for a in anchors if a.subject == cert.issuer):
            raise CertificateRefused("BadSecurityChecksFailed",
                                     "no issuer certificate was sent and no known CA signed the certificate")
        return
    chain = [cert, *issuers]
    for child, parent in zip(chain, chain[1:]):
        if not _is_ca(parent):
            raise CertificateRefused("BadSecurityChecksFailed", "an issuer certificate is not a CA")
        if not _signed_by(child, parent):
            raise CertificateRefused("BadSecurityChecksFailed", "the issuer chain does not verify")
        _check_time(parent, now, "an issuer certificate")


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
        return True
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (x509.ExtensionNotFound, ValueError):
        return False


def issued_by_appliance_ca(layout: PkiLayout) -> bool:
    """Whether the server certificate in use was issued by the appliance CA (else a plant CA manages it)."""
    try:
        cert = x509.load_der_x509_certificate(layout.own_cert_der.read_bytes())
        ca = x509.load_der_x509_certificate(layout.ca_cert_der.read_bytes())
    except (OSError, ValueError):
        return True  # nothing to tell: treat as the appliance's own
    return _signed_by(cert, ca)
