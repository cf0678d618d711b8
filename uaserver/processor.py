"""The per-connection request processor, hardened where asyncua 2.1.0 leaves doors open.

- Sessions only over a secure channel whose policy and mode are configured; a None channel serves discovery only.
- CreateSession's ClientCertificate must be the secure channel's certificate, which must pass the trust list.
- Re-activation of a live session on a new channel only with the same client certificate; a failed attempt
  leaves the session where it was.
- Write and node management are refused to every client (the address space is read-only by design).
- Method calls run as tasks, so a client's parallel calls (an S7-1500 sends up to 5) reach the batcher together;
  at most `max_requests_per_session` are outstanding per session.
- User names and passwords only over SignAndEncrypt; the password hash is checked in a worker thread (scrypt takes
  ~70 ms: on the event loop it would stall every client), its verdict handed to the user manager.
- Malformed traffic closes the connection with a TCP ErrorMessage: a first message other than Hello, a chunk header
  larger than the negotiated buffer (asyncua would buffer up to 4 GiB waiting for its body), a request header that
  does not decode, a message nesting deeper than security.limits.max_nesting_depth (see limits.py), anything the
  transport layer cannot handle. asyncua alone logs such errors and keeps reading, leaving the client waiting.
"""
from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from asyncua import ua
from asyncua.common.utils import NotEnoughData, ServiceError
from asyncua.server.binary_server_asyncio import BinaryServer, OPCUAProtocol
from asyncua.server.uaprocessor import UaProcessor
from asyncua.ua.ua_binary import nodeid_from_binary, struct_from_binary, uatcp_to_binary
from cryptography.exceptions import InvalidSignature

from .identity import LoginVerdict, login_verdict
from .limits import DEFAULT_MAX_NESTING_DEPTH, install_nesting_limit
from .session import ApplianceSession, clean_audit_entry_id, current_audit_entry_id, current_session, thumbprint

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
    max_nesting_depth: int = DEFAULT_MAX_NESTING_DEPTH
    max_array_length: int | None = None  # bounds the elements a Variant's ArrayDimensions may declare
    # Check passwords in a worker thread (False: on the event loop, as asyncua would; kept for measurements).
    offload_password_check: bool = True
    # audit(event, session=..., status=..., detail=..., **fields): logins, refused certificates, sessions
    audit: Callable[..., None] | None = None

    def record(self, event: str, **fields) -> None:
        if self.audit is not None:
            try:
                self.audit(event, **fields)
            except Exception:  # noqa: BLE001 - auditing never breaks the protocol
                log.exception("audit of %s failed", event)


def error_message(status: int, reason: str) -> bytes:
    """A UA TCP ErrorMessage (Part 6, 7.1.2.5): the server's last word before it closes a connection."""
    return uatcp_to_binary(ua.MessageType.Error, ua.ErrorMessage(ua.StatusCode(status), reason))


