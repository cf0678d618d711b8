"""The per-connection request processor, hardened where asyncua 2.1.0 leaves doors open.

- Sessions only over a secure channel whose policy and mode are configured; a None channel serves discovery only.
- CreateSession's ClientCertificate must be the secure channel's certificate, which must pass the trust list.
- Re-activation of a live session on a new channel only with the same client certificate; a failed attempt
  leaves the session where it was.
- Write and node management are refused to every client (the address space is read-only by design).
- Method calls run as tasks, so a client's parallel calls (an S7-1500 sends up to 5) reach the batcher together;
  at most `max_requests_per_session` are outstanding per session.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from asyncua import ua
from asyncua.common.utils import ServiceError
from asyncua.server.binary_server_asyncio import BinaryServer, OPCUAProtocol
from asyncua.server.uaprocessor import UaProcessor
from asyncua.ua.ua_binary import struct_from_binary

from .session import ApplianceSession, current_session

log = logging.getLogger(__name__)


def _ids(*names: str) -> frozenset:
    return frozenset(ua.NodeId(getattr(ua.ObjectIds, f"{n}Request_Encoding_DefaultBinary")) for n in names)


DISCOVERY = _ids("GetEndpoints", "FindServers", "FindServersOnNetwork", "CloseSecureChannel")
CREATE_SESSION = ua.NodeId(ua.ObjectIds.CreateSessionRequest_Encoding_DefaultBinary)
ACTIVATE_SESSION = ua.NodeId(ua.ObjectIds.ActivateSessionRequest_Encoding_DefaultBinary)
CALL = ua.NodeId(ua.ObjectIds.CallRequest_Encoding_DefaultBinary)
REFUSED = _ids("Write", "AddNodes", "DeleteNodes", "AddReferences", "DeleteReferences", "RegisterServer",
               "RegisterServer2", "HistoryUpdate")


def leaf_certificate(der_chain: bytes | None) -> bytes | None:
    """The first certificate of a DER chain (a ByteString may carry the whole chain)."""
    if not der_chain:
        return None
    if len(der_chain) < 4 or der_chain[0] != 0x30:
        return der_chain
    # DER SEQUENCE length: short form, or long form with 1..4 length bytes.
    first = der_chain[1]
    if first < 0x80:
        end = 2 + first
    else:
        n = first & 0x7F
        end = 2 + n + int.from_bytes(der_chain[2:2 + n], "big")
    return der_chain[:end]


@dataclass
class ChannelGuard:
    """What the processor enforces; built once by the server from the configuration."""

    allowed: frozenset  # {(policy URI, MessageSecurityMode)}
    # validate(cert_der, client_application_uri) -> OPC UA status name, "Good" when accepted
    validate_client_certificate: Callable[[bytes, str | None], str]
    max_sessions: int
    max_requests_per_session: int
    sessions: Callable[[], int]  # open external sessions now


class HardenedProcessor(UaProcessor):
    guard: ChannelGuard

    def _secure_enough(self) -> bool:
        policy = self._connection.security_policy
        return (policy.URI, policy.Mode) in self.guard.allowed

    async def _process_message(self, typeid, requesthdr, seqhdr, body):
        if typeid not in DISCOVERY and not self._secure_enough():
            log.warning("refused %s over an unconfigured secure channel from %s", typeid.Identifier, self.name)
            raise ServiceError(ua.StatusCodes.BadSecurityPolicyRejected)
        if typeid in REFUSED:
            raise ServiceError(ua.StatusCodes.BadUserAccessDenied)
        if typeid == CREATE_SESSION:
            return await self._create_session(typeid, requesthdr, seqhdr, body)
        if typeid == ACTIVATE_SESSION:
            return await self._activate_session(typeid, requesthdr, seqhdr, body)
        if typeid == CALL and self.session is not None and self.session.is_activated():
            return self._start_call(requesthdr, seqhdr, body)
        return await super()._process_message(typeid, requesthdr, seqhdr, body)

    async def _create_session(self, typeid, requesthdr, seqhdr, body):
        params = struct_from_binary(ua.CreateSessionParameters, body.copy())
        channel_cert = leaf_certificate(self._connection.security_policy.peer_certificate)
        if channel_cert is None or leaf_certificate(params.ClientCertificate) != channel_cert:
            log.warning("CreateSession from %s: certificate differs from the secure channel's", self.name)
            raise ServiceError(ua.StatusCodes.BadSecurityChecksFailed)
        status = self.guard.validate_client_certificate(channel_cert, params.ClientDescription.ApplicationUri)
        if status != "Good":
            log.warning("CreateSession from %s: client certificate refused (%s)", self.name, status)
            raise ServiceError(getattr(ua.StatusCodes, status, ua.StatusCodes.BadSecurityChecksFailed))
        if self.session is not None:
            # One session per connection: a second CreateSession would orphan the first.
            raise ServiceError(ua.StatusCodes.BadTooManySessions)
        if self.guard.sessions() >= self.guard.max_sessions:
            raise ServiceError(ua.StatusCodes.BadTooManySessions)
        result = await super()._process_message(typeid, requesthdr, seqhdr, body)
        if isinstance(self.session, ApplianceSession):
            self.session.channel_certificate = channel_cert
            self.session.client_uri = params.ClientDescription.ApplicationUri or ""
            self.session.peer = f"{self.name[0]}:{self.name[1]}" if isinstance(self.name, tuple) else str(self.name)
        return result

    async def _activate_session(self, typeid, requesthdr, seqhdr, body):
        reconnect = self.session is None
        if reconnect:
            existing = self.iserver.lookup_external_session(requesthdr.AuthenticationToken)
            channel_cert = leaf_certificate(self._connection.security_policy.peer_certificate)
            if (not isinstance(existing, ApplianceSession) or channel_cert is None
                    or existing.channel_certificate != channel_cert):
                raise ServiceError(ua.StatusCodes.BadSessionIdInvalid)
        watchdog_before = self._session_watchdog_task
        try:
            return await super()._process_message(typeid, requesthdr, seqhdr, body)
        except BaseException:
            if reconnect:
                # asyncua bound the session to this connection before activating it: undo that.
                self.session = None
                if self._session_watchdog_task is not watchdog_before and self._session_watchdog_task:
                    self._session_watchdog_task.cancel()
                    self._session_watchdog_task = watchdog_before
            raise

    def _start_call(self, requesthdr, seqhdr, body) -> bool:
        session = self.session
        assert isinstance(session, ApplianceSession)
        if session.outstanding_calls >= self.guard.max_requests_per_session:
            raise ServiceError(ua.StatusCodes.BadTooManyOperations)
        params = struct_from_binary(ua.CallParameters, body)
        session.touch()
        session.outstanding_calls += 1
        token = current_session.set(session)
        try:
            asyncio.get_running_loop().create_task(self._run_call(session, requesthdr, seqhdr, params))
        finally:
            current_session.reset(token)
        return True

    async def _run_call(self, session: ApplianceSession, requesthdr, seqhdr, params) -> None:
        try:
            results = await session.call(params.MethodsToCall)
            response = ua.CallResponse()
            response.Results = results
        except Exception:
            log.exception("call failed")
            response = ua.ServiceFault()
            response.ResponseHeader.ServiceResult = ua.StatusCode(ua.StatusCodes.BadInternalError)
        finally:
            session.outstanding_calls -= 1
        try:
            self.send_response(requesthdr.RequestHandle, seqhdr, response)
        except Exception:
            log.info("call answered after its connection closed")


class HardenedProtocol(OPCUAProtocol):
    guard: ChannelGuard

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.processor is not None:
            processor = HardenedProcessor(self.iserver, self.transport, self.limits)
            processor.guard = self.guard
            processor.set_policies(self.policies)
            self.processor = processor


class HardenedBinaryServer(BinaryServer):
    guard: ChannelGuard

    def _make_protocol(self) -> OPCUAProtocol:
        protocol = HardenedProtocol(iserver=self.iserver, policies=self._policies, clients=self.clients,
                                    closing_tasks=self.closing_tasks, limits=self.limits)
        protocol.guard = self.guard
        return protocol
