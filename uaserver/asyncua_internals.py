"""Everything of the appliance that reaches into asyncua's private parts, in one file.

Written for asyncua ASYNCUA_VERSION exactly: importing this module with another version installed raises
AsyncuaVersionError naming both, so that an upgrade of asyncua is one file to review (and `pyproject.toml` pins it).

What is here, and which asyncua internals it relies on:
1. The decoder's nesting limit: patches asyncua.ua.ua_binary's decoders and their caches (below).
2. ApplianceSession: a subclass of asyncua.server.internal_session.InternalSession (re-registers its ids with the
   InternalServer, wraps activate_session, close_session and write).
3. The hardened processor: subclasses of UaProcessor, OPCUAProtocol and BinaryServer overriding _process_message,
   data_received, connection_made and _make_protocol, reading _connection, _buffer, _limits, session.
4. AppServer: asyncua's Server.start re-done (_setup_server_nodes, _policies, _get_bind_socket_info, bserver) to
   listen through the hardened BinaryServer and present the certificate chain; configure_limits and
   install_session_factory set InternalServer attributes (certificate_validator, create_session, max_connections,
   pending activation and session timeouts, discovery matching).
5. write_together: sets several Value attributes in the address space (AddressSpace._nodes, AttributeValue) before
   any data-change callback runs, so the changes land in one publish of every subscription.
6. external_sessions: the server's registry of client sessions (InternalServer._external_sessions);
   subscription_of: the subscription service's registry (SubscriptionService.subscriptions, .session_id);
   instantiate_many: copies of an instantiated object from its NodeData (AddressSpace._nodes) through the
   InternalServer's own session (AddNodes). A session outlives its connection until its timeout
   (UaProcessor._should_close_session_on_transport_loss, close).
7. install_message_hmac: replaces asyncua.crypto.uacrypto.hmac_sha256 and security_policies.VerifierHMac256.verify.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import importlib.metadata
import logging
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

ASYNCUA_VERSION = "2.1.0"


class AsyncuaVersionError(ImportError):
    """The installed asyncua is not the version the appliance's asyncua internals were written for."""


def check_asyncua_version(installed: str | None = None) -> None:
    """Raise AsyncuaVersionError unless asyncua ASYNCUA_VERSION is installed (or `installed` is it, for tests)."""
    if installed is None:
        try:
            installed = importlib.metadata.version("asyncua")
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
    if installed != ASYNCUA_VERSION:
        raise AsyncuaVersionError(
            f"the appliance's OPC UA server was written for asyncua {ASYNCUA_VERSION}, but asyncua {installed} is "
            f"installed: install asyncua=={ASYNCUA_VERSION} (`pip install asyncua=={ASYNCUA_VERSION}`), or review "
            "uaserver/asyncua_internals.py against the new version and change ASYNCUA_VERSION there")


# Before anything of asyncua's internals is imported: a moved or renamed module should not be the first error seen.
check_asyncua_version()

from asyncua import Server, ua  # noqa: E402
from asyncua.common.connection import TransportLimits  # noqa: E402
from asyncua.common.utils import NotEnoughData, ServiceError  # noqa: E402
from asyncua.crypto import security_policies, uacrypto  # noqa: E402
from asyncua.server.binary_server_asyncio import BinaryServer, OPCUAProtocol  # noqa: E402
from asyncua.server.internal_session import InternalSession  # noqa: E402
from asyncua.server.uaprocessor import UaProcessor  # noqa: E402
from asyncua.ua import ua_binary  # noqa: E402
from asyncua.ua.ua_binary import (  # noqa: E402
    Primitives, nodeid_from_binary, nodeid_to_binary, struct_from_binary, struct_to_binary, uatcp_to_binary)
from asyncua.ua.uaerrors import BadDecodingError  # noqa: E402
import numpy as np  # noqa: E402
from cryptography.exceptions import InvalidSignature  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402

from certs.x509io import thumbprint  # noqa: E402

from .identity import LoginVerdict, login_verdict  # noqa: E402
from .session import (  # noqa: E402
    ActivationContext, ApplianceUser, activation_context, clean_audit_entry_id, current_audit_entry_id,
    current_session, random_node_id)

