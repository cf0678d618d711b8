"""Tools for the attack tests: an appliance to attack, tampering clients, raw UA TCP bytes, and the measurements
(RSS, latency percentiles) the closing note reports. Everything talks to a real server on loopback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import socket
import subprocess
import time
from pathlib import Path

from asyncua import Client, ua
from asyncua.client.ua_client import UaClient
from asyncua.ua.ua_binary import uatcp_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from appliance.client import POLICY_CLASSES, WATCHDOG_INTERVAL_S, certificate_uri
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, status_name

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 4  # the affine model's sample: y = 2x + 1
SAMPLE = [1.0, 2.0, 3.0, 4.0]
EXPECTED = [3.0, 5.0, 7.0, 9.0]


def start_appliance(folder: Path, extra: dict | None = None, **model_options) -> RunningAppliance:
    """A real appliance serving the affine model `affine`, with an operator certificate `plc1` issued."""
    folder.mkdir(parents=True, exist_ok=True)
    affine_model(folder / "affine.onnx")
    models = {"affine": {"kind": "tensor", "path": str(folder / "affine.onnx"), "max_samples": 8,
                         "max_queue_delay_ms": 0, **model_options}}
    app = RunningAppliance(folder / "state", models, extra)
    app.operator = app.issue("plc1", "operator")
    return app


def status_of(exc: BaseException | None) -> str:
    """The OPC UA status name a refusal carries; "ConnectionClosed" when the server closed the channel; "" for no
    refusal."""
    if exc is None:
        return ""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return ua.StatusCode(code).name
    if isinstance(exc, (ConnectionError, asyncio.IncompleteReadError, EOFError)):
        return "ConnectionClosed"
    return type(exc).__name__


REFUSAL_WITHIN_S = 15.0  # a refusal arrives within this; no answer by then is a hang, never a refusal


async def refusal(coro, timeout: float = REFUSAL_WITHIN_S, *, alive=None) -> BaseException | None:
    """Run coro: None if it succeeded, else the refusal it met within `timeout` seconds. A refusal is an OPC UA
    status code (a service fault, a method or ErrorMessage status), or the server closing the connection while it
    still answers a legitimate client afterwards: `alive` (an async callable, e.g. `lambda: legit_infer(app)`) is
    then run and must succeed. Anything else fails the test: a refused TCP connect (no server listens: it died), a
    close without `alive` or after which the server no longer answers (a crash is not a refusal), a client-side
    timeout (the server hung), and an unexpected error of the client."""
    try:
        await asyncio.wait_for(coro, timeout)
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise AssertionError(f"no answer within {timeout:g} s: the server hung instead of refusing") from exc
    except ua.UaStatusCodeError as exc:
        return exc
    except ConnectionRefusedError as exc:
        raise AssertionError("the TCP connect was refused: no server listens (did it die?); not a refusal") from exc
    except (ConnectionError, asyncio.IncompleteReadError, EOFError) as exc:  # the server closed the channel
        if alive is None:
            raise AssertionError(f"the connection closed ({exc!r}); a close is a refusal only when the server still "
                                 "answers a legitimate client: pass alive=") from exc
        try:
            await asyncio.wait_for(alive(), timeout)
        except Exception as after:  # noqa: BLE001 - any failure of the legitimate client means the server is gone
            raise AssertionError(f"the connection closed ({exc!r}) and then a legitimate client failed ({after!r}):"
                                 " the server crashed, it did not refuse") from exc
        return exc
    return None


async def new_client(endpoint: str, cert: Path | None, key: Path | None, *, mode: str = "SignAndEncrypt",
                     policy: str = "Basic256Sha256", timeout: float = 10.0,
                     application_uri: str | None = None, server_certificate: Path | None = None) -> Client:
    """An asyncua client with its application certificate set (or no security without cert); not connected.
    With server_certificate the client skips discovery, so it can ask for what the server does not offer."""
    client = Client(endpoint, timeout=timeout, watchdog_intervall=WATCHDOG_INTERVAL_S)  # as appliance.client.connect
    client.session_timeout = 60_000
    client.name = client.description = "attack test client"
    if cert is not None:
        client.application_uri = application_uri or certificate_uri(cert)
        await client.set_security(POLICY_CLASSES[policy], str(cert), str(key),
                                  server_certificate=str(server_certificate) if server_certificate else None,
                                  mode=getattr(ua.MessageSecurityMode, mode))
    elif application_uri:
        client.application_uri = application_uri
    return client


async def open_channel(client: Client) -> None:
    """Socket, Hello and OpenSecureChannel only: no session."""
    await client.connect_socket()
    await client.send_hello()
    await client.open_secure_channel()


async def load_user_certificate(client: Client, cert: Path, key: Path) -> None:
    await client.load_client_certificate(str(cert))
    await client.load_private_key(str(key))


async def close(client: Client) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.disconnect(), 5)
    with contextlib.suppress(Exception):
        client.disconnect_socket()


class TamperingUaClient(UaClient):
    """Sends CreateSession with a ClientCertificate other than the secure channel's (None: omitted)."""

    forged_certificate: bytes | None = None

    async def create_session(self, parameters: ua.CreateSessionParameters):
        parameters.ClientCertificate = self.forged_certificate
        return await super().create_session(parameters)


