"""The one place where engine reasons become OPC UA status codes (the contract's "Method results" table)."""
from __future__ import annotations

from core import errors

# engine reason -> the call's StatusCode name
STATUS_FOR_REASON = {
    errors.INVALID_INPUT: "BadInvalidArgument",
    errors.NOT_READY: "BadInvalidState",
    errors.NO_CAPACITY: "BadResourceUnavailable",
    errors.DEADLINE: "BadTimeout",
    errors.FAILED: "BadInternalError",
    errors.NOT_FOUND: "BadNotFound",
    errors.CANCELLED: "BadRequestCancelledByClient",
    # a task's answer not complete under its schema within max_tokens / the context (core/task_answers.py)
    "incomplete": "BadNoDataAvailable",
}
# what is wrong with an argument -> its InputArgumentResults entry
ARGUMENT_STATUS_FOR_KIND = {
    errors.OUT_OF_RANGE: "BadOutOfRange",
    errors.INVALID: "BadInvalidArgument",
    errors.TYPE_MISMATCH: "BadTypeMismatch",
}


def status_for(error: errors.ApplianceError) -> str:
    return STATUS_FOR_REASON.get(error.reason, "BadInternalError")
