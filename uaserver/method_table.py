"""Methods declared once: each feature module lists its methods as MethodSpecs (where, name, arguments, role, body);
the server registers every table the same way (the arguments become the method's Input/OutputArguments, the body is
wrapped by MethodHandlers.wrap: role, rate limit, argument count, status codes, audit and metrics). The argument
lists themselves are the contract's (core/method_arguments.py).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncua import ua

V = ua.VariantType
ADMIN = ""  # MethodSpec.owner of the Appliance/Admin methods


@dataclass(frozen=True)
class MethodSpec:
    owner: str  # the model whose object offers it; ADMIN for Appliance/Admin
    name: str  # BrowseName (and the audit record's action)
    inputs: list[ua.Argument]
    outputs: list[ua.Argument]
    role: str  # the least role that may call it: monitor | operator | engineer
    body: Callable[[Any, tuple], Awaitable[Any]]  # (CallContext, the input Variants) -> the output Variants
    task: str = ""  # a task's method: on the object Tasks/<task> of the owner model

    @property
    def action(self) -> str:
        """The audit record's action and the metrics' method label: Tasks/<task>/Run for a task's method."""
        return f"Tasks/{self.task}/{self.name}" if self.task else self.name


def generate_outputs(r) -> list[ua.Variant]:
    """A GenerateResult as Generate's output arguments (Converse and GetGenerateResult answer the same)."""
    return [ua.Variant(r.text, V.String), ua.Variant(r.token_count, V.UInt32),
            ua.Variant(r.finish_reason, V.String), ua.Variant(r.context_tokens, V.UInt32),
            ua.Variant(bool(r.context_lost), V.Boolean), ua.Variant(r.model_version, V.String)]


def infer_outputs(r) -> list[ua.Variant]:
    return [ua.Variant(r.output.tolist(), V.Float), ua.Variant(r.model_version, V.String)]
