"""`appliance certs csr | install-server`: the Part 12 steps on the box itself, for plants without a GDS.

With the appliance running, the CLI does what a GDS does: it calls the appliance's own ServerConfiguration over
OPC UA on loopback (SignAndEncrypt, as the box's commissioning security admin: a certificate the local CA issues
once, kept in state_dir/clients), so the checks, the audit record and the switch without a restart are the server's
own. With no appliance running, the same checks run here on the pki/ files and the certificate is used at the next
start.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from pathlib import Path

from asyncua import ua
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certs.pki import PKI, PKIError
from certs.server_certificate import CertificateRefused, ServerCertificateStore
from certs.x509io import CertificateFormatError, parse_certificates, thumbprint, write_atomic
from core.certificate_management import CERTIFICATE_TYPE, DEFAULT_GROUP, SERVER_CONFIGURATION, server_identity

from ..client import connect

OK, REFUSED = 0, 2
COMMISSIONING_NAME = "commissioning-security-admin"
NOT_RUNNING = (OSError, asyncio.TimeoutError, TimeoutError)
O = ua.ObjectIds


def register(csub) -> None:
    x = csub.add_parser("csr", help="a signing request for the server certificate (for the plant's CA)")
    x.add_argument("--out", default="server.csr", help="where to write it (PEM; DER if the name ends in .der)")
    x.add_argument("--subject", default="", help="the subject to ask for (default: the current certificate's)")
    x.add_argument("--new-key", action="store_true", help="for a new private key, kept until its certificate "
                   "is installed")
    x = csub.add_parser("install-server", help="install the server certificate the plant's CA signed; a running "
                        "appliance switches to it without a restart")
    x.add_argument("file", metavar="CERT", help="the certificate (DER or PEM; a PEM file may hold its issuers too)")
    x.add_argument("--key", help="its private key (PEM, or PFX/.p12 without password) when it is not the server's "
                   "key or the one `certs csr --new-key` made")
    x.add_argument("--issuer", action="append", default=[], help="an issuer certificate of the chain (repeatable)")


def run(args, config) -> int:
    try:
        if args.certs_action == "csr":
            return cmd_csr(config, Path(args.out), args.subject, args.new_key)
        return cmd_install_server(config, Path(args.file), Path(args.key) if args.key else None,
                                  [Path(p) for p in args.issuer])
    except (PKIError, CertificateRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
    return REFUSED


def cmd_csr(config, out: Path, subject: str, new_key: bool) -> int:
    nonce = os.urandom(32)
    result = _online(config, "CreateSigningRequest", [
        ua.Variant(DEFAULT_GROUP, ua.VariantType.NodeId), ua.Variant(CERTIFICATE_TYPE, ua.VariantType.NodeId),
        ua.Variant(subject, ua.VariantType.String), ua.Variant(new_key, ua.VariantType.Boolean),
        ua.Variant(nonce, ua.VariantType.ByteString)])
    if result is None:
        store = ServerCertificateStore(PKI(config.server.state_dir).layout.pki_dir)
        request = store.signing_request(subject, new_key, nonce)
        where = "from the files (no appliance is running)"
    elif not result.StatusCode.is_good():
        return _refused("CreateSigningRequest", result)
    else:
        request = result.OutputArguments[0].Value
        where = "by the running appliance"
    csr = x509.load_der_x509_csr(request)
    data = request if out.suffix == ".der" else csr.public_bytes(serialization.Encoding.PEM)
    write_atomic(out, data, 0o644)
    print(f"signing request {out} made {where}: subject {csr.subject.rfc4514_string()}, "
          f"{'a new key' if new_key else 'the server key in use'}")
    print("Have the plant's CA sign it, then: appliance certs install-server CERT --issuer CA_CERT")
    return OK


def cmd_install_server(config, cert_file: Path, key_file: Path | None, issuer_files: list[Path]) -> int:
    try:
        chain = [der for der, _ in parse_certificates(cert_file.read_bytes())]
        for path in issuer_files:
            chain += [der for der, _ in parse_certificates(path.read_bytes())]
    except CertificateFormatError:
        raise PKIError(f"{cert_file}: not a DER or PEM X.509 certificate (or an --issuer file is not)") from None
    key_format, key = _key(key_file)
    leaf, issuers = chain[0], chain[1:]
    result = _online(config, "UpdateCertificate", [
        ua.Variant(DEFAULT_GROUP, ua.VariantType.NodeId), ua.Variant(CERTIFICATE_TYPE, ua.VariantType.NodeId),
        ua.Variant(leaf, ua.VariantType.ByteString), ua.Variant(issuers, ua.VariantType.ByteString, is_array=True),
        ua.Variant(key_format, ua.VariantType.String), ua.Variant(key, ua.VariantType.ByteString)], apply=True)
    if result is None:
        store = ServerCertificateStore(PKI(config.server.state_dir).layout.pki_dir)
        staged = store.stage(server_identity(config), leaf, issuers, key_format, key)
        store.install_staged()
        print(f"installed the server certificate {staged.thumbprint} in the files (no appliance is running): "
              "the next start uses it")
        return OK
    if not result.StatusCode.is_good():
        return _refused("UpdateCertificate", result)
    print(f"installed the server certificate {thumbprint(leaf)}: the running appliance uses it for new "
          "connections now and closes the existing ones (clients reconnect)")
    return OK


def _key(key_file: Path | None) -> tuple[str, bytes]:
    if key_file is None:
        return "", b""
    data = key_file.read_bytes()
    return ("PFX" if key_file.suffix.lower() in (".pfx", ".p12") else "PEM"), data


def _refused(method: str, result: ua.CallMethodResult) -> int:
    print(f"error: the appliance refused {method}: {result.StatusCode.name} (its log and audit trail say why)",
          file=sys.stderr)
    return REFUSED


def _commissioning_identity(config) -> tuple[Path, Path]:
    state_dir = Path(config.server.state_dir)
    out = state_dir / "clients"
    cert, key = out / f"{COMMISSIONING_NAME}.der", out / f"{COMMISSIONING_NAME}.key.pem"
    if not (cert.exists() and key.exists()):
        PKI(state_dir).issue(COMMISSIONING_NAME, "security_admin", out, socket.gethostname())
    return cert, key


def _online(config, method: str, args: list[ua.Variant], apply: bool = False) -> ua.CallMethodResult | None:
    """Call ServerConfiguration's method (then ApplyChanges when asked and it succeeded) on the appliance running on
    this box; None when none is running."""
    if not PKI(config.server.state_dir).exists():
        return None
    endpoint = f"opc.tcp://127.0.0.1:{config.server.port}"

    async def call() -> ua.CallMethodResult | None:
        cert, key = _commissioning_identity(config)
        try:
            client = await connect(endpoint, cert, key, timeout=10)
        except NOT_RUNNING:
            return None
        except ua.UaStatusCodeError as exc:  # running, but it refuses the commissioning identity
            raise PKIError(f"the running appliance refused the commissioning certificate {cert}: "
                           f"{type(exc).__name__}") from None
        try:
            result = await _call(client, method, args)
            if apply and result.StatusCode.is_good():
                applied = await _call(client, "ApplyChanges", [])
                if not applied.StatusCode.is_good():
                    return applied
            return result
        finally:
            with contextlib.suppress(Exception):  # ApplyChanges closes this channel a second later anyway
                await client.disconnect()
    return asyncio.run(call())


async def _call(client, method: str, args: list[ua.Variant]) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId = SERVER_CONFIGURATION
    request.MethodId = ua.NodeId(getattr(O, f"ServerConfiguration_{method}"))
    request.InputArguments = args
    return (await client.uaclient.call([request]))[0]

