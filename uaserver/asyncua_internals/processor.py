"""The hardened per-connection request processor (item 3)."""
from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time

from asyncua import ua
from asyncua.common.utils import NotEnoughData, ServiceError
from asyncua.server.uaprocessor import UaProcessor
from asyncua.ua.ua_binary import struct_from_binary

from certs.x509io import thumbprint

from ..identity import LoginVerdict, login_verdict
from ..session import clean_audit_entry_id, current_audit_entry_id, current_session
from .channel import PEER_ERRORS, SIGNATURE_ERRORS, ChannelGuard, error_message, leaf_certificate, transport_status
from .decoding import cached_nodeid_from_binary, call_parameters_from_binary, request_header_from_binary, \
    response_to_binary
from .session_table import admit_identity, make_room
from .sessions import ApplianceSession

log = logging.getLogger(__name__)


# ==============================================================================================================
# The hardened processor
#
# The per-connection request processor, hardened where asyncua 2.1.0 leaves doors open.
#
# - Sessions only over a secure channel whose policy and mode are configured; a None channel serves discovery only.
# - CreateSession's ClientCertificate must be the secure channel's certificate, which must pass the trust list.
# - Re-activation of a live session on a new channel only with the same client certificate; a failed attempt
#   leaves the session where it was.
# - Node management is refused to every client; Write reaches only the mailboxes' inputs (ApplianceSession.write:
#   every other node is read-only by design).
# - Method calls run as tasks, so a client's parallel calls (an S7-1500 sends up to 5) reach the batcher together;
#   at most `max_requests_per_session` are outstanding per session.
# - User names and passwords only over SignAndEncrypt; the password hash is checked in a worker thread (scrypt takes
#   ~70 ms: on the event loop it would stall every client), its verdict handed to the user manager.
# - Malformed traffic closes the connection with a TCP ErrorMessage: a first message other than Hello, a chunk header
#   larger than the negotiated buffer (asyncua would buffer up to 4 GiB waiting for its body), a request header that
#   does not decode, a message nesting deeper than security.limits.max_nesting_depth (see decoding.py), anything the
#   transport layer cannot handle. asyncua alone logs such errors and keeps reading, leaving the client waiting.

def _ids(*names: str) -> frozenset:
    return frozenset(ua.NodeId(getattr(ua.ObjectIds, f"{n}Request_Encoding_DefaultBinary")) for n in names)


DISCOVERY = _ids("GetEndpoints", "FindServers", "FindServersOnNetwork", "CloseSecureChannel")
CREATE_SESSION = ua.NodeId(ua.ObjectIds.CreateSessionRequest_Encoding_DefaultBinary)
ACTIVATE_SESSION = ua.NodeId(ua.ObjectIds.ActivateSessionRequest_Encoding_DefaultBinary)
CALL = ua.NodeId(ua.ObjectIds.CallRequest_Encoding_DefaultBinary)
REFUSED = _ids("AddNodes", "DeleteNodes", "AddReferences", "DeleteReferences", "RegisterServer",
               "RegisterServer2", "HistoryUpdate")


OPERATION_LOCALIZED_TEXT = 0x40  # DiagnosticsMask bit: the client asks for each operation's text


