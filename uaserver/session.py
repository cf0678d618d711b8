"""Who calls: the session being served (a contextvar set around every Call), the identity a session was activated
with (ApplianceUser: role and a printable identity), random node ids. The session class itself (random ids, the
channel's certificate, close hooks, writes) is ApplianceSession in asyncua_internals/sessions.py.
"""
from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncua import ua
from asyncua.crypto.permission_rules import User, UserRole

if TYPE_CHECKING:
    from .asyncua_internals import ApplianceSession

# The session whose request is being served; set by the processor around every Call so that async method handlers
# know their caller (asyncua passes handlers no session).
current_session: contextvars.ContextVar["ApplianceSession | None"] = contextvars.ContextVar(
    "current_session", default=None)


# The client's RequestHeader.AuditEntryId of the Call being served (sanitised; "" when absent or dropped).
current_audit_entry_id: contextvars.ContextVar[str] = contextvars.ContextVar("current_audit_entry_id", default="")
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


@dataclass(eq=False)
class ApplianceUser(User):
    """asyncua's User plus our role and a printable identity for the audit log."""

    appliance_role: str = "monitor"  # monitor | operator | engineer | security_admin
    identity: str = "anonymous"  # "x509:<thumbprint>" | "user:<name>" | "anonymous"


def caller_identity(session: ApplianceSession | None) -> str:
    """Who calls, beyond the session: client certificate + user. Jobs, conversations and rate limits key on it."""
    if session is None:
        return ""
    return f"{session.client_thumbprint}/{session.identity}"


def random_node_id() -> ua.NodeId:
    return ua.NodeId(os.urandom(32), 0, ua.NodeIdType.ByteString)


def anonymous_user() -> ApplianceUser:
    return ApplianceUser(role=UserRole.User, name="anonymous", appliance_role="monitor", identity="anonymous")