log = logging.getLogger(__name__)


# ==============================================================================================================
# 1. The decoder's nesting limit
#
# A bound on how deeply a received message may nest Variants, ExtensionObjects, DataValues and DiagnosticInfos.
#
# asyncua decodes those recursively (ua_binary.variant_from_binary -> unpack_uatype -> extensionobject_from_binary ->
# struct decoders -> variant_from_binary ...; DiagnosticInfo holds an InnerDiagnosticInfo), so a crafted message of a
# few kilobytes could drive the decoder as deep as Python's recursion limit allows. No method of the appliance takes
# anything but scalars and one-dimensional arrays of built-in types, and no service needs more than a few levels.
#
# `install_nesting_limit(depth)` patches asyncua's binary decoder FOR THE WHOLE PROCESS (clients in the same process
# included): each of those decoders counts its depth in a contextvar and raises NestingTooDeep (BadDecodingError)
# past the limit. The server calls it once at start; calling it again only changes the limit. The decoders asyncua
# builds are cached closures that captured the original functions, so the caches are cleared once after patching.

DEFAULT_MAX_NESTING_DEPTH = 8


class NestingTooDeep(BadDecodingError):
    """A message nests deeper than security.limits.max_nesting_depth."""


_depth: contextvars.ContextVar[int] = contextvars.ContextVar("ua_decode_depth", default=0)
_limit = DEFAULT_MAX_NESTING_DEPTH
_install_lock = threading.Lock()
_installed = False
# Structures whose decoders recurse without passing through a Variant or an ExtensionObject.
_COUNTED_STRUCTS = ("DataValue", "DiagnosticInfo")
_ASYNCUA_MAX_RESHAPE_ELEMENTS = ua_binary.MAX_RESHAPE_ELEMENTS


def max_nesting_depth() -> int:
    return _limit


def _counted(decode: Callable) -> Callable:
    @functools.wraps(decode)
    def counted(data):
        depth = _depth.get() + 1
        if depth > _limit:
            raise NestingTooDeep(f"message nests deeper than {_limit} levels")
        token = _depth.set(depth)
        try:
            return decode(data)
        finally:
            _depth.reset(token)
    counted.__wrapped_by_nesting_limit__ = True  # type: ignore[attr-defined]
    return counted


def install_nesting_limit(depth: int, max_array_length: int | None = None) -> None:
    """Enforce `depth` from now on in this process (see the module docstring). With max_array_length, a Variant's
    ArrayDimensions may also declare no more elements than that (asyncua pads a short array with empty lists up to
    the declared size: up to a million of them, ~60 MB, per message by default)."""
    global _limit, _installed
    if depth < 1:
        raise ValueError("max_nesting_depth must be >= 1")
    with _install_lock:
        _limit = int(depth)
        if max_array_length is not None:
            ua_binary.MAX_RESHAPE_ELEMENTS = min(_ASYNCUA_MAX_RESHAPE_ELEMENTS, int(max_array_length))
        if _installed:
            return
        ua_binary.variant_from_binary = _counted(ua_binary.variant_from_binary)
        ua_binary.extensionobject_from_binary = _counted(ua_binary.extensionobject_from_binary)
        original_dataclass = ua_binary._create_dataclass_deserializer

        @functools.cache
        def dataclass_deserializer(objtype):
            decode = original_dataclass(objtype)
            name = objtype if isinstance(objtype, str) else getattr(objtype, "__name__", "")
            return _counted(decode) if name in _COUNTED_STRUCTS else decode

        ua_binary._create_dataclass_deserializer = dataclass_deserializer
        # Every cached decoder built so far holds the unpatched functions: forget them.
        for creator in (original_dataclass, ua_binary._create_uatype_deserializer,
                        ua_binary._create_uatype_array_deserializer, ua_binary._create_type_deserializer,
                        ua_binary._create_list_deserializer):
            creator.cache_clear()
        _installed = True