def add_status_texts(response: ua.CallResponse) -> None:
    """Each result's status text (uaserver/methods.py's status_result) as its DiagnosticInfo's LocalizedText, an
    index into the response's string table (Part 4, 7.12): UaExpert and other clients show it beside the code."""
    texts = [getattr(r, "status_text", "") for r in response.Results]
    if not any(texts):
        return
    table: list[str] = []
    infos = []
    for text in texts:
        if text:
            table.append(text)
            infos.append(ua.DiagnosticInfo(LocalizedText=len(table) - 1))
        else:
            infos.append(ua.DiagnosticInfo())
    response.ResponseHeader.StringTable = table
    response.DiagnosticInfos = infos


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
    _calls: set[asyncio.Task] | None = None  # this connection's method calls in flight
    _activity: float | None = None

    # asyncua's per-connection watchdog closes the connection when the session was idle for its timeout: a
    # connection with a call running is not idle.
    @property
    def session_last_activity(self) -> float | None:
        return time.monotonic() if self._calls else self._activity

    @session_last_activity.setter
    def session_last_activity(self, value: float | None) -> None:
        self._activity = value

    async def close(self) -> None:
        """The connection is gone (closed, aborted, refused): nobody can receive the answers of its calls, so
        they are abandoned (their generation stops); the session itself outlives the connection until its timeout
        (see _should_close_session_on_transport_loss)."""
        for task in list(self._calls or ()):
            task.cancel()
        if isinstance(self.session, ApplianceSession) and self.session.channel is self:
            self.session.channel = None  # an orphan now, until re-activated on a new channel or timed out
        await super().close()

    def _should_close_session_on_transport_loss(self) -> bool:
        # asyncua closes a session without subscriptions at once when its connection drops. An activated client
        # session instead lives until its timeout, so a client whose connection broke re-activates it on a new
        # channel and keeps its conversation; InternalSession's own timeout loop closes it otherwise.
        if isinstance(self.session, ApplianceSession) and self.session.external and self.session.is_activated():
            return False
        return super()._should_close_session_on_transport_loss()

    def close_with_error(self, status: int, reason: str) -> bool:
        """Answer an ErrorMessage and tell the protocol to close (False, as asyncua's process() does)."""
        try:
            self._transport.write(error_message(status, reason))
        except RuntimeError as exc:  # asyncio refuses a write after EOF: the connection is closing anyway
            log.debug("no ErrorMessage to %s: %s", self.name, exc)
        return False

    def send_response(self, requesthandle, seqhdr, response, msgtype=ua.MessageType.SecureMessage):
        """UaProcessor.send_response, with a Call's answer encoded by response_to_binary below."""
        response.ResponseHeader.RequestHandle = requesthandle
        data = self._connection.message_to_binary(response_to_binary(response), message_type=msgtype,
                                                  request_id=seqhdr.RequestId)
        self._transport.write(data)

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
        except Exception as exc:  # noqa: BLE001 - asyncua would log and keep reading garbage: close instead; logged
            status = transport_status(exc)
            log.warning("closing the connection from %s: %s (%s)", self.name, type(exc).__name__,
                        ua.StatusCode(status).name, exc_info=not isinstance(exc, PEER_ERRORS))
            return self.close_with_error(status, ua.StatusCode(status).name)

    async def process_message(self, seqhdr, body):
        try:
            typeid = cached_nodeid_from_binary(body)
            requesthdr = request_header_from_binary(body)
        except PEER_ERRORS as exc:  # no request handle to answer with: close instead
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
        except Exception:  # noqa: BLE001 - every request is answered: a service's bug is a logged BadInternalError
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
        if (self.guard.sessions() >= self.guard.max_sessions
                and not await make_room(self.iserver, self.guard.max_sessions, channel_cert)):
            raise ServiceError(ua.StatusCodes.BadTooManySessions)  # every session has a live channel
        result = await super()._process_message(typeid, requesthdr, seqhdr, body)
        if isinstance(self.session, ApplianceSession):
            self.session.channel = self
            self.session.admission = functools.partial(admit_identity, self.iserver,
                                                       self.guard.max_sessions_per_client)
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
            try:
                result = await super()._process_message(typeid, requesthdr, seqhdr, body)
            except SIGNATURE_ERRORS as exc:  # a ClientSignature that does not verify (made for an older certificate)
                raise ServiceError(ua.StatusCodes.BadApplicationSignatureInvalid) from exc
            if isinstance(session, ApplianceSession):
                session.channel = self
                self.guard.record("login", session=session,
                                  detail=f"{_token_kind(params.UserIdentityToken)} from {session.peer}"
                                  + (" (re-activated on a new channel)" if reconnect else ""))
            return result
        except BaseException as exc:  # re-raised below: audited and undone on every way out, cancellation included
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
        except (ValueError, TypeError, struct.error):  # undecryptable, no password, too short, not UTF-8
            return None  # asyncua's own path decrypts again and answers BadIdentityTokenInvalid
        if not isinstance(username, str) or not isinstance(password, str):
            return None
        role = await asyncio.to_thread(check, username, password, session.peer)
        return LoginVerdict(username=username, password=password, role=role)

    def _start_call(self, requesthdr, seqhdr, body) -> bool:
        session = self.session
        assert isinstance(session, ApplianceSession)
        if session.outstanding_calls >= self.guard.max_requests_per_session:
            raise ServiceError(ua.StatusCodes.BadTooManyOperations)
        try:
            params = call_parameters_from_binary(body)
        except ua.UaStatusCodeError:
            raise
        except ua.UaError as e:  # asyncua's decoders refuse what lies (e.g. ArrayDimensions beyond the elements sent)
            raise ServiceError(ua.StatusCodes.BadDecodingError) from e
        session.touch()
        session.outstanding_calls += 1
        token = current_session.set(session)
        entry = current_audit_entry_id.set(clean_audit_entry_id(requesthdr.AuditEntryId))
        try:
            task = asyncio.get_running_loop().create_task(self._run_call(session, requesthdr, seqhdr, params))
        finally:
            current_audit_entry_id.reset(entry)
            current_session.reset(token)
        if self._calls is None:
            self._calls = set()
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return True

    async def _run_call(self, session: ApplianceSession, requesthdr, seqhdr, params) -> None:
        try:
            results = await session.call(params.MethodsToCall)
            response = ua.CallResponse()
            response.Results = results
            if requesthdr.ReturnDiagnostics & OPERATION_LOCALIZED_TEXT:
                add_status_texts(response)
        except Exception:  # noqa: BLE001 - every call is answered: a failure is a logged BadInternalError
            log.exception("call failed")
            response = ua.ServiceFault()
            response.ResponseHeader.ServiceResult = ua.StatusCode(ua.StatusCodes.BadInternalError)
        finally:
            session.outstanding_calls -= 1
            session.touch()  # in use until its call ended: the session timeout counts from here, not from the call
            self.session_last_activity = time.monotonic()
        if self._transport is None or self._transport.is_closing():
            return  # the connection went while the call ran: nobody to answer
        try:
            self.send_response(requesthdr.RequestHandle, seqhdr, response)
        except Exception:  # noqa: BLE001 - every call is answered: an answer that cannot be encoded becomes a fault
            log.exception("the answer to a call from %s could not be encoded: answering BadInternalError", self.name)
            fault = ua.ServiceFault()
            fault.ResponseHeader.ServiceResult = ua.StatusCode(ua.StatusCodes.BadInternalError)
            self.send_response(requesthdr.RequestHandle, seqhdr, fault)
