"""A snapshot of the trust store folders (trusted, issuers, crl), reloaded whenever a file in them changes."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm

from .layout import PkiLayout
from .x509io import CertificateFormatError, parse_crl, read_certificate_file, thumbprint

log = logging.getLogger("appliance.certs")

CRL_GOOD, CRL_REVOKED, CRL_UNKNOWN, CRL_NONE = "good", "revoked", "unknown", "none"


@dataclass
class StoredCert:
    der: bytes
    cert: x509.Certificate
    path: Path
    thumbprint: str = ""

    def __post_init__(self) -> None:
        self.thumbprint = thumbprint(self.der)


@dataclass
class StoredCrl:
    crl: x509.CertificateRevocationList
    path: Path


@dataclass
class StoreSnapshot:
    trusted: list[StoredCert] = field(default_factory=list)
    issuers: list[StoredCert] = field(default_factory=list)
    crls: list[StoredCrl] = field(default_factory=list)
    _crl_checks: dict[tuple[int, str], bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.trusted_thumbprints = {c.thumbprint for c in self.trusted}
        self.stored_thumbprints = self.trusted_thumbprints | {c.thumbprint for c in self.issuers}
        # candidate issuers by subject, trust anchors first
        self.by_subject: dict[bytes, list[StoredCert]] = {}
        for stored in self.trusted + self.issuers:
            self.by_subject.setdefault(stored.cert.subject.public_bytes(), []).append(stored)

    def stores(self, cert: StoredCert) -> bool:
        """The certificate is in trusted/ or issuers/ (not only in a chain a peer sent)."""
        return cert.thumbprint in self.stored_thumbprints

    def cas_without_crl(self) -> list[StoredCert]:
        """The CA certificates of trusted/ and issuers/ that no CRL in crl/ is issued by (by name; a CRL that
        does not verify is refused when used)."""
        crl_issuers = {c.crl.issuer.public_bytes() for c in self.crls}
        return [c for c in self.trusted + self.issuers
                if is_ca(c.cert) and c.cert.subject.public_bytes() not in crl_issuers]

    def candidates_for(self, cert: x509.Certificate) -> list[StoredCert]:
        return self.by_subject.get(cert.issuer.public_bytes(), [])

    def crl_status(self, cert: x509.Certificate, issuer: StoredCert) -> str:
        """Revocation status of `cert` according to the CRLs of `issuer` whose signatures verify."""
        mine = [c for c in self.crls if c.crl.issuer == issuer.cert.subject]
        if not mine:
            return CRL_NONE
        valid = [c for c in mine if self._verified(c, issuer)]
        for entry in valid:
            if entry.crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None:
                return CRL_REVOKED
        return CRL_GOOD if valid else CRL_UNKNOWN

    def _verified(self, entry: StoredCrl, issuer: StoredCert) -> bool:
        key = (id(entry), issuer.thumbprint)
        if key not in self._crl_checks:
            try:
                ok = entry.crl.is_signature_valid(issuer.cert.public_key())
            except (TypeError, ValueError, UnsupportedAlgorithm):  # unsupported key or algorithm: not verifiable
                ok = False
            if not ok:
                log.warning("CRL %s does not verify with the key of %s: ignored", entry.path.name,
                            issuer.cert.subject.rfc4514_string())
            self._crl_checks[key] = ok
        return self._crl_checks[key]


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (x509.ExtensionNotFound, ValueError):
        return False


def _files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    except FileNotFoundError:
        return []


def _load_certs(folder: Path) -> list[StoredCert]:
    out: list[StoredCert] = []
    for path in _files(folder):
        try:
            out += [StoredCert(der, cert, path) for der, cert in read_certificate_file(path)]
        except (OSError, CertificateFormatError) as exc:
            log.warning("ignoring %s: not a certificate (%s)", path, exc)
    return out


def _load_crls(folder: Path) -> list[StoredCrl]:
    out: list[StoredCrl] = []
    for path in _files(folder):
        try:
            out.append(StoredCrl(parse_crl(path.read_bytes()), path))
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: not a CRL (%s)", path, exc)
    return out


def load_snapshot(layout: PkiLayout) -> StoreSnapshot:
    return StoreSnapshot(
        trusted=_load_certs(layout.trusted), issuers=_load_certs(layout.issuers), crls=_load_crls(layout.crl)
    )


def _fingerprint(layout: PkiLayout) -> tuple:
    """Names, inodes, sizes and mtimes of every file: any trust/reject/revoke or file move changes it."""
    parts = []
    for folder in (layout.trusted, layout.issuers, layout.crl):
        try:
            with os.scandir(folder) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except FileNotFoundError:  # removed while we looked: the next call sees the change
                        continue
                    parts.append((folder.name, e.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except FileNotFoundError:
            parts.append((folder.name, None))
    return tuple(sorted(parts, key=repr))


class CachedStore:
    def __init__(self, layout: PkiLayout):
        self.layout = layout
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._snapshot = StoreSnapshot()

    def get(self) -> StoreSnapshot:
        if self._key is not None and self.layout.trust_journal.exists():
            return self._snapshot  # a trust list update is switching folders: the list as it was, whole
        key = _fingerprint(self.layout)
        with self._lock:
            if key != self._key:
                self._snapshot = load_snapshot(self.layout)
                self._key = key
            return self._snapshot