# ==============================================================================================================
# 2. The session
#
# asyncua numbers sessions and authentication tokens sequentially (guessable); here both are 32 random bytes. The
# session remembers the certificate of the secure channel it was created on, so that a re-activation on a new channel
# is accepted only from the same client certificate and user (see the processor).

# A write to a node the appliance lets clients write (a mailbox's inputs): (session, WriteValue) -> its status, or
# None when the node is not one of them.
WriteHook = Callable[["ApplianceSession", ua.WriteValue], Awaitable["ua.StatusCode | None"]]


class ApplianceSession(InternalSession):
    on_close: Callable[["ApplianceSession"], None] | None = None
    write_hook: WriteHook | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Replace the sequential ids asyncua assigned (it registered the token already: move the registration).
        if self.external:
            self.iserver.unregister_external_session(self)
        self.session_id = random_node_id()
        self.auth_token = random_node_id()
        if self.external:
            self.iserver.register_external_session(self)
        self.key = self.session_id.Identifier.hex()  # stable printable key (KV slots, audit)
        self.channel_certificate: bytes | None = None  # DER of the secure channel's client certificate
        self._thumbprint, self._thumbprint_of = "", object()  # client_thumbprint and the certificate it is of
        self.client_uri: str = ""
        self.peer: str = ""
        self.outstanding_calls = 0
        self._close_hooks_ran = False

    # asyncua's session timeout loop measures inactivity from _last_activity: a session with a call running is
    # active (a Generate may run longer than the session timeout, and closing the session would abandon it).
    @property
    def _last_activity(self) -> float:
        return time.monotonic() if getattr(self, "outstanding_calls", 0) else self._activity

    @_last_activity.setter
    def _last_activity(self, value: float) -> None:
        self._activity = value

    @property
    def role(self) -> str | None:
        return self.user.appliance_role if isinstance(self.user, ApplianceUser) else None

    @property
    def identity(self) -> str:
        return self.user.identity if isinstance(self.user, ApplianceUser) else "none"

    @property
    def client_thumbprint(self) -> str:
        """Asked on every call (rate limit, audit): computed once per certificate the session is bound to."""
        cert = self.channel_certificate
        if self._thumbprint_of is not cert:
            self._thumbprint, self._thumbprint_of = thumbprint(cert), cert
        return self._thumbprint

    def activate_session(self, params: ua.ActivateSessionParameters, peer_certificate: bytes | None):
        previous_user, previous_nonce, was_active = self.user, self.nonce, self.is_activated()
        token = params.UserIdentityToken
        kind = ("x509" if isinstance(token, ua.X509IdentityToken) else
                "username" if isinstance(token, ua.UserNameIdentityToken) else "anonymous")
        ctx = activation_context.set(ActivationContext(kind=kind, peer=self.peer))
        try:
            result = super().activate_session(params, peer_certificate)
        finally:
            activation_context.reset(ctx)
        if was_active and self.identity != getattr(previous_user, "identity", None):
            # Re-activation may renew a session, never hand it to another user; the owner's nonce stays valid.
            self.user, self.nonce = previous_user, previous_nonce
            raise ServiceError(ua.StatusCodes.BadUserAccessDenied)
        return result

    async def write(self, params: ua.WriteParameters) -> list[ua.StatusCode]:
        """Only the mailboxes' inputs are writable, by the roles and identities the YAML names; every other node is
        read-only (BadUserAccessDenied), whatever its AccessLevel says. The items are handled in their order, so a
        client may write Input and Request in one Write."""
        results = []
        for value in params.NodesToWrite:
            status = await self.write_hook(self, value) if self.write_hook is not None else None
            results.append(status if status is not None else ua.StatusCode(ua.StatusCodes.BadUserAccessDenied))
        return results

    async def create_subscription(self, params: ua.CreateSubscriptionParameters, callback, request_callback=None):
        params.RequestedPublishingInterval = _publishing_interval(params.RequestedPublishingInterval)
        return await super().create_subscription(params, callback, request_callback)

    def modify_subscription(self, params: ua.ModifySubscriptionParameters):
        params.RequestedPublishingInterval = _publishing_interval(params.RequestedPublishingInterval)
        return super().modify_subscription(params)

    async def close_session(self, delete_subs: bool = True) -> None:
        await super().close_session(delete_subs)
        # Every close path (CloseSession, timeout, lost connection, shutdown) ends here: free what the session owns.
        if not self._close_hooks_ran:
            self._close_hooks_ran = True
            if self.on_close is not None:
                try:
                    self.on_close(self)
                except Exception:  # noqa: BLE001 - the appliance's hook must not stop the close; logged
                    log.exception("session close hook failed")


