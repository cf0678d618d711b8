"""`appliance certs ...`: each function takes parsed arguments, prints what it did, returns the exit code
(0 done, 2 refused, with the reason and the file concerned on stderr)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

from cryptography import x509

from .pki import PKI, PKIError
from .validate import TrustList
from .x509io import parse_certificates, san_uris

OK, ERROR = 0, 2


def _reports_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            return fn(*args, **kwargs)
        except PKIError as exc:
            print(f"error: {exc}", file=sys.stderr)
        except OSError as exc:
            print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return ERROR

    return wrapper


def _date(when) -> str:
    return when.strftime("%Y-%m-%d") if when else "-"


@_reports_errors
def cmd_init(state_dir: Path, application_uri: str, hostnames, ips, force: bool, new_ca: bool = False) -> int:
    pki = PKI(state_dir)
    pki.init(application_uri, list(hostnames or []), list(ips or []), force=force, new_ca=new_ca)
    server = parse_certificates(pki.own_cert_path.read_bytes())[0][1]
    print(f"server certificate  {pki.own_cert_path}  (valid until {_date(server.not_valid_after_utc)})")
    print(f"  ApplicationUri    {', '.join(san_uris(server))}")
    print(f"  SubjectAltName    {_san_names(server)}")
    print(f"server key          {pki.own_key_path}")
    print(f"appliance CA        {pki.ca_cert_path}  {pki.ca_cert_pem_path}")
    print(f"CA key              {pki.ca_key_path}  (keep it secret; only `certs issue` and `revoke` need it)")
    print("Import the CA certificate (ca.der) into each PLC's or client's trust list.")
    return OK


def _san_names(cert: x509.Certificate) -> str:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = san.get_values_for_type(x509.DNSName) + [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    return ", ".join(names)


@_reports_errors
def cmd_issue(state_dir: Path, name: str, role: str, out_dir: Path | None, hostname: str,
              password: str | None) -> int:
    pki = PKI(state_dir)
    issued = pki.issue(name, role, Path(out_dir) if out_dir else Path(state_dir) / "clients", hostname, password)
    print(f"issued {issued.name} for role {issued.role} (valid until {_date(issued.not_after)})")
    print(f"  ApplicationUri  {issued.application_uri}")
    print(f"  thumbprint      {issued.thumbprint}")
    for path in issued.files:
        print(f"  {path}")
    if password is None:
        print("note: the private key and the .p12 are not encrypted; protect these files or use --password")
    return OK


@_reports_errors
def cmd_list(state_dir: Path) -> int:
    entries = PKI(state_dir).list()
    if not entries:
        print("no certificates in trusted/, issuers/ or rejected/")
        return OK
    print(f"{'where':9} {'file':32} {'role':9} {'not after':10} {'thumbprint':40}  subject")
    for e in entries:
        if e.error:
            print(f"{e.location:9} {e.file:32} {'-':9} {'-':10} {'-':40}  unreadable: {e.error}")
            continue
        flags = " [CA]" if e.is_ca else ""
        flags += " [REVOKED]" if e.revoked else ""
        print(f"{e.location:9} {e.file:32} {e.role or '-':9} {_date(e.not_after):10} {e.thumbprint}  {e.subject}{flags}")
    return OK


@_reports_errors
def cmd_trust(state_dir: Path, file: Path) -> int:
    pki = PKI(state_dir)
    target = pki.trust(Path(file))
    print(f"trusted: {target}")
    result = TrustList(pki.pki_dir, copy_rejected=False).validate_application_certificate(target.read_bytes(), None)
    if not result.ok:
        print(f"warning: it will still be refused: {result.status} ({result.reason})", file=sys.stderr)
    return OK


@_reports_errors
def cmd_reject(state_dir: Path, file) -> int:
    pki = PKI(state_dir)
    target = pki.reject(file)
    print(f"rejected: moved to {target}")
    result = TrustList(pki.pki_dir, copy_rejected=False).validate_user_certificate(target.read_bytes())
    if result.ok:
        print("warning: still accepted, because a trusted CA issued it; use `appliance certs revoke` "
              "to block it", file=sys.stderr)
    return OK


@_reports_errors
def cmd_revoke(state_dir: Path, name: str) -> int:
    revoked = PKI(state_dir).revoke(name)
    label = revoked.name or revoked.thumbprint
    if revoked.on_crl:
        print(f"revoked {label} (serial {revoked.serial:x}): on the CA's CRL, out of trusted/ and the role map")
    else:
        print(f"removed {label} from trusted/ and the role map (not issued by this appliance's CA, so not on its CRL)")
    return OK


@_reports_errors
def cmd_export_server(state_dir: Path, out_dir: Path) -> int:
    for path in PKI(state_dir).export_server(Path(out_dir)):
        print(path)
    print("Import appliance-server.der (TIA Portal) or appliance-ca.der into the PLC's certificate manager.")
    return OK

