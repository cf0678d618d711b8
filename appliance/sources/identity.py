"""What the appliance keeps per source in the state directory, under `pki/sources/<name>/`:

    client.der, client.key.pem   the appliance's application instance certificate for this source, issued by the
                                 appliance CA (never added to the appliance server's own trust list or role map)
    trusted.der                  the source server's certificate, written only by `appliance sources trust NAME`
    password                     the user name's password (mode 0600), written by `appliance sources passwd NAME`

A source whose server presents any other certificate than trusted.der is refused; nothing here is ever written by
the connection itself.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509

CLIENT_DAYS = 825


@dataclass(frozen=True)
class SourceFiles:
    folder: Path

    @classmethod
    def of(cls, state_dir: Path, source: str) -> "SourceFiles":
        return cls(Path(state_dir) / "pki" / "sources" / source)

    @property
    def client_cert(self) -> Path:
        return self.folder / "client.der"

    @property
    def client_key(self) -> Path:
        return self.folder / "client.key.pem"

    @property
    def trusted(self) -> Path:
        return self.folder / "trusted.der"

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    def password(self) -> str:
        try:
            return self.password_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""

    def set_password(self, password: str) -> None:
        from certs.x509io import write_atomic
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.password_file, password.encode("utf-8"), 0o600)

    def trust(self, der: bytes) -> None:
        from certs.x509io import write_atomic
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.trusted, der, 0o644)

    def trusted_der(self) -> bytes | None:
        try:
            return self.trusted.read_bytes()
        except FileNotFoundError:
            return None

    def ensure_client_certificate(self, state_dir: Path, source: str, hostname: str | None = None) -> bool:
        """Issue the client certificate for this source from the appliance CA when there is none; True if made."""
        if self.client_cert.exists() and self.client_key.exists():
            return False
        from certs import builder
        from certs.pki import PKI
        from certs.x509io import to_der, write_atomic
        host = hostname or socket.gethostname()
        ca_cert, ca_key = PKI(Path(state_dir)).load_ca()
        key = builder.new_rsa_key(builder.SERVER_KEY_BITS)
        cert = builder.build_client_cert(key, ca_cert, ca_key, f"appliance-source-{source}",
                                         f"urn:{host}:appliance:source-client:{source}", CLIENT_DAYS,
                                         datetime.now(timezone.utc))
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        write_atomic(self.client_key, builder.private_key_pem(key), 0o600)
        write_atomic(self.client_cert, to_der(cert), 0o644)
        return True


def describe_certificate(der: bytes) -> dict:
    """Subject, thumbprint, validity and ApplicationUri of a certificate (the first of a DER chain)."""
    from certs.x509io import san_uris, split_der_chain, thumbprint
    leaf = split_der_chain(der)[0]
    cert = x509.load_der_x509_certificate(leaf)
    return {"subject": cert.subject.rfc4514_string(), "thumbprint": thumbprint(leaf),
            "not_before": cert.not_valid_before_utc.isoformat(), "not_after": cert.not_valid_after_utc.isoformat(),
            "application_uri": (san_uris(cert) or [""])[0], "issuer": cert.issuer.rfc4514_string()}


def leaf_of(der: bytes) -> bytes:
    from certs.x509io import split_der_chain
    return split_der_chain(der)[0]
