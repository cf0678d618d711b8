"""Where every PKI file lives under the state directory; other modules rely on these exact paths."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CA_FILE_STEM = "appliance-ca"  # trusted/appliance-ca.der and crl/appliance-ca.crl.der


@dataclass(frozen=True)
class PkiLayout:
    pki_dir: Path

    @property
    def own(self) -> Path:
        return self.pki_dir / "own"

    @property
    def trusted(self) -> Path:
        return self.pki_dir / "trusted"

    @property
    def issuers(self) -> Path:
        return self.pki_dir / "issuers"

    @property
    def crl(self) -> Path:
        return self.pki_dir / "crl"

    @property
    def rejected(self) -> Path:
        return self.pki_dir / "rejected"

    @property
    def private(self) -> Path:
        return self.pki_dir / "private"

    # The server's own material.
    @property
    def own_cert_der(self) -> Path:
        return self.own / "cert.der"

    @property
    def own_cert_pem(self) -> Path:
        return self.own / "cert.pem"

    @property
    def own_key_pem(self) -> Path:
        return self.own / "key.pem"

    @property
    def own_issuers_der(self) -> Path:
        # The issuer chain installed with a plant CA's certificate (Part 12); absent: the appliance CA issued it.
        return self.own / "issuers.der"

    # The appliance CA: exported copies, its key, its trust anchor and its CRL.
    @property
    def ca_cert_der(self) -> Path:
        return self.own / "ca.der"

    @property
    def ca_cert_pem(self) -> Path:
        return self.own / "ca.pem"

    @property
    def ca_key_pem(self) -> Path:
        return self.private / "ca.key.pem"

    @property
    def ca_trusted_der(self) -> Path:
        return self.trusted / f"{CA_FILE_STEM}.der"

    @property
    def ca_crl_der(self) -> Path:
        return self.crl / f"{CA_FILE_STEM}.crl.der"

    @property
    def revocation_ledger(self) -> Path:
        # Every revocation ever made, so the CRL can be re-signed even if its file is damaged.
        return self.private / "revoked.json"

    @property
    def trust_journal(self) -> Path:
        # present only while a trust list update switches folders (certs/trust_list_update.py)
        return self.pki_dir / ".trust-update.json"

    def store_dirs(self) -> tuple[Path, ...]:
        return (self.own, self.trusted, self.issuers, self.crl, self.rejected, self.private)
