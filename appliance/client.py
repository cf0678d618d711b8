"""An OPC UA client set up as a PLC would be: SignAndEncrypt, a client certificate, an X509 or user-name identity.

Used by `appliance call` (commissioning), the benchmarks and the tests.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from asyncua import Client, ua
from asyncua.crypto import security_policies
from asyncua.ua.ua_binary import struct_from_binary
from cryptography import x509

from core.namespace import NAMESPACE_URI

POLICY_CLASSES = {
    "Basic256Sha256": security_policies.SecurityPolicyBasic256Sha256,
    "Aes128_Sha256_RsaOaep": security_policies.SecurityPolicyAes128Sha256RsaOaep,
    "Aes256_Sha256_RsaPss": security_policies.SecurityPolicyAes256Sha256RsaPss,
}


def certificate_uri(cert_path: Path) -> str:
    data = Path(cert_path).read_bytes()
    cert = (x509.load_pem_x509_certificate(data) if data.lstrip().startswith(b"-----")
            else x509.load_der_x509_certificate(data))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    return uris[0] if uris else "urn:appliance:client"


WATCHDOG_INTERVAL_S = 5.0


async def connect(endpoint: str, cert: Path, key: Path, *, policy: str = "Basic256Sha256",
                  mode: str = "SignAndEncrypt", username: str | None = None, password: str | None = None,
                  x509_identity: bool = True, anonymous: bool = False, timeout: float = 30.0,
                  session_timeout_ms: int = 60_000, key_password: str | None = None,
                  auto_reconnect: bool = False) -> Client:
    """A connected client; the caller disconnects it. Identity: user name if given, else anonymous if asked,
    else the client certificate as X509 user identity. auto_reconnect: a lost connection is re-established by
    re-activating the session on a new channel (its conversation goes on), as SCADA clients do."""
    # asyncua probes the server's state every watchdog interval and, without auto-reconnect, drops the connection
    # when a probe takes longer than the interval (1 s by default): a 2-core box replacing a worker answered one
    # probe late in CI and the client was cut off mid-test. 5 s between probes, 5 s to answer each.
    client = Client(endpoint, timeout=timeout, watchdog_intervall=WATCHDOG_INTERVAL_S)
    client.application_uri = certificate_uri(cert)
    client.session_timeout = session_timeout_ms
    client.name = client.description = "appliance client"
    await client.set_security(POLICY_CLASSES[policy], str(cert), str(key), private_key_password=key_password,
                              mode=getattr(ua.MessageSecurityMode, mode))
    if username is not None:
        client.set_user(username)
        client.set_password(password or "")
    elif not anonymous and x509_identity:
        await client.load_client_certificate(str(cert))
        await client.load_private_key(str(key), password=key_password)
    await client.connect(auto_reconnect=auto_reconnect)
    return client


async def model_node(client: Client, model: str):
    ns = await client.get_namespace_index(NAMESPACE_URI)
    objects = client.nodes.objects
    return await objects.get_child([f"{ns}:Appliance", f"{ns}:Models", f"{ns}:{model}"]), ns


class CallResult(ua.CallMethodResult):
    """A method's result and its status text (the reason the server gave for a refusal; "" when none)."""

    status_text: str = ""


OPERATION_LOCALIZED_TEXT = 0x40  # RequestHeader.ReturnDiagnostics: each operation's status text


async def call_method(client: Client, parent, method_node, args: list[ua.Variant]) -> ua.CallMethodResult:
    """Call and return the raw result (status code, argument results, outputs) instead of raising. The call asks
    for the operation's status text (ReturnDiagnostics): a refusal's reason is then the result's `status_text`
    ("" when the server gave none)."""
    item = ua.CallMethodRequest()
    item.ObjectId = parent.nodeid
    item.MethodId = method_node.nodeid
    item.InputArguments = args
    request = ua.CallRequest()
    request.Parameters.MethodsToCall = [item]
    request.RequestHeader.ReturnDiagnostics = OPERATION_LOCALIZED_TEXT
    response = struct_from_binary(ua.CallResponse, await client.uaclient.protocol.send_request(request))
    response.ResponseHeader.ServiceResult.check()
    result = CallResult(**{f.name: getattr(response.Results[0], f.name) for f in fields(ua.CallMethodResult)})
    info = response.DiagnosticInfos[0] if response.DiagnosticInfos else None
    table = response.ResponseHeader.StringTable or []
    if info is not None and info.LocalizedText is not None and 0 <= info.LocalizedText < len(table):
        result.status_text = table[info.LocalizedText]
    return result


class AdminUnreachable(Exception):
    """The appliance on this box could not be asked: `reason` is "no_pki" (never started) or "not_running"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def call_admin(config, method: str, args: list[ua.Variant], timeout_s: float) -> ua.CallMethodResult:
    """Call Appliance/Admin/<method> of the appliance running on this box, over loopback, as the box's commissioning
    engineer (a certificate the local CA issues once, kept in state_dir/clients). For the CLI's deploy, rollback
    and promote; raises AdminUnreachable."""
    import asyncio
    import socket

    from certs.pki import PKI

    state_dir = Path(config.server.state_dir)
    out = state_dir / "clients"
    cert, key = out / "commissioning-engineer.der", out / "commissioning-engineer.key.pem"
    if not (cert.exists() and key.exists()):
        pki = PKI(state_dir)
        if not pki.exists():
            raise AdminUnreachable("no_pki")
        pki.issue("commissioning-engineer", "engineer", out, socket.gethostname())
    endpoint = f"opc.tcp://127.0.0.1:{config.server.port}"

    async def call() -> ua.CallMethodResult:
        try:
            client = await connect(endpoint, cert, key, timeout=timeout_s)
        except (OSError, asyncio.TimeoutError, TimeoutError):
            raise AdminUnreachable("not_running") from None
        try:
            ns = await client.get_namespace_index(NAMESPACE_URI)
            admin = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Admin"])
            return await call_method(client, admin, await admin.get_child(f"{ns}:{method}"), args)
        finally:
            await client.disconnect()
    return asyncio.run(call())
