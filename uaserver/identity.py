"""Maps an ActivateSession user token to one of the appliance's roles, or refuses it.

X509 user certificates pass the same trust list as application certificates (asyncua checks only proof of
possession) and need a role mapping; user names are checked against scrypt/argon2 hashes with a per-source back-off;
anonymous, when enabled, is `monitor`. There is no built-in account.

asyncua calls get_user synchronously inside ActivateSession, and a scrypt check takes ~70 ms: the processor runs
check_password in a worker thread first and hands the verdict over in `login_verdict` (the same task, so the
contextvar reaches here); get_user falls back to checking on the spot only when no verdict applies.
"""
from __future__ import annotations

import contextvars
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from asyncua.crypto.permission_rules import UserRole
from asyncua.server.user_managers import UserManager
from cryptography import x509

from certs.x509io import thumbprint

from .session import ApplianceUser, activation_context, anonymous_user

log = logging.getLogger(__name__)
ROLES = ("monitor", "operator", "engineer", "security_admin")


@dataclass(frozen=True)
class LoginVerdict:
    """A password already checked in a worker thread for this one ActivateSession (see the processor in
    asyncua_internals/processor.py)."""

    username: str
    password: str
    role: str | None

    def applies_to(self, username: str, password: str) -> bool:
        return self.username == username and hmac.compare_digest(self.password.encode(), password.encode())


# Set by the processor around one ActivateSession; asyncua then calls get_user synchronously in the same task.
login_verdict: contextvars.ContextVar[LoginVerdict | None] = contextvars.ContextVar("login_verdict", default=None)


class ApplianceUserManager(UserManager):
    def __init__(self, *, anonymous: bool, user_names: bool, x509_users: bool,
                 validate_user_certificate: Callable[[bytes], str],
                 configured_role: Callable[[str, str, str | None, int], str | None],
                 role_for_certificate: Callable[[bytes], str | None],
                 issuing_ca: Callable[[bytes], tuple[str | None, int]] = lambda der: (None, 0),
                 authenticate: Callable[[str, str, str], str | None]):
        self.anonymous = anonymous
        self.user_names = user_names
        self.x509_users = x509_users
        self.validate_user_certificate = validate_user_certificate
        # the YAML's security.certificate_roles: (thumbprint, subject, issuing CA's thumbprint, CAs trusted) -> role
        self.configured_role = configured_role
        self.role_for_certificate = role_for_certificate
        self.issuing_ca = issuing_ca  # the CA that signed a certificate, and how many CAs are trusted
        self.authenticate = authenticate

    def get_user(self, iserver, username=None, password=None, certificate=None) -> ApplianceUser | None:
        ctx = activation_context.get()
        if ctx is None:  # only our sessions activate; anything else is refused
            return None
        if ctx.kind == "anonymous":
            return anonymous_user() if self.anonymous else None
        if ctx.kind == "username":
            if not self.user_names or not username or password is None:
                return None
            verdict = login_verdict.get()
            if verdict is not None and verdict.applies_to(username, password):
                role = verdict.role  # checked off the event loop, back-off included
            else:
                role = self.check_password(username, password, ctx.peer)
            if role not in ROLES:
                log.warning("user-name login refused for %r from %s", username, ctx.peer)
                return None
            return ApplianceUser(role=UserRole.User, name=username, appliance_role=role, identity=f"user:{username}")
        if ctx.kind == "x509" and self.x509_users and certificate:
            status = self.validate_user_certificate(certificate)
            if status != "Good":
                log.warning("X509 user certificate refused: %s", status)
                return None
            role = self.certificate_role(certificate)
            if role not in ROLES:
                log.warning("X509 user certificate has no role mapping")
                return None
            thumb = thumbprint(certificate)
            return ApplianceUser(role=UserRole.User, name=thumb, appliance_role=role, identity=f"x509:{thumb}")
        return None

    def check_password(self, username: str, password: str, peer: str) -> str | None:
        """The account's role or None; blocking (~70 ms of scrypt), thread-safe. peer is "ip:port"."""
        return self.authenticate(username, password, peer.rsplit(":", 1)[0])

    def certificate_role(self, der: bytes) -> str | None:
        try:
            subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
        except ValueError:
            return None
        # a subject is an identity only together with the CA that vouches for it (any trusted CA can issue it)
        issuer, trusted_cas = self.issuing_ca(der)
        return self.configured_role(thumbprint(der), subject, issuer, trusted_cas) or self.role_for_certificate(der)
