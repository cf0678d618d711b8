"""Engine-side failures, each bound to the OPC UA status code a client receives.

Torch-free and asyncua-free: the UA layer maps `status` (the name of a `ua.StatusCodes` attribute) to a code.
Messages are safe to show a client: never a path, a stack trace or other internals.
"""
from __future__ import annotations


class ApplianceError(Exception):
    status = "BadInternalError"

    def __init__(self, message: str = ""):
        super().__init__(message or self.__class__.__doc__ or self.status)


class InvalidArgument(ApplianceError):
    """An argument has a bad value."""

    status = "BadInvalidArgument"

    def __init__(self, message: str, index: int = 0, arg_status: str = "BadOutOfRange"):
        super().__init__(message)
        self.index = index  # which input argument
        self.arg_status = arg_status  # its InputArgumentResults entry: BadOutOfRange | BadInvalidArgument | BadTypeMismatch


class NotReady(ApplianceError):
    """The model is not Ready."""

    status = "BadInvalidState"


class ResourceUnavailable(ApplianceError):
    """No capacity now: the queue is full or no KV slot can be had."""

    status = "BadResourceUnavailable"


class DeadlineExceeded(ApplianceError):
    """The request's deadline passed."""

    status = "BadTimeout"


class EngineFailure(ApplianceError):
    """The engine failed on this request."""

    status = "BadInternalError"


class AccessDenied(ApplianceError):
    """The caller's role lacks the right."""

    status = "BadUserAccessDenied"
