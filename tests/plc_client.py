"""An OPC UA client with a Siemens S7-1500's profile (OPC_UA_Connect / OPC_UA_MethodCall_C): a user name and
password (it cannot send an X509 user identity) over Basic256Sha256 SignAndEncrypt, 8 KiB send and receive buffers
announced in its Hello (every message crosses in chunks of at most 8 KiB), and a new session for every call
(MaintainSession FALSE). Used by the tests and by bench/plc_tasks.py.
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from asyncua import Client, ua
from asyncua.ua.ua_binary import uatcp_to_binary

from appliance.client import POLICY_CLASSES, WATCHDOG_INTERVAL_S, call_method, certificate_uri

S7_BUFFER = 8192


class S7ProfileClient(Client):
    """asyncua's client whose Hello announces 8 KiB buffers: the server's Acknowledge then bounds both directions'
    chunks to 8 KiB, as an S7-1500's connection does."""

    async def send_hello(self) -> None:
        protocol = self.uaclient.protocol
        hello = ua.Hello()
        hello.EndpointUrl = self.server_url.geturl()
        hello.ReceiveBufferSize = hello.SendBufferSize = S7_BUFFER
        hello.MaxMessageSize = 0  # no limit: a long answer comes in several 8 KiB chunks
        hello.MaxChunkCount = 0
        ack: asyncio.Future = asyncio.get_running_loop().create_future()
        protocol._callbackmap[0] = ack
        protocol.transport.write(uatcp_to_binary(ua.MessageType.Hello, hello))
        ack_msg = await asyncio.wait_for(ack, 30)
        assert ack_msg.SendBufferSize <= S7_BUFFER and ack_msg.ReceiveBufferSize <= S7_BUFFER, ack_msg


@contextlib.asynccontextmanager
async def s7_session(endpoint: str, cert: Path, key: Path, user: str, password: str):
    client = S7ProfileClient(endpoint, timeout=60, watchdog_intervall=WATCHDOG_INTERVAL_S)
    client.application_uri = certificate_uri(cert)
    client.name = client.description = "S7-1500 profile"
    await client.set_security(POLICY_CLASSES["Basic256Sha256"], str(cert), str(key),
                              mode=ua.MessageSecurityMode.SignAndEncrypt)
    client.set_user(user)
    client.set_password(password)
    await client.connect()
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.disconnect()


async def s7_call(endpoint: str, cert: Path, key: Path, user: str, password: str, object_path: str,
                  method_id: str, args: list[ua.Variant]) -> ua.CallMethodResult:
    """One call in a session of its own (MaintainSession FALSE): ObjectId and MethodId are string NodeIds of the
    appliance namespace (e.g. 'Appliance/Models/assistant/Tasks/alarm-triage' and '.../Run'), as a PLC's
    configured client interface names them."""
    async with s7_session(endpoint, cert, key, user, password) as client:
        ns = await client.get_namespace_index("urn:opcua-inference-appliance")
        parent = client.get_node(ua.NodeId(object_path, ns))
        method = client.get_node(ua.NodeId(method_id, ns))
        return await call_method(client, parent, method, args)
