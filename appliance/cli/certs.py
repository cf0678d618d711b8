"""`appliance certs init | issue | list | trust | reject | revoke | export-server`: the appliance's PKI
(`certs csr | install-server`, the Part 12 steps on the box, are in certs_push.py).

Each cmd_* function takes plain arguments, prints what it did and returns the exit code (0 done, 2 refused, with
the reason and the file concerned on stderr); certs.pki does the work. Every action but list and export-server
is recorded in the administrative audit trail.
"""
from __future__ import annotations

import functools
import socket
import sys
from pathlib import Path

from cryptography import x509

from certs.pki import PKI, PKIError
from certs.rolemap import ROLES
from certs.validate import TrustList
from certs.x509io import parse_certificates, san_uris

from . import certs_push
from .common import audit_admin, load_config_arg

OK, ERROR = 0, 2


def register(sub) -> None:
    c = sub.add_parser("certs", help="manage the PKI")
    csub = c.add_subparsers(dest="certs_action", required=True)
    x = csub.add_parser("init", help="create the CA and the server certificate")
    x.add_argument("--force", action="store_true", help="replace the server certificate (the CA is kept)")
    x.add_argument("--new-ca", action="store_true", help="with --force: also replace the CA (every client must "
                   "trust the new one and be issued anew)")
    x = csub.add_parser("issue", help="issue a client certificate, trusted and mapped to a role")
    x.add_argument("name")
    x.add_argument("--role", required=True, choices=ROLES)
    x.add_argument("--out")
    x.add_argument("--password", help="encrypt the key and the PKCS#12 file with it")
    csub.add_parser("list", help="trusted, issuer and rejected certificates")
    x = csub.add_parser("trust", help="trust a client certificate file")
    x.add_argument("file")
    x = csub.add_parser("reject", help="move a trusted certificate to rejected")
    x.add_argument("file")
    x = csub.add_parser("revoke", help="revoke an issued certificate (takes effect at once)")
    x.add_argument("name")
    x = csub.add_parser("export-server", help="the server certificate and CA as DER and PEM, and the CA's CRL")
    x.add_argument("--out")
    certs_push.register(csub)  # csr, install-server
    for action_parser in csub.choices.values():
        action_parser.add_argument("--config")
    c.set_defaults(func=run_certs)


def run_certs(args) -> int:
    config = load_config_arg(args.config)
    code = _dispatch(args, config)
    if args.certs_action not in ("list", "export-server"):
        subject = getattr(args, "name", None) or getattr(args, "file", None) or ""
        role = f" role={args.role}" if getattr(args, "role", None) else ""
        audit_admin(config, f"certs {args.certs_action}", f"{subject}{role}", code)
    return code


def _dispatch(args, config) -> int:
    state_dir = Path(config.server.state_dir)
    action = args.certs_action
    if action in ("csr", "install-server"):
        return certs_push.run(args, config)
    if action == "init":
        from ..daemon import certificate_names
        hostnames, ips = certificate_names(config)
        return cmd_init(state_dir, config.server.application_uri, hostnames, ips, args.force, new_ca=args.new_ca)
    if action == "issue":
        out = Path(args.out) if args.out else None
        return cmd_issue(state_dir, args.name, args.role, out, socket.gethostname(), args.password)
    if action == "list":
        return cmd_list(state_dir)
    if action == "trust":
        return cmd_trust(state_dir, Path(args.file))
    if action == "reject":
        return cmd_reject(state_dir, Path(args.file))
    if action == "revoke":
        return cmd_revoke(state_dir, args.name)
    return cmd_export_server(state_dir, Path(args.out) if args.out else Path.cwd())  # the parser allows no other


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
    server = parse_certificates(pki.layout.own_cert_der.read_bytes())[0][1]
    print(f"server certificate  {pki.layout.own_cert_der}  (valid until {_date(server.not_valid_after_utc)})")
    print(f"  ApplicationUri    {', '.join(san_uris(server))}")
    print(f"  SubjectAltName    {_san_names(server)}")
    print(f"server key          {pki.layout.own_key_pem}")
    print(f"appliance CA        {pki.layout.ca_cert_der}  {pki.layout.ca_cert_pem}")
    print(f"CA key              {pki.layout.ca_key_pem}  (keep it secret; only `certs issue` and `revoke` need it)")
    print(f"CA's CRL            {pki.layout.ca_crl_der}  (next update {_date(pki.crl_next_update())}; "
          "re-signed by `appliance serve` 30 days before)")
    print("Import the CA certificate (ca.der) and its CRL into each PLC's or client's trust list "
          "(`appliance certs export-server` writes both).")
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
    print(f"Hand out {issued.ca_der_path.name} and {issued.ca_crl_path.name} (the CA's CRL, next update "
          f"{_date(issued.crl_next_update)}) with it: a client that checks revocation needs both to trust the server.")
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
        flags += " [NO CRL]" if e.no_crl else ""  # its certificates are refused while security.require_crl is on
        print(f"{e.location:9} {e.file:32} {e.role or '-':9} {_date(e.not_after):10} {e.thumbprint}  {e.subject}{flags}")
    return OK


@_reports_errors
def cmd_trust(state_dir: Path, file: Path) -> int:
    pki = PKI(state_dir)
    target = pki.trust(Path(file))
    print(f"trusted: {target}")
    trust_list = TrustList(pki.layout.pki_dir, copy_rejected=False)
    result = trust_list.validate_application_certificate(target.read_bytes(), None)
    if not result.ok:
        print(f"warning: it will still be refused: {result.status} ({result.reason})", file=sys.stderr)
    return OK


@_reports_errors
def cmd_reject(state_dir: Path, file) -> int:
    pki = PKI(state_dir)
    target = pki.reject(file)
    print(f"rejected: moved to {target}")
    result = TrustList(pki.layout.pki_dir, copy_rejected=False).validate_user_certificate(target.read_bytes())
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
        print(f"Hand out the new CRL to every client that checks revocation: {revoked.crl_path} (next update "
              f"{_date(revoked.crl_next_update)}), or appliance-ca.crl from `appliance certs export-server`; "
              "it replaces each NAME.ca.crl given out before.")
    else:
        print(f"removed {label} from trusted/ and the role map (not issued by this appliance's CA, so not on its CRL)")
    return OK


@_reports_errors
def cmd_export_server(state_dir: Path, out_dir: Path) -> int:
    for path in PKI(state_dir).export_server(Path(out_dir)):
        print(path)
    next_update = _date(PKI(state_dir).crl_next_update())
    print("Import appliance-server.der (TIA Portal) or appliance-ca.der into the PLC's certificate manager, with "
          f"appliance-ca.crl (the CA's CRL, next update {next_update}) where it checks revocation.")
    return OK