def transport_status(exc: BaseException) -> int:
    """The status code for an error the transport layer raised; never reveals more than its name."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    if isinstance(exc, InvalidSignature):
        return ua.StatusCodes.BadSecurityChecksFailed
    if isinstance(exc, ua.UaError) and "No matching policy" in str(exc):
        return ua.StatusCodes.BadSecurityPolicyRejected
    return ua.StatusCodes.BadDecodingError


def _token_kind(token) -> str:
    return ("x509" if isinstance(token, ua.X509IdentityToken) else
            "username" if isinstance(token, ua.UserNameIdentityToken) else "anonymous")


def _claimed_user(token) -> str:
    """Who a refused login claimed to be, for the audit log: never the password."""
    if isinstance(token, ua.UserNameIdentityToken):
        name = token.UserName if isinstance(token.UserName, str) else ""
        return f"user:{name[:64]}"
    if isinstance(token, ua.X509IdentityToken):
        return f"x509:{thumbprint(leaf_certificate(token.CertificateData))}"
    return "anonymous"


class HardenedProcessor(UaProcessor):
    guard: ChannelGuard
    _hello_seen: bool = False

    def close_with_error(self, status: int, reason: str) -> bool:
        """Answer an ErrorMessage and tell the protocol to close (False, as asyncua's process() does)."""
        try:
            self._transport.write(error_message(status, reason))
        except Exception:  # the transport may be gone already
            pass
        return False

    async def process(self, header, body):
        if not self._hello_seen:
            if header.MessageType != ua.MessageType.Hello:
                log.warning("connection from %s did not start with Hello", self.name)
                return self.close_with_error(ua.StatusCodes.BadTcpMessageTypeInvalid, "expected Hello")
            self._hello_seen = True
        elif header.MessageType == ua.MessageType.Hello:
            return self.close_with_error(ua.StatusCodes.BadTcpMessageTypeInvalid, "unexpected Hello")
        try:
            return await super().process(header, body)
        except Exception as exc:  # asyncua would log it and keep reading from a peer that sends garbage
            status = transport_status(exc)
            log.warning("closing the connection from %s: %s (%s)", self.name, type(exc).__name__,
                        ua.StatusCode(status).name)
            return self.close_with_error(status, ua.StatusCode(status).name)

    async def process_message(self, seqhdr, body):
        try:
            typeid = nodeid_from_binary(body)
            requesthdr = struct_from_binary(ua.RequestHeader, body)
        except Exception as exc:  # no request handle to answer with: close instead
            status = transport_status(exc) if isinstance(exc, ua.UaStatusCodeError) else ua.StatusCodes.BadDecodingError
            log.warning("undecodable request header from %s (%s)", self.name, type(exc).__name__)
            return self.close_with_error(status, ua.StatusCode(status).name)
        return await self._process_decoded(typeid, requesthdr, seqhdr, body)

    async def _process_decoded(self, typeid, requesthdr, seqhdr, body):
        try:
            return await self._process_message(typeid, requesthdr, seqhdr, body)
        except (ServiceError, ua.uaerrors.UaStatusCodeError) as e:
            status = ua.StatusCode(e.code)
            if not isinstance(e, ServiceError) or status.value != ua.StatusCodes.BadSecurityPolicyRejected:
                log.info("service fault to %s: %s", self.name, status.name)
        except (NotEnoughData, struct.error, UnicodeDecodeError, RecursionError) as e:  # a body that lies
            log.info("undecodable %s from %s: %s", typeid, self.name, type(e).__name__)
            status = ua.StatusCode(ua.StatusCodes.BadDecodingError)
        except Exception:
            log.exception("request from %s failed", self.name)
            status = ua.StatusCode(ua.StatusCodes.BadInternalError)
        response = ua.ServiceFault()
        response.ResponseHeader.ServiceResult = status
        self.send_response(requesthdr.RequestHandle, seqhdr, response)
        return True

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
        peer = f"{self.name[0]}:{self.name[1]}" if isinstance(self.name, tuple) else str(self.name)
        if channel_cert is None or leaf_certificate(params.ClientCertificate) != channel_cert:
            log.warning("CreateSession from %s: certificate differs from the secure channel's", self.name)
            self.guard.record("certificate_refused", status="BadSecurityChecksFailed", client=thumbprint(channel_cert),
                              detail=f"from {peer}: CreateSession certificate differs from the secure channel's")
            raise ServiceError(ua.StatusCodes.BadSecurityChecksFailed)
        status = self.guard.validate_client_certificate(channel_cert, params.ClientDescription.ApplicationUri)
        if status != "Good":
            log.warning("CreateSession from %s: client certificate refused (%s)", self.name, status)
            self.guard.record("certificate_refused", status=status, client=thumbprint(channel_cert),
                              detail=f"from {peer}: application certificate refused (copied to pki/rejected)")
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
            self.session.peer = peer
            self.guard.record("session_open", session=self.session, user="", role="",
                              detail=f"from {peer}, application {self.session.client_uri}")
        return result

    async def _activate_session(self, typeid, requesthdr, seqhdr, body):
        params = struct_from_binary(ua.ActivateSessionParameters, body.copy())
        reconnect = self.session is None
        session = self.session
        if reconnect:
            session = self.iserver.lookup_external_session(requesthdr.AuthenticationToken)
            channel_cert = leaf_certificate(self._connection.security_policy.peer_certificate)
            if (not isinstance(session, ApplianceSession) or channel_cert is None
                    or session.channel_certificate != channel_cert):
                raise ServiceError(ua.StatusCodes.BadSessionIdInvalid)
        verdict = None
        if isinstance(params.UserIdentityToken, ua.UserNameIdentityToken):
            if self._connection.security_policy.Mode != ua.MessageSecurityMode.SignAndEncrypt:
                # Passwords only over an encrypted channel (the contract), whatever the token's own encryption.
                raise ServiceError(ua.StatusCodes.BadSecurityModeInsufficient)
            if self.guard.offload_password_check:
                verdict = await self._check_password(session, params.UserIdentityToken)
        # asyncua re-points a live session's subscriptions at this connection before it checks anything: remember
        # where they pointed, so that a failed re-activation leaves them with their owner.
        subscriptions = [(sub, sub.pub_result_callback, sub.pub_request_callback)
                         for sub in self.iserver.subscription_service.subscriptions.values()
                         if reconnect and sub.session_id == session.session_id]
        watchdog_before = self._session_watchdog_task
        verdict_token = login_verdict.set(verdict)
        try:
            result = await super()._process_message(typeid, requesthdr, seqhdr, body)
            if isinstance(session, ApplianceSession):
                self.guard.record("login", session=session,
                                  detail=f"{_token_kind(params.UserIdentityToken)} from {session.peer}"
                                  + (" (re-activated on a new channel)" if reconnect else ""))
            return result
        except BaseException as exc:
            if isinstance(session, ApplianceSession) and not isinstance(exc, asyncio.CancelledError):
                code = getattr(exc, "code", None)
                self.guard.record("login_failed", session=session, role="",
                                  user=_claimed_user(params.UserIdentityToken),
                                  status=ua.StatusCode(code).name if isinstance(code, int) else "BadIdentityTokenRejected",
                                  detail=f"{_token_kind(params.UserIdentityToken)} from {session.peer}")
            if reconnect:
                # asyncua bound the session to this connection before activating it: undo that.
                self.session = None
                for sub, on_result, on_request in subscriptions:
                    sub.pub_result_callback, sub.pub_request_callback = on_result, on_request
                if self._session_watchdog_task is not watchdog_before and self._session_watchdog_task:
                    self._session_watchdog_task.cancel()
                    self._session_watchdog_task = watchdog_before
            raise
        finally:
            login_verdict.reset(verdict_token)

    async def _check_password(self, session: ApplianceSession, token: ua.UserNameIdentityToken):
        """Decrypt the token and verify the password off the event loop; None leaves it to the user manager."""
        manager = self.iserver.user_manager
        check = getattr(manager, "check_password", None)
        if check is None:
            return None
        try:
            username, password = self.iserver.decrypt_user_token(session, token)
        except Exception:
            return None  # asyncua's own path answers BadIdentityTokenInvalid
        if not isinstance(username, str) or not isinstance(password, str):
            return None
        role = await asyncio.to_thread(check, username, password, session.peer)
        return LoginVerdict(username=username, password=password, role=role)

    def _start_call(self, requesthdr, seqhdr, body) -> bool:
        session = self.session
        assert isinstance(session, ApplianceSession)
        if session.outstanding_calls >= self.guard.max_requests_per_session:
            raise ServiceError(ua.StatusCodes.BadTooManyOperations)
        params = struct_from_binary(ua.CallParameters, body)
        session.touch()
        session.outstanding_calls += 1
        token = current_session.set(session)
        entry = current_audit_entry_id.set(clean_audit_entry_id(requesthdr.AuditEntryId))
        try:
            asyncio.get_running_loop().create_task(self._run_call(session, requesthdr, seqhdr, params))
        finally:
            current_audit_entry_id.reset(entry)
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
        super().connection_made(transport)
        if self.processor is not None:
            processor = HardenedProcessor(self.iserver, self.transport, self.limits)
            processor.guard = self.guard
            processor.set_policies(self.policies)
            self.processor = processor


class HardenedBinaryServer(BinaryServer):
    guard: ChannelGuard

    async def start(self) -> None:
        install_nesting_limit(self.guard.max_nesting_depth, self.guard.max_array_length)
        await super().start()

    def _make_protocol(self) -> OPCUAProtocol:
        protocol = HardenedProtocol(iserver=self.iserver, policies=self._policies, clients=self.clients,
                                    closing_tasks=self.closing_tasks, limits=self.limits)
        protocol.guard = self.guard
        return protocol
