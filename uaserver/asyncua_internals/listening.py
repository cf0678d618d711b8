"""The transport and the server: the hardened protocol and binary server, asyncua's Server listening
through them, and the InternalServer's settings (items 3 and 4)."""
from __future__ import annotations

import logging
import socket

from asyncua import Server, ua
from asyncua.common.connection import TransportLimits
from asyncua.server.binary_server_asyncio import BinaryServer, OPCUAProtocol
from cryptography.hazmat.primitives import serialization

from .channel import ChannelGuard, error_message, install_message_hmac
from .decoding import install_nesting_limit
from .processor import HardenedProcessor
from .sessions import ApplianceSession

log = logging.getLogger(__name__)


class HardenedProtocol(OPCUAProtocol):
    guard: ChannelGuard

    def data_received(self, data: bytes) -> None:
        # asyncua reads a chunk's declared size and buffers until it has arrived, whatever the size: refuse a
        # header that announces more than the negotiated receive buffer before buffering anything for it.
        if self.transport is None or self.transport.is_closing():
            return
        if self._refuse_oversized(self._buffer[:8] if len(self._buffer) >= 8 else self._buffer + data[:8]):
            return
        super().data_received(data)
        # what is left over starts the next chunk: check its header now, not when more bytes arrive
        if self.transport is not None and not self.transport.is_closing():
            self._refuse_oversized(self._buffer[:8])

    def _refuse_oversized(self, head: bytes) -> bool:
        if len(head) < 8:
            return False
        size = int.from_bytes(head[4:8], "little")  # Part 6, 7.1.2.2: type(3) chunk(1) size(4)
        if 8 <= size <= self._max_chunk_size():
            return False
        log.warning("closing the connection from %s: a chunk header announces %d bytes", self.peer_name, size)
        status = ua.StatusCodes.BadTcpMessageTooLarge if size > 8 else ua.StatusCodes.BadDecodingError
        self.transport.write(error_message(status, "chunk size"))
        self.transport.close()
        self._buffer = b""
        return True

    def _max_chunk_size(self) -> int:
        configured = self.limits.max_recv_buffer
        if self.processor is not None and self.processor._limits.max_recv_buffer > 0:
            return min(configured, self.processor._limits.max_recv_buffer)
        return configured

    def connection_made(self, transport) -> None:
        watch_for_dead_peer(transport, self.guard.dead_peer_timeout_s)
        super().connection_made(transport)
        if self.processor is not None:
            processor = HardenedProcessor(self.iserver, self.transport, self.limits)
            processor.guard = self.guard
            processor.set_policies(self.policies)
            self.processor = processor


# A PLC that loses power or its cable sends no FIN or RST: without these options its connection looks alive, a call
# of it runs to its end and its session is held, until TCP gives up after many minutes. Keepalive probes an idle
# connection from half the timeout on, once a second (or so) after that; TCP_USER_TIMEOUT closes the connection when
# probes or unacknowledged answers have gone unanswered for the whole timeout. The kernel then reports the connection
# lost (ETIMEDOUT) and it goes the way of any vanished client's.

def dead_peer_options(timeout_s: int) -> list[tuple[int, int, int]]:
    """(level, option, value) of the socket options that see a vanished peer within timeout_s (an integer >= 2)."""
    idle = max(1, timeout_s // 2)
    probes = min(127, max(1, timeout_s - idle))  # Linux allows at most 127 probes
    interval = max(1, -(-(timeout_s - idle) // probes))
    return [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes),
            (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_s * 1000)]


def watch_for_dead_peer(transport, timeout_s: int | None) -> None:
    sock = transport.get_extra_info("socket")
    if not timeout_s or sock is None:
        return
    try:
        for level, option, value in dead_peer_options(timeout_s):
            sock.setsockopt(level, option, value)
    except OSError as exc:  # a socket closed at once: nothing left to watch
        log.warning("no dead-peer detection on the connection from %s: %s", transport.get_extra_info("peername"),
                    exc)


class HardenedBinaryServer(BinaryServer):
    guard: ChannelGuard

    async def start(self) -> None:
        install_nesting_limit(self.guard.max_nesting_depth, self.guard.max_array_length)
        install_message_hmac()
        await super().start()

    def _make_protocol(self) -> OPCUAProtocol:
        protocol = HardenedProtocol(iserver=self.iserver, policies=self._policies, clients=self.clients,
                                    closing_tasks=self.closing_tasks, limits=self.limits)
        protocol.guard = self.guard
        return protocol


# ==============================================================================================================
# The server
#
# asyncua's Server, listening through the hardened binary server; InternalServer settings.

class AppServer(Server):
    """asyncua's Server, listening through the hardened binary server."""

    guard: ChannelGuard
    ca_certificate = None  # x509.Certificate of the appliance CA, presented after the server certificate

    async def start(self) -> None:
        await self._setup_server_nodes()
        if self.ca_certificate is not None:
            # Present the chain (server certificate, then CA) so a client that trusts the CA can verify us.
            ca_der = self.ca_certificate.public_bytes(serialization.Encoding.DER)
            for factory in self._policies:
                factory.certificate_chain = [self.ca_certificate]
            for edp in self.iserver.endpoints:
                if edp.ServerCertificate:
                    edp.ServerCertificate = edp.ServerCertificate + ca_der
        await self.iserver.start()
        try:
            host, port = self._get_bind_socket_info()
            self.bserver = HardenedBinaryServer(self.iserver, host, port, self.limits)
            self.bserver.guard = self.guard
            self.bserver.set_policies(self._policies)
            await self.bserver.start()
        except Exception:  # re-raised: the internal server does not outlive a failure to listen
            await self.iserver.stop()
            raise


def install_session_factory(server: Server, on_close, write_hook) -> None:
    """Every client session is an ApplianceSession; the processor validates certificates against our trust list."""
    iserver = server.iserver
    iserver.certificate_validator = None

    def create_session(name, user=None, external=False):
        session = ApplianceSession(iserver, iserver.aspace, iserver.subscription_service, name, external=external)
        session.on_close = on_close
        session.write_hook = write_hook()
        return session
    iserver.create_session = create_session


def configure_limits(server: Server, *, max_chunk_count: int, max_message_size: int, max_secure_channels: int,
                     session_activation_timeout_s: float, session_timeout_s: float) -> None:
    iserver = server.iserver
    server.limits = TransportLimits(max_recv_buffer=65535, max_send_buffer=65535, max_chunk_count=max_chunk_count,
                                    max_message_size=max_message_size)
    iserver.max_connections = max_secure_channels
    iserver.max_pending_activation_seconds = session_activation_timeout_s
    iserver.max_session_timeout_ms = session_timeout_s * 1000
    iserver.min_session_timeout_ms = min(iserver.min_session_timeout_ms, iserver.max_session_timeout_ms)


def advertise_host(server: Server, endpoint: str, socket_address: tuple) -> None:
    """Clients behind NAT: announce the configured address, not the one they dialled."""
    server.set_endpoint(endpoint)
    server.socket_address = socket_address
    server.iserver.match_discovery_endpoint_url = False
    server.iserver.match_discovery_source_ip = False



def listening_port(server: Server) -> int:
    """The TCP port the server listens on (0 when it does not)."""
    return server.bserver.port if server.bserver else 0
