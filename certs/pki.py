"""The appliance's PKI: its CA, server certificate, client certificates, trust list and CRL, all under
state_dir/pki (layout in certs/layout.py), plus the certificate -> role map in state_dir/access."""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from . import builder
from .crl import RevocationLedger, sign_crl
from .identity import HOSTNAME, check_identity
from .layout import CA_FILE_STEM, PkiLayout
from .records import CertEntry, IssuedCert, PKIError, RevokedCert
from .rolemap import RoleMap, check_role
from .server_certificate import ServerCertificateStore, issued_by_appliance_ca
from .store import CRL_REVOKED, StoredCert, load_snapshot
from .trust_list_update import recover as recover_trust_list
from .x509io import (
    CertificateFormatError,
    normalize_thumbprint,
    parse_certificates,
    parse_crl,
    read_certificate_file,
    safe_file_stem,
    split_der_chain,
    thumbprint,
    to_der,
    to_pem,
    write_atomic,
)

log = logging.getLogger("appliance.certs")

CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SERVER_DAYS, CA_DAYS, CLIENT_DAYS = 730, 3650, 730
CRL_RENEW_BEFORE = timedelta(days=30)
PUBLIC, SECRET = 0o644, 0o600


class PKI:
    def __init__(self, state_dir: Path, clock: Callable[[], datetime] | None = None):
        self.state_dir = Path(state_dir)
        self.layout = PkiLayout(self.state_dir / "pki")
        self.role_map = RoleMap(self.state_dir / "access" / "certificates.json")
        self._clock = clock or (lambda: datetime.now(timezone.utc))

    # -- creation ----------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        files = self.layout
        return all(p.is_file() for p in (files.own_cert_der, files.own_key_pem, files.ca_cert_der, files.ca_key_pem))

    def init(
        self,
        application_uri: str,
        hostnames: list[str],
        ips: list[str],
        force: bool = False,
        *,
        new_ca: bool = False,
        application_name: str | None = None,
        server_days: int = SERVER_DAYS,
    ) -> None:
        """Create the CA (unless a complete one exists and new_ca is False) and the server certificate.

        force replaces the server certificate; it keeps the CA, so PLCs that trust the CA and certificates
        issued by it keep working. new_ca (with force, if a CA exists) makes a new CA as well."""
        uri, hosts, addrs = check_identity(application_uri, hostnames, ips)
        own = [p for p in (self.layout.own_cert_der, self.layout.own_key_pem) if p.exists()]
        ca_files = [p for p in (self.layout.ca_cert_der, self.layout.ca_key_pem) if p.exists()]
        if own and not force:
            raise PKIError(f"a PKI already exists ({own[0]}); use --force to replace the server certificate")
        if new_ca and ca_files and not force:
            raise PKIError(f"a CA already exists ({ca_files[0]}); use --force with --new-ca to replace it")
        if len(ca_files) == 1 and not new_ca:
            missing = ({self.layout.ca_cert_der, self.layout.ca_key_pem} - set(ca_files)).pop()
            raise PKIError(f"the appliance CA is incomplete: {missing} is missing; restore it or use --new-ca")
        self._make_dirs()
        now = self._clock()
        if new_ca or not ca_files:
            self._create_ca(hosts[0], now)
        ca_cert, ca_key = self.load_ca()
        self._create_server_cert(ca_cert, ca_key, uri, hosts, addrs, application_name or hosts[0], server_days, now)
        self.refresh_crl()

    def ensure(self, application_uri: str, hostnames: list[str], ips: list[str]) -> bool:
        """At server start: create what is missing, and renew the server certificate (same CA) when it expired
        or no longer names the configured ApplicationUri, host names or IPs. True if anything was created."""
        uri, hosts, addrs = check_identity(application_uri, hostnames, ips)
        if not (self.layout.own_cert_der.is_file() and self.layout.own_key_pem.is_file()):
            self.init(uri, hosts, addrs, force=True)
            return True
        ServerCertificateStore(self.layout.pki_dir).finish_interrupted_install()
        ServerCertificateStore(self.layout.pki_dir).expire_requested_key()
        try:
            recover_trust_list(self.layout)  # a trust list update cut short by a crash: finished or dropped
        except OSError as exc:  # the journal stays; the validator reads what is there; the next start tries again
            log.error("could not finish an interrupted trust list update: %s", exc.strerror)
        problem = self._server_cert_problem(uri, hosts, addrs)
        if problem and not issued_by_appliance_ca(self.layout):
            # Installed through Part 12 or `certs install-server`: the plant's CA manages it, never replaced here.
            log.warning("the server certificate %s; it was issued by the plant's CA: renew it there", problem)
            problem = None
        created = False
        if problem and self.layout.ca_key_pem.is_file():
            log.warning("renewing the server certificate: %s", problem)
            self.init(uri, hosts, addrs, force=True)
            created = True
        elif problem:
            log.warning("server certificate %s, and the CA key is absent so it cannot be renewed", problem)
        self.refresh_crl()
        return created

    def _server_cert_problem(self, uri: str, hosts: list[str], addrs: list[str]) -> str | None:
        try:
            cert = x509.load_der_x509_certificate(self.layout.own_cert_der.read_bytes())
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (ValueError, x509.ExtensionNotFound):
            return "is unreadable or has no SubjectAltName"
        if self._clock() > cert.not_valid_after_utc:
            return "has expired"
        if uri not in san.get_values_for_type(x509.UniformResourceIdentifier):
            return f"does not carry ApplicationUri {uri}"
        missing = set(hosts) - set(san.get_values_for_type(x509.DNSName))
        missing |= {a for a in addrs if ipaddress.ip_address(a) not in san.get_values_for_type(x509.IPAddress)}
        return f"lacks {', '.join(sorted(missing))} in its SubjectAltName" if missing else None

    def _make_dirs(self) -> None:
        for folder in self.layout.store_dirs():
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.layout.private, 0o700)

    def _create_ca(self, host: str, now: datetime) -> None:
        key = builder.new_rsa_key(builder.CA_KEY_BITS)
        # a random suffix keeps two appliances' CAs apart in a PLC's trust list even with equal host names
        cert = builder.build_ca(key, f"Appliance CA {host} {secrets.token_hex(3)}"[:64], CA_DAYS, now)
        write_atomic(self.layout.ca_key_pem, builder.private_key_pem(key), SECRET)
        write_atomic(self.layout.ca_cert_der, to_der(cert), PUBLIC)
        write_atomic(self.layout.ca_cert_pem, to_pem(cert), PUBLIC)
        write_atomic(self.layout.ca_trusted_der, to_der(cert), PUBLIC)
        # revocations of an earlier CA mean nothing to this one
        self.layout.revocation_ledger.unlink(missing_ok=True)
        self.layout.ca_crl_der.unlink(missing_ok=True)
        log.info("created the appliance CA %s", cert.subject.rfc4514_string())

    def _create_server_cert(self, ca_cert, ca_key, uri, hosts, addrs, cn, days, now) -> None:
        key = builder.new_rsa_key(builder.SERVER_KEY_BITS)
        cert = builder.build_server_cert(key, ca_cert, ca_key, uri, hosts, addrs, cn, days, now)
        write_atomic(self.layout.own_key_pem, builder.private_key_pem(key), SECRET)
        write_atomic(self.layout.own_cert_der, to_der(cert), PUBLIC)
        write_atomic(self.layout.own_cert_pem, to_pem(cert), PUBLIC)
        self.layout.own_issuers_der.unlink(missing_ok=True)  # a plant CA's chain does not go with this one
        log.info("created the server certificate for %s (%s)", uri, ", ".join(hosts + addrs))

    def load_ca(self) -> tuple[x509.Certificate, object]:
        try:
            cert = x509.load_der_x509_certificate(self.layout.ca_cert_der.read_bytes())
        except FileNotFoundError:
            raise PKIError(f"no appliance CA certificate at {self.layout.ca_cert_der}; run `appliance certs init`") \
                from None
        except ValueError:
            raise PKIError(f"{self.layout.ca_cert_der} is not a DER certificate") from None
        try:
            key = serialization.load_pem_private_key(self.layout.ca_key_pem.read_bytes(), password=None)
        except FileNotFoundError:
            raise PKIError(f"the CA key {self.layout.ca_key_pem} is absent; it is needed to sign") from None
        except (ValueError, TypeError):
            raise PKIError(f"{self.layout.ca_key_pem} is not an unencrypted PEM private key") from None
        if key.public_key().public_numbers() != cert.public_key().public_numbers():
            raise PKIError(f"{self.layout.ca_key_pem} does not belong to the CA certificate {self.layout.ca_cert_der}")
        return cert, key

    # -- client certificates -----------------------------------------------------------------------------------
    def issue(
        self,
        name: str,
        role: str,
        out_dir: Path,
        hostname: str,
        password: str | None = None,
        days: int = CLIENT_DAYS,
    ) -> IssuedCert:
        if not CLIENT_NAME.fullmatch(name or "") or name == CA_FILE_STEM:
            raise PKIError(f"bad certificate name {name!r}: use 1-64 letters, digits, '-' or '_' (not {CA_FILE_STEM!r})")
        try:
            check_role(role)
        except ValueError as exc:
            raise PKIError(str(exc)) from None
        if not HOSTNAME.fullmatch(hostname or ""):
            raise PKIError(f"bad host name {hostname!r} for the certificate's URI")
        if password is not None and not password:
            raise PKIError("the password is empty: give a non-empty password or none")
        if not 1 <= days <= 3650:
            raise PKIError(f"validity of {days} days is out of range (1-3650)")
        if self.role_map.find(name):
            raise PKIError(f"a certificate named {name!r} is already issued; revoke it first (`appliance certs revoke {name}`)")
        ca_cert, ca_key = self.load_ca()
        uri = f"urn:{hostname}:appliance:client:{name}"
        key = builder.new_rsa_key(builder.SERVER_KEY_BITS)
        cert = builder.build_client_cert(key, ca_cert, ca_key, name, uri, days, self._clock())
        der = to_der(cert)
        p12_encryption = (
            serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
        )
        p12 = pkcs12.serialize_key_and_certificates(name.encode(), key, cert, [ca_cert], p12_encryption)
        out_dir = Path(out_dir)
        issued = IssuedCert(
            name=name,
            role=role,
            thumbprint=thumbprint(der),
            application_uri=uri,
            not_after=cert.not_valid_after_utc,
            cert_der_path=out_dir / f"{name}.der",
            cert_pem_path=out_dir / f"{name}.pem",
            key_pem_path=out_dir / f"{name}.key.pem",
            p12_path=out_dir / f"{name}.p12",
            ca_der_path=out_dir / f"{name}.ca.der",
            ca_crl_path=out_dir / f"{name}.ca.crl",
        )
        self.refresh_crl()  # the CRL handed out with the CA is a current one
        crl_der = self.layout.ca_crl_der.read_bytes()
        issued.crl_next_update = parse_crl(crl_der).next_update_utc
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(issued.key_pem_path, builder.private_key_pem(key, password), SECRET)
            write_atomic(issued.p12_path, p12, SECRET)
            write_atomic(issued.cert_der_path, der, PUBLIC)
            write_atomic(issued.cert_pem_path, to_pem(cert), PUBLIC)
            write_atomic(issued.ca_der_path, to_der(ca_cert), PUBLIC)
            write_atomic(issued.ca_crl_path, crl_der, PUBLIC)
            write_atomic(self.layout.trusted / f"{name}.der", der, PUBLIC)
        except OSError as exc:
            raise PKIError(f"cannot write {exc.filename or out_dir}: {exc.strerror}") from None
        self.role_map.put(
            issued.thumbprint,
            {
                "name": name,
                "role": role,
                "subject": cert.subject.rfc4514_string(),
                "serial": format(cert.serial_number, "x"),
                "ca_thumbprint": thumbprint(to_der(ca_cert)),
                "not_after": cert.not_valid_after_utc.isoformat(),
            },
        )
        log.info("issued %s (%s) for role %s", name, issued.thumbprint, role)
        return issued

    # -- trust list maintenance --------------------------------------------------------------------------------
    def trust(self, file: Path) -> Path:
        """Copy a DER or PEM certificate into trusted/ as DER; a copy in rejected/ is removed (moved)."""
        source = self._existing(Path(file), self.layout.rejected)
        der, cert = self._read_leaf(source)
        thumb = thumbprint(der)
        self.layout.trusted.mkdir(parents=True, exist_ok=True)
        target = next((s.path for s in self._stored(self.layout.trusted) if s.thumbprint == thumb), None)
        if target is None:
            stem = safe_file_stem(source.name.split(".")[0] if source.suffix else source.name)
            target = self.layout.trusted / f"{stem}.der"
            if target.exists():
                target = self.layout.trusted / f"{stem}-{thumb[:8]}.der"
            write_atomic(target, der, PUBLIC)
        for stored in self._stored(self.layout.rejected):
            if stored.thumbprint == thumb:
                stored.path.unlink(missing_ok=True)
        log.info("trusted %s (%s) as %s", cert.subject.rfc4514_string(), thumb, target.name)
        return target

    def reject(self, file_or_name: Path | str) -> Path:
        """Move a certificate from trusted/ to rejected/. It names a file, a file name or stem in trusted/,
        or a thumbprint. A certificate issued by a trusted CA stays accepted through it: revoke those."""
        found = self._find_trusted(str(file_or_name))
        if found is None:
            raise PKIError(f"no trusted certificate matches {file_or_name!s}")
        if found.path == self.layout.ca_trusted_der:
            raise PKIError("refusing to reject the appliance CA: every issued certificate depends on it; "
                           "revoke single certificates instead")
        self.layout.rejected.mkdir(parents=True, exist_ok=True)
        target = self.layout.rejected / found.path.name
        os.replace(found.path, target)
        log.info("rejected %s (%s)", found.cert.subject.rfc4514_string(), found.thumbprint)
        return target

    def revoke(self, name_or_thumbprint: str) -> RevokedCert:
        """Put a certificate issued by the appliance CA on its CRL (re-signed at once) and drop it from
        trusted/ and the role map. A certificate of another issuer is only dropped from both."""
        key = name_or_thumbprint.strip()
        key = normalize_thumbprint(key) or key
        mapped = self.role_map.find(key)
        stored = self._find_trusted(key) or (self._find_trusted(mapped[0]) if mapped else None)
        if stored is None and mapped is None:
            raise PKIError(f"no issued or trusted certificate matches {name_or_thumbprint!r}")
        thumb = stored.thumbprint if stored else mapped[0]
        entry = mapped[1] if mapped else (self.role_map.load().get(thumb) or {})
        name = entry.get("name") or (stored.path.stem if stored else None)
        serial, on_crl = None, False
        if self.layout.ca_cert_der.is_file():
            ca_cert, ca_key = self.load_ca()
            if stored is not None:
                issued_here = _issued_by(stored.cert, ca_cert)
                serial = stored.cert.serial_number
            else:
                issued_here = entry.get("ca_thumbprint") == thumbprint(to_der(ca_cert))
                serial = int(entry["serial"], 16) if entry.get("serial") else None
            if issued_here and serial is not None:
                self._add_to_crl(ca_cert, ca_key, serial, name, thumb)
                on_crl = True
        if stored is not None:
            stored.path.unlink(missing_ok=True)
        self.role_map.remove(thumb)
        log.info("revoked %s (%s)%s", name, thumb, "" if on_crl else " (not issued by this CA: removed only)")
        if not on_crl:
            return RevokedCert(name, thumb, serial, on_crl)
        return RevokedCert(name, thumb, serial, on_crl, self.layout.ca_crl_der, self.crl_next_update())

    def _add_to_crl(self, ca_cert, ca_key, serial: int, name: str | None, thumb: str) -> None:
        ledger = RevocationLedger(self.layout.revocation_ledger)
        data = ledger.load()
        data["revoked"].setdefault(
            format(serial, "x"), {"name": name, "thumbprint": thumb, "revoked_at": self._clock().isoformat()}
        )
        self._sign_crl(ca_cert, ca_key, ledger, data)

    def _sign_crl(self, ca_cert, ca_key, ledger: RevocationLedger, data: dict) -> None:
        data["crl_number"] = int(data["crl_number"]) + 1
        revoked = {int(s, 16): datetime.fromisoformat(v["revoked_at"]) for s, v in data["revoked"].items()}
        crl_der = sign_crl(ca_cert, ca_key, revoked, data["crl_number"], self._clock())
        ledger.save(data)
        write_atomic(self.layout.ca_crl_der, crl_der, PUBLIC)

    def refresh_crl(self, renew_before: timedelta = CRL_RENEW_BEFORE) -> bool:
        """Re-sign the CA's CRL when it is missing, does not verify, or expires within renew_before (30 days).
        True if signed."""
        if not (self.layout.ca_cert_der.is_file() and self.layout.ca_key_pem.is_file()):
            return False
        ca_cert, ca_key = self.load_ca()
        try:
            crl = parse_crl(self.layout.ca_crl_der.read_bytes())
            fresh = crl.is_signature_valid(ca_cert.public_key()) and (
                crl.next_update_utc is not None and crl.next_update_utc - self._clock() > renew_before
            )
        except (OSError, ValueError):
            fresh = False
        if fresh:
            return False
        ledger = RevocationLedger(self.layout.revocation_ledger)
        self._sign_crl(ca_cert, ca_key, ledger, ledger.load())
        return True

    def crl_next_update(self) -> datetime | None:
        """The nextUpdate of the appliance CA's CRL as it is on disk; None when there is none or it is unreadable."""
        try:
            return parse_crl(self.layout.ca_crl_der.read_bytes()).next_update_utc
        except (OSError, ValueError):
            return None

    # -- queries -----------------------------------------------------------------------------------------------
    def role_for_certificate(self, cert_der: bytes) -> str | None:
        try:
            leaf = split_der_chain(bytes(cert_der))[0]
        except (CertificateFormatError, TypeError):
            return None  # no certificate, no role (the login is refused for want of one)
        return self.role_map.role_for(thumbprint(leaf))

    def server_chain_der(self) -> bytes:
        """What the server presents: its certificate's DER followed by the CA's."""
        return self.layout.own_cert_der.read_bytes() + self.layout.ca_cert_der.read_bytes()

    def server_cert_not_after(self) -> datetime:
        return x509.load_der_x509_certificate(self.layout.own_cert_der.read_bytes()).not_valid_after_utc

    def export_server(self, out_dir: Path) -> list[Path]:
        """The server certificate and the CA, DER and PEM, and the CA's CRL (DER, appliance-ca.crl), for a PLC's
        certificate manager: a client that checks revocation refuses the server without the CRL."""
        if not (self.layout.own_cert_der.is_file() and self.layout.ca_cert_der.is_file()):
            raise PKIError(f"no server certificate in {self.layout.own}; run `appliance certs init`")
        out_dir = Path(out_dir)
        written = []
        try:
            for source, stem in ((self.layout.own_cert_der, "appliance-server"),
                                 (self.layout.ca_cert_der, "appliance-ca")):
                cert = x509.load_der_x509_certificate(source.read_bytes())
                for data, suffix in ((to_der(cert), ".der"), (to_pem(cert), ".pem")):
                    write_atomic(out_dir / f"{stem}{suffix}", data, PUBLIC)
                    written.append(out_dir / f"{stem}{suffix}")
            self.refresh_crl()
            if self.layout.ca_crl_der.is_file():  # absent only when the CA's key is (a CA managed elsewhere)
                write_atomic(out_dir / f"{CA_FILE_STEM}.crl", self.layout.ca_crl_der.read_bytes(), PUBLIC)
                written.append(out_dir / f"{CA_FILE_STEM}.crl")
        except OSError as exc:
            raise PKIError(f"cannot write {exc.filename or out_dir}: {exc.strerror}") from None
        return written

    def list(self) -> list[CertEntry]:  # noqa: A003 - the CLI verb
        """Every certificate in trusted/, issuers/ and rejected/, with its role and revocation state."""
        snapshot = load_snapshot(self.layout)
        roles = self.role_map.load()
        anchors = snapshot.trusted + snapshot.issuers
        without_crl = {c.thumbprint for c in snapshot.cas_without_crl()}
        entries: list[CertEntry] = []
        for location, folder in (("trusted", self.layout.trusted), ("issuers", self.layout.issuers),
                                 ("rejected", self.layout.rejected)):
            for path in sorted(p for p in folder.glob("*") if p.is_file() and not p.name.startswith(".")):
                try:
                    stored = [StoredCert(der, cert, path) for der, cert in read_certificate_file(path)]
                except (OSError, CertificateFormatError) as exc:
                    entries.append(CertEntry(location, path.name, "", "", None, None, False, error=str(exc)))
                    continue
                for s in stored:
                    mapped = roles.get(s.thumbprint, {})
                    revoked = any(
                        _issued_by(s.cert, a.cert) and snapshot.crl_status(s.cert, a) == CRL_REVOKED
                        for a in anchors
                        if a.thumbprint != s.thumbprint
                    )
                    entries.append(CertEntry(
                        location, path.name, s.cert.subject.rfc4514_string(), s.thumbprint,
                        s.cert.not_valid_after_utc, mapped.get("role"), revoked, _is_ca(s.cert), mapped.get("name"),
                        no_crl=location != "rejected" and s.thumbprint in without_crl,
                    ))
        return entries

    # -- helpers -----------------------------------------------------------------------------------------------
    def _existing(self, path: Path, fallback_dir: Path) -> Path:
        if path.is_file():
            return path
        if (fallback_dir / path.name).is_file():
            return fallback_dir / path.name
        raise PKIError(f"{path}: no such file")

    def _read_leaf(self, path: Path) -> tuple[bytes, x509.Certificate]:
        try:
            return parse_certificates(path.read_bytes())[0]
        except OSError as exc:
            raise PKIError(f"{path}: {exc.strerror}") from None
        except CertificateFormatError:
            raise PKIError(f"{path}: not a DER or PEM X.509 certificate") from None

    def _stored(self, folder: Path) -> list[StoredCert]:
        out = []
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            if path.is_file() and not path.name.startswith("."):
                try:
                    out += [StoredCert(der, cert, path) for der, cert in read_certificate_file(path)]
                except (OSError, CertificateFormatError):
                    continue  # no certificate to find here; list() names such files with their error
        return out

    def _find_trusted(self, key: str) -> StoredCert | None:
        """A trusted certificate by path, file name, file stem or thumbprint (or the thumbprint of a file)."""
        stored = self._stored(self.layout.trusted)
        path = Path(key)
        thumbs = {t} if (t := normalize_thumbprint(key)) else set()
        if path.is_file():
            try:
                thumbs |= {thumbprint(der) for der, _ in read_certificate_file(path)}
            except CertificateFormatError:
                pass  # a file that is no certificate: the key can still match a trusted file by name
        for s in stored:
            if s.thumbprint in thumbs or s.path.name == path.name or s.path.stem == key:
                return s
        return None


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (x509.ExtensionNotFound, ValueError):
        return False


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
        return True
    except (ValueError, TypeError, InvalidSignature):  # names differ, unsupported key or algorithm, bad signature
        return False