def tamper_create_session(client: Client, forged_certificate: bytes | None) -> None:
    client.uaclient.__class__ = TamperingUaClient
    client.uaclient.forged_certificate = forged_certificate


async def infer_once(client: Client) -> ua.CallMethodResult:
    return await call(client, "affine", "Infer", [floats(SAMPLE)])


async def legit_infer(app: RunningAppliance, creds=None, timeout: float = 10.0, **kw) -> float:
    """A legitimate client connects over SignAndEncrypt, calls Infer and checks the answer; returns seconds."""
    from appliance.client import connect
    cert, key = creds or app.operator
    started = time.perf_counter()
    client = await asyncio.wait_for(connect(app.endpoint, cert, key, timeout=timeout, **kw), timeout)
    try:
        result = await asyncio.wait_for(infer_once(client), timeout)
        assert status_name(result) == "Good", status_name(result)
        assert [round(v, 4) for v in result.OutputArguments[0].Value] == EXPECTED
    finally:
        await close(client)
    return time.perf_counter() - started


def run_node_client(app: RunningAppliance, name: str = "plc1") -> dict:
    """The independent node-opcua client (tests/node/infer.js) calls Infer on `affine` with its certificate."""
    if shutil.which("node") is None:
        raise RuntimeError("Node.js is needed for the independent client")
    cert_der = app.state_dir / "clients" / f"{name}.der"
    uri = f"urn:{socket.gethostname()}:appliance:client:{name}"
    proc = subprocess.run(
        ["node", str(ROOT / "tests" / "node" / "infer.js"), app.endpoint, str(cert_der.with_suffix(".pem")),
         str(app.state_dir / "clients" / f"{name}.key.pem"), uri, str(app.state_dir / "node-pki"), "affine",
         json.dumps(SAMPLE)], capture_output=True, text=True, timeout=120)
    # node-opcua prints warnings on stdout too: the result is the last JSON line
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), "{}")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(line)
    assert result["status"] == "Good" and [round(v, 4) for v in result["output"]] == EXPECTED, result
    assert result["securityMode"] == "SignAndEncrypt"
    return result


# ---- raw UA TCP ---------------------------------------------------------------------------------------------

def hello_bytes(endpoint: str, buffer: int = 65535) -> bytes:
    hello = ua.Hello(ProtocolVersion=0, ReceiveBufferSize=buffer, SendBufferSize=buffer, MaxMessageSize=0,
                     MaxChunkCount=0, EndpointUrl=endpoint)
    return uatcp_to_binary(ua.MessageType.Hello, hello)


def chunk(message_type: bytes, chunk_type: bytes, body: bytes, channel_id: int | None = None) -> bytes:
    """A UA TCP chunk with a correct size field; secure message types carry a channel id."""
    head = b"" if channel_id is None else channel_id.to_bytes(4, "little")
    return message_type + chunk_type + (8 + len(head) + len(body)).to_bytes(4, "little") + head + body


class RawPeer:
    """A blocking TCP socket to the server, for bytes no OPC UA stack would send."""

    def __init__(self, port: int, timeout: float = 2.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def read_until_closed(self, timeout: float = 2.0, limit: int = 1 << 20) -> tuple[bytes, bool]:
        """(bytes received, whether the server closed the connection within timeout)."""
        self.sock.settimeout(timeout)
        got = b""
        end = time.monotonic() + timeout
        while time.monotonic() < end and len(got) < limit:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return got, False
            except OSError:
                return got, True
            if not data:
                return got, True
            got += data
        return got, False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def error_status(data: bytes) -> str | None:
    """The status name of the first ErrorMessage (ERRF) in data, if any."""
    at = data.find(b"ERRF")
    if at < 0 or len(data) < at + 12:
        return None
    return ua.StatusCode(int.from_bytes(data[at + 8:at + 12], "little")).name


# ---- measurements ------------------------------------------------------------------------------------------

def rss_mb() -> float:
    """Resident memory of this process (the appliance runs in a thread of it), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def report(tmp_path: Path, name: str, figures: dict) -> dict:
    """Print the figures and write them to tmp_path/NAME.json (the lead copies them into the closing note)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2, sort_keys=True))
    print(f"\n{path}:\n{path.read_text()}")
    return figures