# asyncua publishes at once on every data change when a subscription's interval is 0, which would split a result
# written in one update (a mailbox's) over several publishes; it also lets one client wake the server without bound.
MIN_PUBLISHING_INTERVAL_MS = 1.0


def _publishing_interval(requested: float) -> float:
    if requested != requested or requested < MIN_PUBLISHING_INTERVAL_MS:  # NaN, 0, negative: the minimum
        return MIN_PUBLISHING_INTERVAL_MS
    return requested


# ==============================================================================================================
# 3. The hardened processor
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
#   does not decode, a message nesting deeper than security.limits.max_nesting_depth (see section 1), anything the
#   transport layer cannot handle. asyncua alone logs such errors and keeps reading, leaving the client waiting.

def _ids(*names: str) -> frozenset:
    return frozenset(ua.NodeId(getattr(ua.ObjectIds, f"{n}Request_Encoding_DefaultBinary")) for n in names)


DISCOVERY = _ids("GetEndpoints", "FindServers", "FindServersOnNetwork", "CloseSecureChannel")
CREATE_SESSION = ua.NodeId(ua.ObjectIds.CreateSessionRequest_Encoding_DefaultBinary)
ACTIVATE_SESSION = ua.NodeId(ua.ObjectIds.ActivateSessionRequest_Encoding_DefaultBinary)
CALL = ua.NodeId(ua.ObjectIds.CallRequest_Encoding_DefaultBinary)
REFUSED = _ids("AddNodes", "DeleteNodes", "AddReferences", "DeleteReferences", "RegisterServer",
               "RegisterServer2", "HistoryUpdate")
# What asyncua's decoding and security layers raise for bytes a peer made up (seen in tests/test_attacks_*.py:
# UaError and its status-code subclasses, NotEnoughData, struct.error, ValueError; a failed signature from the
# channel's crypto; RecursionError past Python's own limit). Logged in one line; anything else with its traceback.
# A failed signature is either exception: `cryptography`'s (asymmetric, OpenSecureChannel) or the one asyncua's
# uacrypto defines for itself and raises for a message's HMAC.
SIGNATURE_ERRORS = (InvalidSignature, uacrypto.InvalidSignature)
PEER_ERRORS = (ua.UaError, NotEnoughData, struct.error, ValueError, *SIGNATURE_ERRORS, RecursionError)


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
    if isinstance(exc, SIGNATURE_ERRORS):
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
            typeid = nodeid_from_binary(body)
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
        params = call_parameters_from_binary(body)
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


# ---- the Call service's own encodings ----
# What every method call decodes and encodes, written out: byte for byte as asyncua's generic codec, without its walk
# over dataclass fields (profiled with bench/ua_overhead.py: the request header's decode was 11 us and the answer's
# encode 12 us of a call's ~400 us in the serve process; 8 and 6 us now). Anything unusual (diagnostics, a string
# table, an additional header in an answer) goes to asyncua's own codec; tests/test_call_codec.py compares both
# codecs over many shapes of request and answer. Nested structures in a request still go through ua_binary's module
# functions, so the nesting limit installed above applies.

_ARRAY, _DIMENSIONS = 0x80, 0x40  # a Variant's encoding mask: an array; with dimensions
_NUMPY_ARRAYS = {ua.VariantType.Float.value: "<f4", ua.VariantType.Double.value: "<f8"}
_HANDLE_DIAGNOSTICS = struct.Struct("<II")
_INT32 = struct.Struct("<i")
_UINT32 = struct.Struct("<I")
_NO_DIAGNOSTICS = b"\x00"  # a DiagnosticInfo with no field set
_EMPTY = _INT32.pack(0)  # an empty array
_NULL_EXTENSION = b"\x00\x00\x00"  # a null ExtensionObject: TwoByte NodeId 0, no body
_EMPTY_DIAGNOSTICS = ua.DiagnosticInfo()
_NULL_NODE = ua.NodeId()


