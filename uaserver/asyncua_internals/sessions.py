"""The client session: random ids, its channel's certificate, close hooks, writes (item 2)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from asyncua import ua
from asyncua.common.utils import ServiceError
from asyncua.server.internal_session import InternalSession, SessionState

from certs.x509io import thumbprint

from ..session import ActivationContext, ApplianceUser, activation_context, random_node_id

log = logging.getLogger(__name__)


# ==============================================================================================================
# The session
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
    # admission(session) at its first activation, its user known: the session table's room per client identity
    # (session_table.admit_identity)
    admission: Callable[["ApplianceSession"], None] | None = None

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
        self.opened = time.monotonic()
        self.channel: object | None = None  # the processor of its live channel; None once that connection is gone
        self.close_reason = ""  # why the appliance closed it, for the audit record ("" for the usual paths)
        self._closing_task: asyncio.Task | None = None

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
        if not was_active and self.admission is not None:
            self.admission(self)
        return result

    @property
    def closing(self) -> bool:
        return self.state == SessionState.Closed or self._closing_task is not None

    def evict(self, reason: str) -> None:
        """Close it soon (from synchronous code, e.g. activation): it holds no place in the table from now on."""
        if self.closing:
            return
        self._closing_task = asyncio.get_running_loop().create_task(self.close_for_room(reason))

    async def close_for_room(self, reason: str) -> None:
        """Close it to make room for another session; the audit record of its close says why."""
        self.close_reason = reason
        log.info("session %s of %s %s", self.key[:8], self.identity, reason)
        await self.close_session(True)

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
