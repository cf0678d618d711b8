"""The server certificate swapped in a running server (Part 12 ApplyChanges), and what a certificate method needs to
know about its caller's channel.

asyncua keeps the server's certificate and key in four places: InternalServer.certificate / private_key (the X509
user token's signature check and the user token decryption), each SecurityPolicyFactory of the server's policy list
(shared by reference with the binary server and every protocol: a new secure channel creates its SecurityPolicy
from it), and every EndpointDescription's ServerCertificate (GetEndpoints, CreateSession). A channel already open
keeps the SecurityPolicy it was created with, so it goes on with the old certificate until it is closed.
"""
from __future__ import annotations

import asyncio
import logging
import struct

from asyncua import Server, ua
from asyncua.common.utils import Buffer, NotEnoughData
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)


def present_certificate(server: Server, cert: x509.Certificate, key, issuers: list[x509.Certificate]) -> None:
    """New secure channels, endpoint descriptions and sessions use this certificate (then its issuers) and key."""
    iserver = server.iserver
    iserver.certificate, iserver.private_key = cert, key
    for factory in server._policies:
        factory.certificate, factory.private_key = cert, key
        factory.certificate_chain = list(issuers)
    chain = cert.public_bytes(serialization.Encoding.DER) + b"".join(
        c.public_bytes(serialization.Encoding.DER) for c in issuers)
    for edp in iserver.endpoints:
        if edp.SecurityMode != ua.MessageSecurityMode.None_:
            edp.ServerCertificate = chain


def open_channels(server: Server) -> list:
    """The connections open now (asyncua's protocol objects)."""
    return list(server.bserver.clients) if server.bserver is not None else []


def close_channels_later(server: Server, channels: list, delay_s: float) -> asyncio.TimerHandle:
    """Close these connections after delay_s (the caller of ApplyChanges receives its answer first). Their sessions
    stay: a client re-activates its session on a new channel, which uses the new certificate."""
    def close() -> None:
        for protocol in channels:
            transport = protocol.transport
            if transport is not None and not transport.is_closing():
                transport.close()
        log.info("closed %d secure channels opened before the certificate change", len(channels))
    return asyncio.get_running_loop().call_later(delay_s, close)


def channel_security_mode(server: Server, session) -> ua.MessageSecurityMode | None:
    """The security mode of the channel the session is bound to now (None if it has none)."""
    for protocol in open_channels(server):
        processor = protocol.processor
        if processor is not None and processor.session is session:
            return processor._connection.security_policy.Mode
    return None


# ==============================================================================================================
# The TrustList file's content: one TrustListDataType, UA Binary encoded (Part 12), with asyncua's binary codec.

def trust_list_to_binary(value: ua.TrustListDataType) -> bytes:
    return struct_to_binary(value)


def trust_list_from_binary(data: bytes) -> ua.TrustListDataType:
    """ValueError unless data is exactly one TrustListDataType (a truncated file, trailing bytes, garbage)."""
    buffer = Buffer(bytes(data))
    try:
        value = struct_from_binary(ua.TrustListDataType, buffer)
    except (NotEnoughData, struct.error, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not a TrustListDataType: {type(exc).__name__}") from None
    if len(buffer):
        raise ValueError("bytes after the TrustListDataType")
    return value
