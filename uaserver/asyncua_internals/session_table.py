"""Room in the session table: orphaned sessions never lock a client out (issue 31, item 12).

An activated session outlives its channel until its timeout (a vanished client may re-activate it and keep its
conversation). A client on a flaky link that opens a new session each time it reconnects leaves one such orphan per
broken channel, and before long the table is full for everyone. So:
- when a client identity (client certificate + user, as the rate limits count it) reaches
  `security.limits.max_sessions_per_client` sessions, its oldest sessions without a live channel are closed to
  make room for the new one: a flaky client keeps at most that many orphans, and never crowds out the orphans of
  others (a PLC that will re-activate its session after a reboot);
- with the table full (`security.limits.max_sessions`), the oldest session without a live channel is closed (the
  same client certificate's first) before CreateSession is refused.
A client is refused (BadTooManySessions) only when the table is full and every session in it has a live channel: an
identity whose sessions all have live channels is not refused while there is room (a SCADA, a test rig or a gateway
may hold many at once). A session closed to make room is closed like any other (its KV slot freed), and its audit
record says why.

Reads the InternalServer's registry of client sessions (_external_sessions) and each ApplianceSession's `channel`
(the processor serving it, None once its connection is gone).
"""
from __future__ import annotations

from ..session import caller_identity  # who a session is for the bound: as the rate limits count it
from .sessions import ApplianceSession


def open_sessions(iserver) -> list[ApplianceSession]:
    """The client sessions that hold a place in the table (those already being closed do not)."""
    return [s for s in iserver._external_sessions.values()
            if isinstance(s, ApplianceSession) and not s.closing]


def _orphans(sessions: list[ApplianceSession]) -> list[ApplianceSession]:
    """Activated sessions without a live channel, oldest first."""
    return sorted((s for s in sessions if s.is_activated() and s.channel is None), key=lambda s: s.opened)


def admit_identity(iserver, max_per_client: int | None, session: ApplianceSession) -> None:
    """At a session's first activation (its user now known): at its identity's bound, close that identity's oldest
    orphans to make room (as many as it is over, those it has)."""
    if not max_per_client:
        return
    me = caller_identity(session)
    mine = [s for s in open_sessions(iserver) if s is not session and s.is_activated() and caller_identity(s) == me]
    excess = len(mine) + 1 - max_per_client
    if excess <= 0:
        return
    for orphan in _orphans(mine)[:excess]:
        orphan.evict(f"closed to make room: its channel was gone and its client reached max_sessions_per_client "
                     f"({max_per_client})")


async def make_room(iserver, max_sessions: int, channel_certificate: bytes | None) -> bool:
    """Before CreateSession with the table full: close the oldest orphans (the same client certificate's first)
    until there is room. False when there is none to close: every session has a live channel."""
    sessions = open_sessions(iserver)
    excess = len(sessions) + 1 - max_sessions
    if excess <= 0:
        return True
    orphans = _orphans(sessions)
    orphans.sort(key=lambda s: s.channel_certificate != channel_certificate)  # stable: oldest first within each
    if len(orphans) < excess:
        return False
    for orphan in orphans[:excess]:
        await orphan.close_for_room("closed to make room: its channel was gone and the session table "
                                    f"(max_sessions {max_sessions}) was full")
    return True
