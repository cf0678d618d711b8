"""The appliance CA's revocation list and the ledger it is rebuilt from."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from .x509io import write_atomic

CRL_VALIDITY = timedelta(days=365)


@dataclass
class RevocationLedger:
    """JSON record of every revocation: {"crl_number": n, "revoked": {serial_hex: {name, thumbprint, revoked_at}}}.

    The CRL is re-signed from it, so a damaged CRL file never loses a revocation."""

    path: Path

    def load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"crl_number": 0, "revoked": {}}
        data.setdefault("crl_number", 0)
        data.setdefault("revoked", {})
        return data

    def save(self, data: dict) -> None:
        write_atomic(self.path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o600)


def sign_crl(
    ca_cert: x509.Certificate,
    ca_key: rsa.RSAPrivateKey,
    revoked: dict[int, datetime],
    number: int,
    now: datetime,
) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + CRL_VALIDITY)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    return crl.public_bytes(serialization.Encoding.DER)
