"""Calls by type (Part 4, Call): a Call whose MethodId is a method declared on an ObjectType and whose ObjectId is
an instance of that type (or of a subtype) runs that instance's own method callback, so roles, rate limits, audit
and status codes are exactly those of the instance's method NodeId. A type's method on an object of another type,
and an instance's method with another object's ObjectId, answer BadMethodInvalid.

asyncua's Call does not check that a method belongs to the object: it invokes the method node's callback with the
ObjectId first. So the type's method nodes get a dispatcher callback, and each instance method a guard.
"""
from __future__ import annotations

from collections.abc import Callable

from asyncua import ua

from .methods import status_result


class TypeCalls:
    def __init__(self):
        # the type's method NodeId -> the instance object's NodeId -> that instance's method callback
        self._targets: dict[ua.NodeId, dict[ua.NodeId, Callable]] = {}

    def dispatcher(self, type_method: ua.NodeId) -> Callable:
        """The callback of a type's method node."""
        targets = self._targets.setdefault(type_method, {})

        async def dispatch(parent: ua.NodeId, *args: ua.Variant):
            callback = targets.get(parent)
            if callback is None:  # not an instance of the type (or no such object)
                return status_result("BadMethodInvalid")
            return await callback(parent, *args)
        return dispatch

    def register(self, type_method: ua.NodeId, obj: ua.NodeId, callback: Callable) -> None:
        self._targets.setdefault(type_method, {})[obj] = callback


def own_object_only(obj: ua.NodeId, callback: Callable) -> Callable:
    """An instance method's callback that answers BadMethodInvalid when the Call names another ObjectId."""
    async def guarded(parent: ua.NodeId, *args: ua.Variant):
        if parent != obj:
            return status_result("BadMethodInvalid")
        return await callback(parent, *args)
    return guarded