def load_ca(app: RunningAppliance):
    pki = app.pki
    ca = pki.layout.ca_cert_der
    cert = x509.load_der_x509_certificate(ca.read_bytes()) if ca.suffix == ".der" \
        else x509.load_pem_x509_certificate(ca.read_bytes())
    key = serialization.load_pem_private_key(pki.layout.ca_key_pem.read_bytes(), password=None)
    return cert, key


# ---- crafted requests through a real session ------------------------------------------------------------------

SENTINEL = "@@RAW-ARGUMENT-SENTINEL@@"


@contextlib.contextmanager
def raw_argument(replacement: bytes):
    """While active, a String Variant argument holding SENTINEL is sent as `replacement` (raw Variant bytes):
    the client encodes what no client would (nesting thousands deep, lying lengths), over its real session."""
    import asyncua.client.ua_client as ua_client_module
    from asyncua.ua.ua_binary import variant_to_binary
    original = ua_client_module.struct_to_binary
    marker = variant_to_binary(ua.Variant(SENTINEL, ua.VariantType.String))

    def substituting(obj):
        data = original(obj)
        return data.replace(marker, replacement) if marker in data else data
    ua_client_module.struct_to_binary = substituting
    try:
        yield ua.Variant(SENTINEL, ua.VariantType.String)
    finally:
        ua_client_module.struct_to_binary = original


def deep_variant_bytes(depth: int) -> bytes:
    """A Float wrapped in depth-1 one-element Variant arrays: 5 bytes a level."""
    level = bytes([0x80 | ua.VariantType.Variant.value]) + (1).to_bytes(4, "little")
    return level * (depth - 1) + bytes([ua.VariantType.Float.value]) + b"\x00\x00\x80\x3f"


async def unfinished_message(endpoint: str, payload_bytes: int) -> tuple[int, bool]:
    """Open a None channel (allowed for discovery) and send the chunks of a large message without its final
    chunk. Returns (bytes sent, whether the server closed the connection within 5 s); a connection the server
    refused outright counts as (0, True)."""
    client = await new_client(endpoint, None, None)
    try:
        await open_channel(client)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        await close(client)
        return 0, True
    protocol = client.uaclient.protocol

    def closed() -> bool:
        return protocol.transport is None or protocol.transport.is_closing()
    try:
        data = protocol._connection.message_to_binary(b"\x00" * payload_bytes, request_id=99)
        # drop the final chunk: walk the chunk sizes
        offset, last = 0, 0
        while offset < len(data):
            last = offset
            offset += int.from_bytes(data[offset + 4:offset + 8], "little")
        unfinished = data[:last]
        if closed():
            return 0, True
        protocol.transport.write(unfinished)
        end = time.monotonic() + 5
        while time.monotonic() < end and not closed():
            await asyncio.sleep(0.02)
        return len(unfinished), closed()
    finally:
        await close(client)


def open_none_channel_bytes() -> bytes:
    """A valid OpenSecureChannel request for SecurityPolicy#None (discovery is allowed over it)."""
    from asyncua.common.connection import SecureConnection, TransportLimits
    from asyncua.crypto.security_policies import SecurityPolicyNone
    from asyncua.ua.ua_binary import struct_to_binary
    request = ua.OpenSecureChannelRequest()
    request.Parameters.RequestType = ua.SecurityTokenRequestType.Issue
    request.Parameters.SecurityMode = ua.MessageSecurityMode.None_
    request.Parameters.ClientNonce = b""
    request.Parameters.RequestedLifetime = 600000
    connection = SecureConnection(SecurityPolicyNone(), TransportLimits())
    return connection.message_to_binary(struct_to_binary(request), message_type=ua.MessageType.SecureOpen,
                                        request_id=1)


async def send_raw(port: int, data: bytes, wait: float = 0.5) -> tuple[bytes, bool]:
    """Send bytes on a fresh connection; (what came back, whether the server closed it within `wait`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got, closed = b"", False
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            try:
                chunk_ = await asyncio.wait_for(reader.read(65536), left)
            except asyncio.TimeoutError:
                break
            except ConnectionError:
                closed = True
                break
            if not chunk_:
                closed = True
                break
            got += chunk_
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return got, closed
