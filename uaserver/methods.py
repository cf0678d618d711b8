"""OPC UA method handlers: check the caller's role and the arguments, hand the request to the engine, and turn
every outcome into the contract's status code (asyncua would answer BadUnexpectedError to anything raised).

Data flows one way: handler -> service (batcher / scheduler) -> runner -> result, and back here.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from asyncua import ua

from core.audit_digest import DigestOf
from core.errors import INVALID, OUT_OF_RANGE, TYPE_MISMATCH, ApplianceError, InvalidArgument, NotReady

from .asyncua_internals import ApplianceSession
from .audit_writer import AuditWriter
from core.correlation import correlation_id, new_correlation_id
from .session import caller_identity, current_audit_entry_id, current_session
from .status import ARGUMENT_STATUS_FOR_KIND, status_for

log = logging.getLogger(__name__)

# What each role may do. security_admin is no rank above or below the others: it reads what a monitor reads and
# manages the certificates (Part 12), nothing else; engineers manage them too only when the YAML says so.
ROLE_RIGHTS = {
    "monitor": frozenset({"monitor"}),
    "operator": frozenset({"monitor", "operator"}),
    "engineer": frozenset({"monitor", "operator", "engineer"}),
    "security_admin": frozenset({"monitor", "security_admin"}),
}
FLOATS = (ua.VariantType.Float, ua.VariantType.Double)


class ArgumentCountError(Exception):
    def __init__(self, status: str):
        self.status = status


class AccessDenied(Exception):
    """The caller's role lacks the right (BadUserAccessDenied)."""


class MethodStatus(Exception):
    """A body's refusal with a status code of its own (e.g. Acknowledge's BadEventIdUnknown)."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


@dataclass
class CallContext:
    """One call as it travels down: who calls (the session, and `caller`, its identity taken once when the call
    arrives), what it asks, and what the layers below record about its answer (variant, fallback, digests)."""

    session: ApplianceSession | None
    method: str
    model: str = ""
    version: str = ""
    input_digest: str | DigestOf = ""  # DigestOf: hashed when the call is accounted, after its answer went out
    output_digest: str | DigestOf = ""
    answered_by: str = ""  # the fallback model that answered instead (its name), if one did
    variant: str = ""  # the A/B variant that answered, if the model has variants
    event: str = "call"  # the audit record's event kind (role_denied, rate_limited, audit_refused, promote, ...)
    detail: str = ""  # for the audit record (e.g. the mailbox and its Request)
    parent: Any = None  # the NodeId of the object the method was called on
    correlation_id: str = field(default_factory=new_correlation_id)
    audit_entry_id: str = ""
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0  # when the answer was ready (0: not yet)
    status_text: str = ""  # why a refused call was refused, for the engineer: no paths or other internals
    caller: str = ""  # client certificate + user: what jobs, conversations, variants and rate limits key on

    def __post_init__(self) -> None:
        if not self.caller:
            self.caller = caller_identity(self.session)


class TextedResult(ua.CallMethodResult):
    """A CallMethodResult that carries a status text beside its fields (encoded as the CallMethodResult it is)."""

    status_text: str = ""


def status_result(status: str, n_args: int = 0, arg_index: int | None = None,
                  arg_status: str | None = None, text: str = "") -> ua.CallMethodResult:
    """A refusal's result; `text` rides along as its status text (the operation's DiagnosticInfo LocalizedText,
    answered to a client that asks for it in RequestHeader.ReturnDiagnostics: asyncua_internals/processor.py)."""
    res = TextedResult() if text else ua.CallMethodResult()
    res.StatusCode = ua.StatusCode(getattr(ua.StatusCodes, status))
    if text:
        res.status_text = text
    if arg_index is not None and n_args:
        res.InputArgumentResults = [
            ua.StatusCode(getattr(ua.StatusCodes, arg_status) if i == arg_index else ua.StatusCodes.Good)
            for i in range(n_args)]
    return res


def check_count(args: tuple, expected: int) -> None:
    if len(args) < expected:
        raise ArgumentCountError("BadArgumentsMissing")
    if len(args) > expected:
        raise ArgumentCountError("BadTooManyArguments")


def require_type(arg: Any, index: int, types: tuple, array: bool) -> Any:
    """The Variant's value if its built-in type and rank match; else a type mismatch on that argument."""
    ok = isinstance(arg, ua.Variant) and arg.VariantType in types
    if ok:
        is_array = isinstance(arg.Value, list) or arg.is_array
        ok = is_array == array
    if not ok:
        raise InvalidArgument(f"argument {index} has the wrong type", index, TYPE_MISMATCH)
    return arg.Value


def role_rights(engineers_manage_certificates: bool = False) -> dict[str, frozenset[str]]:
    """Each role's rights; `security.engineers_manage_certificates` adds certificate management to engineers'."""
    if not engineers_manage_certificates:
        return ROLE_RIGHTS
    return {**ROLE_RIGHTS, "engineer": ROLE_RIGHTS["engineer"] | {"security_admin"}}


