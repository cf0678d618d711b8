"""Engine-side failures, each carrying an engine reason; the OPC UA layer alone maps reasons to status codes
(uaserver/status.py).

Torch-free and asyncua-free, and picklable across the worker boundary as (reason, message, index, kind).
Messages are safe to show a client: never a path, a stack trace or other internals.
"""
from __future__ import annotations

# The engine's reasons. The UA layer maps each to one status code; nothing else is ever sent.
INVALID_INPUT = "invalid_input"
NOT_READY = "not_ready"
NO_CAPACITY = "no_capacity"
DEADLINE = "deadline"
FAILED = "failed"
REASONS = (INVALID_INPUT, NOT_READY, NO_CAPACITY, DEADLINE, FAILED)
# The serve process's own: jobs of another identity or unknown, and jobs cancelled by their owner.
NOT_FOUND = "not_found"
CANCELLED = "cancelled"

# What is wrong with an invalid argument.
OUT_OF_RANGE = "out_of_range"  # a value outside what is allowed (length, range, NaN)
INVALID = "invalid"  # a value that is malformed (empty prompt, bad UTF-8)
TYPE_MISMATCH = "type_mismatch"  # the wrong built-in type
ARGUMENT_KINDS = (OUT_OF_RANGE, INVALID, TYPE_MISMATCH)


class ApplianceError(Exception):
    reason = FAILED

    def __init__(self, message: str = ""):
        super().__init__(message or self.__class__.__doc__ or self.reason)

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ApplianceError):
    """An argument has a bad value."""

    reason = INVALID_INPUT

    def __init__(self, message: str, index: int = 0, kind: str = OUT_OF_RANGE):
        super().__init__(message)
        if kind not in ARGUMENT_KINDS:
            raise ValueError(f"unknown argument kind {kind!r}")
        self.index = index  # which input argument
        self.kind = kind


class NotReady(ApplianceError):
    """The model is not Ready."""

    reason = NOT_READY


class ResourceUnavailable(ApplianceError):
    """No capacity now: the queue is full or no KV slot can be had."""

    reason = NO_CAPACITY


class DeadlineExceeded(ApplianceError):
    """The request's deadline passed."""

    reason = DEADLINE


class EngineFailure(ApplianceError):
    """The engine failed on this request."""

    reason = FAILED


class NotFound(ApplianceError):
    """An unknown job, or one of another identity."""

    reason = NOT_FOUND


class Cancelled(ApplianceError):
    """The job was cancelled by its owner."""

    reason = CANCELLED


_BY_REASON = {cls.reason: cls for cls in (NotReady, ResourceUnavailable, DeadlineExceeded, EngineFailure)}


def error_from(reason: str, message: str, index: int = 0, kind: str = OUT_OF_RANGE) -> ApplianceError:
    """Rebuild an engine error that crossed the worker boundary; an unknown reason is a failure."""
    if reason == INVALID_INPUT:
        return InvalidArgument(message, index, kind if kind in ARGUMENT_KINDS else OUT_OF_RANGE)
    return _BY_REASON.get(reason, EngineFailure)(message)


_PATH = __import__("re").compile(r"(?<![\w.])(?:/[^\s/:'\"()]+)+/([^\s/:'\"()]*)")


def without_paths(text: str) -> str:
    """A reason as monitoring and clients may see it: every absolute path shortened to its last part (the log keeps
    the whole reason)."""
    return _PATH.sub(lambda m: m.group(1) or "/", text)
