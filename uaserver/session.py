"""The appliance's OPC UA session: random identifiers, the identity it was activated with, and a close hook.

asyncua numbers sessions and authentication tokens sequentially (guessable); here both are 32 random bytes. The
session remembers the certificate of the secure channel it was created on, so that a re-activation on a new channel
is accepted only from the same client certificate and user (see processor.py).
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from asyncua import ua
from asyncua.common.utils import ServiceError
from asyncua.crypto.permission_rules import User, UserRole
from asyncua.server.internal_session import InternalSession

log = logging.getLogger(__name__)

# The session whose request is being served; set by the processor around every Call so that async method handlers
# know their caller (asyncua passes handlers no session).
current_session: contextvars.ContextVar["ApplianceSession | None"] = contextvars.ContextVar(
    "current_session", default=None)


# The client's RequestHeader.AuditEntryId of the Call being served (sanitised; "" when absent or dropped).
current_audit_entry_id: contextvars.ContextVar[str] = contextvars.ContextVar("current_audit_entry_id", default="")
# The appliance's correlation id of the call being served: in its audit record, its log lines and its exemplar.
correlation_id: contextvars.ContextVar[str] = contextvars.ContextVar("correlation_id", default="")


def new_correlation_id() -> str:
    """128 random bits as 32 hex digits: made by the appliance, so a client cannot forge or predict one."""
    return os.urandom(16).hex()


def clean_audit_entry_id(value) -> str:
    """The contract: printable, at most 64 characters, else dropped."""
    if not isinstance(value, str) or not value or len(value) > 64 or not value.isprintable():
        return ""
    return value


@dataclass(frozen=True)
class ActivationContext:
    kind: str  # the user token presented: x509 | username | anonymous
    peer: str  # "ip:port" of the client, for the login back-off


# asyncua's user manager is called without the session; ActivateSession sets this around the call.
activation_context: contextvars.ContextVar[ActivationContext | None] = contextvars.ContextVar(
    "activation_context", default=None)


def thumbprint(der: bytes | None) -> str:
    return hashlib.sha1(der).hexdigest() if der else ""


@dataclass(eq=False)
class ApplianceUser(User):
    """asyncua's User plus our role and a printable identity for the audit log."""

    appliance_role: str = "monitor"  # monitor | operator | engineer
    identity: str = "anonymous"  # "x509:<thumbprint>" | "user:<name>" | "anonymous"


def random_node_id() -> ua.NodeId:
    return ua.NodeId(os.urandom(32), 0, ua.NodeIdType.ByteString)


class ApplianceSession(InternalSession):
    on_close: Callable[["ApplianceSession"], None] | None = None

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
        self.client_uri: str = ""
        self.peer: str = ""
        self.outstanding_calls = 0
        self._close_hooks_ran = False

    @property
    def role(self) -> str | None:
        return self.user.appliance_role if isinstance(self.user, ApplianceUser) else None

    @property
    def identity(self) -> str:
        return self.user.identity if isinstance(self.user, ApplianceUser) else "none"

    @property
    def client_thumbprint(self) -> str:
        return thumbprint(self.channel_certificate)

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

    async def close_session(self, delete_subs: bool = True) -> None:
        await super().close_session(delete_subs)
        # Every close path (CloseSession, timeout, lost connection, shutdown) ends here: free what the session owns.
        if not self._close_hooks_ran:
            self._close_hooks_ran = True
            if self.on_close is not None:
                try:
                    self.on_close(self)
                except Exception:
                    log.exception("session close hook failed")


def anonymous_user() -> ApplianceUser:
    return ApplianceUser(role=UserRole.User, name="anonymous", appliance_role="monitor", identity="anonymous")
