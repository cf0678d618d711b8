"""The one typed interface through which the OPC UA layer reaches a served model (whatever runs it).

The serve process implements it with appliance.workers.remote (calls into the model's worker process); the UA
layer uses nothing else of a model. Failures are core.errors exceptions carrying engine reasons.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

# Slot keys of Converse conversations (the rest are UA sessions' keys): "conv:" + a hash of identity and id. The
# engine keeps these in the state directory, so they outlive a worker and the appliance.
CONVERSATION_PREFIX = "conv:"

# Choose's limits, checked by the UA handler (the contract's codes) and again by the engine (InvalidArgument).
CHOOSE_MAX_OPTIONS = 16
CHOOSE_MAX_OPTION_CHARS = 256


@dataclass(frozen=True)
class ModelStatus:
    """What the address space, /metrics and /readyz show of a model; a snapshot at most one second old."""
    name: str
    kind: str  # tensor | generative
    state: str  # Loading | Ready | Failed
    version: str
    backend: str
    request_count: int
    error_count: int
    last_latency_ms: float
    heartbeat: int  # +1 per second while the model's worker answers liveness checks
    worker_restarts: int
    worker_up: bool
    restarting: bool  # its worker died or was replaced and is coming back
    failure_reason: str
    queue_depth: int
    input_shape: tuple[int, ...] = ()  # tensor models
    output_shape: tuple[int, ...] = ()
    max_samples: int = 0
    slots_total: int = 0  # generative models
    slots_in_use: int = 0
    conversations_parked: int = 0  # evicted conversations held in host memory


@dataclass(frozen=True)
class InferResult:
    output: np.ndarray  # float32, k results back to back
    model_version: str


@dataclass
class GenerateResult:
    text: str
    token_count: int  # tokens of the reply (an end-of-sequence token is not counted)
    finish_reason: str  # stop | length | context_full
    context_tokens: int  # every token the session's slot holds after this turn, template tokens included
    context_lost: bool
    model_version: str


@dataclass(frozen=True)
class ChooseResult:
    index: int  # argmax of scores (the first on ties)
    scores: list[float]  # per option: the sum of its tokens' natural-log probabilities after the prompt
    model_version: str


@runtime_checkable
class ServedModel(Protocol):
    name: str
    kind: str

    @property
    def state(self) -> str:
        """status().state (Loading | Ready | Failed) without building the whole status: asked on every call."""

    def status(self) -> ModelStatus: ...

    async def reload(self) -> str:
        """Load the weights anew; returns the version now serving (EngineFailure if the load failed)."""


@runtime_checkable
class TensorModel(ServedModel, Protocol):
    @property
    def max_floats(self) -> int:
        """The most floats one call may carry: MaxSamples x the sample's size (0 while the shape is unknown)."""

    async def infer(self, samples: np.ndarray, deadline: float) -> InferResult:
        """samples: 1-D float32, k samples back to back; deadline: time.monotonic() seconds."""


@runtime_checkable
class GenerativeModel(ServedModel, Protocol):
    async def generate(self, session: str, prompt: str, max_tokens: int, temperature: float,
                       deadline: float, on_progress: Callable[[str, int], None] | None = None,
                       finish_by: float | None = None, grammar: str | None = None) -> GenerateResult:
        """on_progress(text so far, tokens so far) as the reply grows; session: the KV slot's key (a UA session,
        or a conversation of an identity), or "" for a one-shot turn (no history, no slot kept after the call);
        finish_by: a job's bound, where the reply ends as it is (FinishReason `deadline`).

        grammar: a JSON Schema document (JSON text) the reply must match: the reply's text is then one JSON
        document valid under it, decoded under the schema's token mask with forced stretches fed as prefill
        (jump-forward). finish_reason "stop" means the document is complete; any other (length, context_full,
        deadline) means it is not, and no part of it is a valid answer. A schema the grammar engine cannot compile
        raises core.errors.InvalidArgument (BadInvalidArgument)."""

    async def choose(self, prompt: str, options: list[str], deadline: float) -> ChooseResult:
        """Score each option as the assistant's whole reply to `prompt` (one user turn, no conversation): the sum
        of its tokens' log-probabilities, all options in batched forwards over the prompt's cache; deterministic.
        1 <= len(options) <= CHOOSE_MAX_OPTIONS, each non-empty and at most CHOOSE_MAX_OPTION_CHARS characters,
        else core.errors.InvalidArgument (BadInvalidArgument) naming the option's index."""

    async def reset(self, session: str) -> None:
        """Forget the session's conversation and give its slot back."""

    def release(self, session: str) -> None:
        """The session closed: free what it holds (no answer awaited)."""
