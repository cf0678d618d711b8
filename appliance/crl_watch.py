"""The appliance CA's CRL kept current while serving: re-signed before its nextUpdate, its remaining validity a
metric, an event when it is close to running out (the CA key is absent, so it cannot be re-signed here). The same
timer deletes a CreateSigningRequest key that waited too long for its certificate.

A client that checks revocation (node-opcua by default, the .NET stack, UaExpert) refuses the server once the CRL
it was given passes its nextUpdate; the re-signed CRL has to be handed out again before that (docs/security.md).
Every re-signing is recorded in the audit trail. The file work runs in a thread: it signs with the CA key.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Callable

from certs.pki import CRL_RENEW_BEFORE, PKI, PKIError
from certs.server_certificate import ServerCertificateStore

log = logging.getLogger(__name__)


class CrlWatch:
    def __init__(self, pki: PKI, *, metrics, audit, emit_event: Callable[[str, int], None] | None,
                 interval_s: float, warning_days: int):
        self.pki = pki
        self.metrics = metrics
        self.audit = audit
        self.emit_event = emit_event
        self.interval_s = interval_s
        self.warning = timedelta(days=warning_days)
        # re-signed no later than the warning begins, so a box with its CA key never warns
        self.renew_before = max(CRL_RENEW_BEFORE, self.warning + timedelta(days=1))
        self.expiring = False
        self._task: asyncio.Task | None = None

    def check(self) -> tuple[bool, datetime | None]:
        """Re-sign when due; (re-signed, nextUpdate). Blocking: run it in a thread. The same timer deletes a
        CreateSigningRequest key that waited too long for its certificate (REQUESTED_KEY_MAX_AGE)."""
        try:
            ServerCertificateStore(self.pki.layout.pki_dir).expire_requested_key()
        except OSError as exc:
            log.error("cannot delete the expired key of a signing request: %s", exc.strerror)
        try:
            signed = self.pki.refresh_crl(self.renew_before)
        except PKIError as exc:  # the CA key unreadable or not the CA's: reported as an expiring CRL
            log.error("cannot re-sign the appliance CA's CRL: %s", exc)
            signed = False
        return signed, self.pki.crl_next_update()

    def publish(self, signed: bool, next_update: datetime | None) -> None:
        """On the event loop: the metric, the audit record of a re-signing, the event when it runs out."""
        left = (next_update - datetime.now(timezone.utc)).total_seconds() if next_update else 0.0
        self.metrics.ca_crl_expiry.set(left)
        expiring = left < self.warning.total_seconds()
        self.metrics.ca_crl_expiring.set(1 if expiring else 0)
        if signed:
            when = next_update.isoformat() if next_update else "-"
            log.info("re-signed the appliance CA's CRL (next update %s): hand it out again", when)
            if self.audit is not None:
                self.audit.record(event="certificate", action="crl_resign", user="appliance", status="Good",
                                  detail=f"the appliance CA's CRL re-signed; next update {when}")
        if expiring and not self.expiring:
            days = max(left, 0) / 86400
            message = (f"The appliance CA's CRL expires in {days:.0f} days and cannot be re-signed here (the CA key "
                       "is absent): clients that check revocation will refuse the server")
            log.warning(message)
            if self.emit_event is not None:
                self.emit_event(message, 700)
        self.expiring = expiring

    async def once(self) -> None:
        self.publish(*await asyncio.to_thread(self.check))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="crl-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.once()
            except Exception:  # noqa: BLE001 - a failed check is logged; the next one tries again
                log.exception("checking the appliance CA's CRL failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
