"""Results of PKI operations, and the error they raise."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


class PKIError(Exception):
    """A PKI operation that cannot be done; the message says what and which file."""


@dataclass
class IssuedCert:
    name: str
    role: str
    thumbprint: str
    application_uri: str
    not_after: datetime
    cert_der_path: Path
    cert_pem_path: Path
    key_pem_path: Path
    p12_path: Path
    ca_der_path: Path
    ca_crl_path: Path  # the CA's CRL (DER): a client that checks revocation needs it beside the CA
    crl_next_update: datetime | None = None

    @property
    def files(self) -> list[Path]:
        return [self.cert_der_path, self.cert_pem_path, self.key_pem_path, self.p12_path, self.ca_der_path,
                self.ca_crl_path]


@dataclass
class CertEntry:
    location: str  # trusted | issuers | rejected
    file: str  # file name inside that folder
    subject: str
    thumbprint: str
    not_after: datetime | None
    role: str | None  # from access/certificates.json
    revoked: bool  # listed on a CRL (whose signature verifies) of its issuer
    is_ca: bool = False
    name: str | None = None  # the NAME it was issued under, if issued here
    error: str | None = None  # set when the file is not a readable certificate
    no_crl: bool = False  # a CA in trusted/ or issuers/ that no CRL in crl/ is issued by (security.require_crl)


@dataclass
class RevokedCert:
    name: str | None
    thumbprint: str
    serial: int | None
    on_crl: bool  # False when the certificate was not issued by the current appliance CA
    crl_path: Path | None = None  # the re-signed CRL to hand out again (when on_crl)
    crl_next_update: datetime | None = None