def request_header_from_binary(body) -> ua.RequestHeader:
    """struct_from_binary(ua.RequestHeader, body)."""
    token = nodeid_from_binary(body)
    timestamp = Primitives.DateTime.unpack(body)
    handle, diagnostics = _HANDLE_DIAGNOSTICS.unpack(body.read(8))
    audit_entry_id = Primitives.String.unpack(body)
    timeout = Primitives.UInt32.unpack(body)
    if body.copy(3).read(3) == _NULL_EXTENSION:  # what every client sends: asyncua answers ExtensionObject()
        body.skip(3)
        additional = ua.ExtensionObject()
    else:
        additional = ua_binary.extensionobject_from_binary(body)
    return ua.RequestHeader(AuthenticationToken=token, Timestamp=timestamp, RequestHandle=handle,
                            ReturnDiagnostics=diagnostics, AuditEntryId=audit_entry_id, TimeoutHint=timeout,
                            AdditionalHeader=additional)


def call_parameters_from_binary(body) -> ua.CallParameters:
    """A Call request's parameters, decoded as asyncua decodes them, except that a one-dimensional Float or Double
    array argument becomes a numpy array straight from the bytes: asyncua makes a list of Python floats (23 us for
    a TE sample of 1040) that the handler then turns into an array (22 us more), per call."""
    params = ua.CallParameters()
    for _ in range(Primitives.Int32.unpack(body)):
        item = ua.CallMethodRequest()
        item.ObjectId = nodeid_from_binary(body)
        item.MethodId = nodeid_from_binary(body)
        item.InputArguments = [_argument_from_binary(body) for _ in range(Primitives.Int32.unpack(body))]
        params.MethodsToCall.append(item)
    return params


def _argument_from_binary(body) -> ua.Variant:
    encoding = body.copy(1).read(1)[0]  # peeked: asyncua's decoder reads it again when it takes over
    dtype = _NUMPY_ARRAYS.get(encoding & 0x3F)
    if dtype is None or not encoding & _ARRAY or encoding & _DIMENSIONS:
        return ua_binary.variant_from_binary(body)
    body.read(1)
    length = Primitives.Int32.unpack(body)
    if length < 0:
        return ua.Variant(None, ua.VariantType(encoding & 0x3F), is_array=True)
    values = np.frombuffer(body.read(length * int(dtype[-1])), dtype=dtype).copy()
    return ua.Variant(values, ua.VariantType(encoding & 0x3F), is_array=True)


def response_to_binary(response) -> bytes:
    """struct_to_binary(response): a CallResponse written out, any other response by asyncua."""
    if type(response) is not ua.CallResponse or not _plain(response):
        return struct_to_binary(response)
    header = response.ResponseHeader
    parts = [nodeid_to_binary(response.TypeId), Primitives.DateTime.pack(header.Timestamp),
             _HANDLE_DIAGNOSTICS.pack(header.RequestHandle, header.ServiceResult.value), _NO_DIAGNOSTICS, _EMPTY,
             _NULL_EXTENSION, _INT32.pack(len(response.Results))]
    for result in response.Results:
        parts.append(_UINT32.pack(result.StatusCode.value))
        parts.append(_INT32.pack(len(result.InputArgumentResults)))
        parts.extend(_UINT32.pack(status.value) for status in result.InputArgumentResults)
        parts.append(_EMPTY)
        parts.append(_INT32.pack(len(result.OutputArguments)))
        parts.extend(ua_binary.variant_to_binary(value) for value in result.OutputArguments)
    parts.append(_EMPTY)
    return b"".join(parts)