class MethodHandlers:
    """One instance per server; `wrap` turns an async body into an asyncua method callback."""

    def __init__(self, *, metrics, audit, max_array_length: int, max_string_length: int,
                 request_timeout_s: float, rate_limiter=None, audit_on_failure: str = "refuse",
                 audit_queue_size: int = 10000, engineers_manage_certificates: bool = False):
        self.metrics = metrics
        self.audit = audit
        self.max_array_length = max_array_length
        self.max_string_length = max_string_length
        self.request_timeout_s = request_timeout_s
        self.rate_limiter = rate_limiter  # core.services.RateLimits (the daemon's), checked before any engine work
        self.in_flight = 0  # calls being handled now
        self.draining = False  # shutting down: new calls answer BadInvalidState
        # Audit records are written in order by one thread: their JSON, chain hashes and the periodic fsync stay off
        # the event loop (at 1 call in flight they overlap the client's round trip instead of adding to it).
        self._audit_writer = AuditWriter(audit, audit_queue_size, metrics) if audit is not None else None
        self.audit_on_failure = audit_on_failure
        self.rights = role_rights(engineers_manage_certificates)
        self._to_account: list[tuple[CallContext, str]] = []  # answered in this loop turn, accounted in the next

    def set_rate_limits(self, rate_limiter) -> None:
        """SIGHUP's reload: the new limits apply from the next call on."""
        self.rate_limiter = rate_limiter

    def audit_failing(self) -> bool:
        """The audit log cannot be written now (a write failed, or the writer's queue is full)."""
        w = self._audit_writer
        return w is not None and (self.audit.failing or w.full)

    def event(self, event: str, *, action: str = "", session: ApplianceSession | None = None, status: str = "Good",
              detail: str = "", **fields) -> None:
        """An audit record that is not a method call (login, session, certificate, alarm acknowledgement...); on the
        event loop. Never raises."""
        if self._audit_writer is None:
            return
        s = session
        record = dict(event=event, action=action or event, session=s.key if s else "",
                      client=s.client_thumbprint if s else "", user=s.identity if s else "",
                      role=(s.role or "") if s else "", status=status, detail=detail,
                      correlation_id=correlation_id.get() or new_correlation_id())
        record.update(fields)
        try:
            self._audit_writer.put(record)
        except RuntimeError:  # no running loop (shutdown): the record is lost, say so
            log.exception("audit event %s could not be queued", event)

    def close(self) -> None:
        """Write what is queued; called once the server stopped taking calls."""
        if self._to_account:  # answered in the loop's last turn: counted and audited before the writer stops
            self._account_answered()
        if self._audit_writer is not None:
            self._audit_writer.close()

    def wrap(self, method: str, model: str, role: str, n_args: int,
             body: Callable[[CallContext, tuple], Any]) -> Callable:
        # What each call would work out again, worked out once per method: the roles that have the right.
        allowed = frozenset(name for name, rights in self.rights.items() if role in rights)

        async def callback(parent: ua.NodeId, *args: ua.Variant):
            session = current_session.get()
            ctx = CallContext(session=session, method=method, model=model, parent=parent,
                              audit_entry_id=current_audit_entry_id.get())
            cid = correlation_id.set(ctx.correlation_id)  # every log line about the call carries it
            status = "Good"
            self.in_flight += 1
            try:
                if self.draining:
                    raise NotReady("the appliance is shutting down")
                if session is None or session.role not in allowed:
                    raise AccessDenied()
                if self.rate_limiter is not None and not self._within_rate(ctx):
                    status, ctx.event = "BadTooManyOperations", "rate_limited"
                    return status_result(status)
                if self.audit_on_failure == "refuse" and self.audit_failing():
                    # No call may go unaudited: refused before any engine work until the log is written again.
                    status, ctx.event = "BadResourceUnavailable", "audit_refused"
                    return status_result(status)
                check_count(args, n_args)
                result = await body(ctx, args)
                return result
            except ArgumentCountError as e:
                status = e.status
                return status_result(status)
            except AccessDenied:
                status, ctx.event = "BadUserAccessDenied", "role_denied"
                log.warning("%s on %s refused: role %s lacks the right", method, model or "appliance",
                            (ctx.session.role if ctx.session else None) or "none")
                return status_result(status)
            except MethodStatus as e:
                status = e.status
                return status_result(status)
            except InvalidArgument as e:
                status = status_for(e)
                return status_result(status, len(args), e.index, ARGUMENT_STATUS_FOR_KIND[e.kind])
            except ApplianceError as e:
                status = status_for(e)
                return status_result(status, text=ctx.status_text)
            except asyncio.CancelledError:
                # The client's connection is gone (or the server stops): no one can receive an answer. Counted and
                # audited as abandoned; the engine stopped working on it when the cancellation reached the worker.
                status, ctx.event = "BadConnectionClosed", "abandoned"
                raise
            except Exception:  # noqa: BLE001 - every call gets a status code: a bug is a logged BadInternalError
                log.exception("%s on %s failed", method, model or "appliance")
                status = "BadInternalError"
                return status_result(status)
            finally:
                self.in_flight -= 1
                ctx.finished = time.perf_counter()
                # Counted and audited once the answer is on its way: asyncua writes the response in this same step
                # of the task, before the loop runs callbacks; the caller does not wait for the bookkeeping.
                self.account_soon(ctx, status)
                correlation_id.reset(cid)
        return callback

    def _within_rate(self, ctx: CallContext) -> bool:
        role = ctx.session.role or "monitor"
        if self.rate_limiter.allow(role, ctx.caller):
            return True
        if self.metrics is not None:
            self.metrics.rate_limited.labels(role).inc()
        return False

    def account_soon(self, ctx: CallContext, status: str) -> None:
        """account(ctx, status) after the current loop step: the calls answered in one turn of the loop are
        accounted in one callback of the next, in the order they were answered (a loop callback per call was a
        callback to make, schedule and run per call at 16 clients)."""
        if not self._to_account:
            asyncio.get_running_loop().call_soon(self._account_answered)
        self._to_account.append((ctx, status))

    def _account_answered(self) -> None:
        answered, self._to_account = self._to_account, []
        for ctx, status in answered:
            try:
                self.account(ctx, status)
            except Exception:  # noqa: BLE001 - one call's bookkeeping bug must not lose the others'; logged
                log.exception("accounting %s failed", ctx.method)

    def account(self, ctx: CallContext, status: str) -> None:
        """Count, time and audit one call (or a mailbox request refused before it ran)."""
        elapsed = (ctx.finished or time.perf_counter()) - ctx.started
        if self.metrics is not None:
            self.metrics.count_request(ctx.model, ctx.method, status, ctx.variant)
            self.metrics.call_duration(ctx.model, ctx.method).observe(
                elapsed, exemplar={"correlation_id": ctx.correlation_id})
        if self.audit is not None:
            s = ctx.session
            details = [d for d in (ctx.detail, f"answered by fallback {ctx.answered_by}" if ctx.answered_by else "",
                                   f"variant {ctx.variant}" if ctx.variant else "") if d] \
                if ctx.detail or ctx.answered_by or ctx.variant else ()
            self._audit_writer.put(dict(
                event=ctx.event, action=ctx.method, correlation_id=ctx.correlation_id,
                audit_entry_id=ctx.audit_entry_id, session=s.key if s else "",
                client=s.client_thumbprint if s else "", user=s.identity if s else "",
                role=(s.role or "") if s else "", model=ctx.model,
                # The payload digests are hashed here, on the loop after the answer went out, not on the writer's
                # thread: numpy and hashlib let go of the GIL for an input's kilobytes, and on that thread each
                # let-go handed it to the loop and back (0.3 of the serve process's blocking waits per call).
                version=ctx.version, input_digest=str(ctx.input_digest), output_digest=str(ctx.output_digest),
                status=status, latency_ms=round(elapsed * 1000, 3), detail="; ".join(details)))

    def deadline(self) -> float:
        return time.monotonic() + self.request_timeout_s

    # --- argument helpers shared by the bodies ---

    def float_array(self, arg: ua.Variant, index: int, most: int = 0) -> np.ndarray:
        """most: the model's own bound (MaxSamples x sample length), which the contract says is always accepted,
        also where it exceeds security.limits.max_array_length."""
        values = require_type(arg, index, FLOATS, array=True)
        if values is None or len(values) == 0:
            raise InvalidArgument("the input array is empty", index, OUT_OF_RANGE)
        if len(values) > max(self.max_array_length, most):
            raise InvalidArgument("the input array is too long", index, OUT_OF_RANGE)
        try:
            out = np.asarray(values, dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidArgument("the input array holds non-numbers", index, TYPE_MISMATCH) from None
        if out.ndim != 1:
            raise InvalidArgument("the input must be a one-dimensional array", index, OUT_OF_RANGE)
        if not np.isfinite(out).all():
            raise InvalidArgument("the input holds NaN or Inf", index, OUT_OF_RANGE)
        return out

    def text(self, arg: ua.Variant, index: int) -> str:
        value = require_type(arg, index, (ua.VariantType.String,), array=False)
        if not value:
            raise InvalidArgument("the prompt is empty", index, INVALID)
        try:
            encoded = value.encode("utf-8")  # asyncua keeps invalid bytes as lone surrogates
        except UnicodeEncodeError:
            raise InvalidArgument("the prompt is not valid UTF-8", index, INVALID) from None
        if len(encoded) > self.max_string_length:
            raise InvalidArgument("the prompt is too long", index, OUT_OF_RANGE)
        return value

    @staticmethod
    def uint32(arg: ua.Variant, index: int) -> int:
        return int(require_type(arg, index, (ua.VariantType.UInt32,), array=False))

    @staticmethod
    def real(arg: ua.Variant, index: int) -> float:
        value = float(require_type(arg, index, FLOATS, array=False))
        if math.isnan(value) or math.isinf(value):
            raise InvalidArgument("the value is not finite", index, OUT_OF_RANGE)
        return value


def require_ready(model) -> None:
    if model.state != "Ready":
        raise NotReady()