def _plain(response: ua.CallResponse) -> bool:
    """No diagnostics, string table or additional header anywhere, every list a list (what our calls answer)."""
    header = response.ResponseHeader
    extra = header.AdditionalHeader
    if (header.StringTable != [] or response.DiagnosticInfos != [] or header.ServiceDiagnostics != _EMPTY_DIAGNOSTICS
            or extra.Body is not None or extra.TypeId != _NULL_NODE or not isinstance(response.Results, list)
            or header.Timestamp is None):
        return False
    return all(isinstance(r.InputArgumentResults, list) and r.InputArgumentDiagnosticInfos == []
               and isinstance(r.OutputArguments, list) for r in response.Results)


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
        install_message_hmac()
        await super().start()

    def _make_protocol(self) -> OPCUAProtocol:
        protocol = HardenedProtocol(iserver=self.iserver, policies=self._policies, clients=self.clients,
                                    closing_tasks=self.closing_tasks, limits=self.limits)
        protocol.guard = self.guard
        return protocol


# ==============================================================================================================
# 4. The server
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


# ==============================================================================================================
# 5. Values and nodes
#
# Writes of several values in one publish; the session registry; bare objects.

async def write_together(server: Server, items: list[tuple[ua.NodeId, ua.Variant]]) -> None:
    """Set the Value of every node first, then run the data-change callbacks: the monitored items of every
    subscription queue all changes before its next publish, and a Read in between sees them all or none."""
    aspace = server.iserver.aspace
    now = datetime.now(timezone.utc)
    pending = []
    for nodeid, variant in items:
        dv = ua.DataValue(variant, SourceTimestamp=now, ServerTimestamp=now)
        attval = aspace._nodes[nodeid].attributes[ua.AttributeIds.Value]
        attval.value = dv
        attval.value_callback = None
        pending.extend((handle, callback, dv) for handle, callback in list(attval.datachange_callbacks.items()))
    for handle, callback, dv in pending:
        try:
            await callback(handle, dv)
        except Exception:  # noqa: BLE001 - as asyncua does: one subscriber's failure is not the writer's; logged
            log.exception("data-change callback failed")


def external_sessions(server: Server) -> list:
    """The client sessions the server holds now."""
    return list(server.iserver._external_sessions.values())


def subscription_of(server: Server, session_id: ua.NodeId, subscription_id: int) -> bool:
    """True when the subscription exists and belongs to that session."""
    sub = server.iserver.subscription_service.subscriptions.get(subscription_id)
    return sub is not None and sub.session_id == session_id


_CHILD_REFERENCES = (ua.ObjectIds.HasComponent, ua.ObjectIds.HasProperty)
_ATTRIBUTES = {  # NodeClass -> (its AddNodes attributes type, the attributes copied)
    ua.NodeClass.Variable: (ua.VariableAttributes, ("DisplayName", "Description", "Value", "DataType", "ValueRank",
                                                    "ArrayDimensions", "AccessLevel", "UserAccessLevel",
                                                    "MinimumSamplingInterval", "Historizing")),
    ua.NodeClass.Method: (ua.MethodAttributes, ("DisplayName", "Description", "Executable", "UserExecutable")),
    ua.NodeClass.Object: (ua.ObjectAttributes, ("DisplayName", "Description", "EventNotifier")),
}


async def instantiate_many(server: Server, parent: ua.NodeId, type_id: ua.NodeId,
                           items: list[tuple[ua.NodeId, ua.QualifiedName]]) -> None:
    """Objects of one type with the type's mandatory children, under `parent` (HasComponent), for many at once.

    The first through asyncua's instantiate; the others as copies of its subtree (attributes, type definitions,
    child NodeIds '<object>.<child>' as instantiate names them) added in one AddNodes call: instantiate browses the
    type hierarchy anew for every object (30-80 ms per alarm condition here, a second or more of every start)."""
    from asyncua.common.instantiate_util import instantiate
    if not items:
        return
    (first_id, first_name), rest = items[0], items[1:]
    await instantiate(server.get_node(parent), server.get_node(type_id), nodeid=first_id, bname=first_name,
                      instantiate_optional=False)
    nodes = server.iserver.aspace._nodes
    prefix = first_id.Identifier
    template = []  # (suffix, parent suffix, reference type, node data): parents before their children

    def walk(nodeid: ua.NodeId, suffix: str) -> None:
        for ref in nodes[nodeid].references:
            if ref.IsForward and ref.ReferenceTypeId.Identifier in _CHILD_REFERENCES:
                child = nodes[ref.NodeId]
                child_suffix = ref.NodeId.Identifier[len(prefix):]
                template.append((child_suffix, suffix, ref.ReferenceTypeId, child))
                walk(ref.NodeId, child_suffix)
    walk(first_id, "")
    additions = []
    for nodeid, name in rest:
        additions.append(_add_item(nodeid, name, parent, ua.NodeId(ua.ObjectIds.HasComponent), type_id,
                                   nodes[first_id]))
        for suffix, parent_suffix, reference, data in template:
            additions.append(_add_item(ua.NodeId(nodeid.Identifier + suffix, nodeid.NamespaceIndex), None,
                                       ua.NodeId(nodeid.Identifier + parent_suffix, nodeid.NamespaceIndex),
                                       reference, _type_definition(data), data))
    for result in await server.iserver.isession.add_nodes(additions):
        result.StatusCode.check()


def _type_definition(data) -> ua.NodeId:
    for ref in data.references:
        if ref.IsForward and ref.ReferenceTypeId.Identifier == ua.ObjectIds.HasTypeDefinition:
            return ref.NodeId
    return ua.NodeId()


def _add_item(nodeid: ua.NodeId, name: ua.QualifiedName | None, parent: ua.NodeId, reference: ua.NodeId,
              type_definition: ua.NodeId, data) -> ua.AddNodesItem:
    attributes = {a: v.value.Value.Value for a, v in data.attributes.items() if v.value is not None
                  and v.value.Value is not None}
    node_class = ua.NodeClass(attributes[ua.AttributeIds.NodeClass])
    item = ua.AddNodesItem()
    item.RequestedNewNodeId = nodeid
    item.BrowseName = name or attributes[ua.AttributeIds.BrowseName]
    item.NodeClass = node_class
    item.ParentNodeId = parent
    item.ReferenceTypeId = reference
    item.TypeDefinition = type_definition if node_class != ua.NodeClass.Method else ua.NodeId()
    kind, names = _ATTRIBUTES[node_class]
    attrs = kind()
    for attr in names:
        value = attributes.get(getattr(ua.AttributeIds, attr))
        if value is not None:
            setattr(attrs, attr, value)
    if name is not None:
        attrs.DisplayName = ua.LocalizedText(name.Name)
    item.NodeAttributes = attrs
    return item


def listening_port(server: Server) -> int:
    """The TCP port the server listens on (0 when it does not)."""
    return server.bserver.port if server.bserver else 0


# ==============================================================================================================
# 6. The messages' HMAC (item 7 of the list above)
#
# On a Sign or SignAndEncrypt channel every message is signed and verified with HMAC-SHA256 over its whole body.
# asyncua builds a `cryptography` HMAC object (and looks up its default backend) for each, ~4 % of serve's Python
# samples per Infer in bench/ua_overhead.py's profile, and compares a received signature with `!=`, which returns at
# the first differing byte (a timing oracle on the expected signature). The standard library's one-shot
# `hmac.digest` (OpenSSL, in C) gives the same bytes; `hmac.compare_digest` compares in constant time. The key
# derivation (uacrypto.p_sha256) calls the same module function, so it gets the one-shot digest too.
# FOR THE WHOLE PROCESS, like the nesting limit: clients in the same process sign with it as well (same bytes).

def _hmac_sha256(key: bytes, message) -> bytes:
    return hmac.digest(key, message, "sha256")


def _verify_hmac256(verifier, data, signature) -> None:
    if not hmac.compare_digest(hmac.digest(verifier.key, data, "sha256"), bytes(signature)):
        raise uacrypto.InvalidSignature


def install_message_hmac() -> None:
    """Sign and verify every channel's messages with the standard library's HMAC (see above). Idempotent."""
    uacrypto.hmac_sha256 = _hmac_sha256
    security_policies.VerifierHMac256.verify = _verify_hmac256
