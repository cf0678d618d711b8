"""Whose KV slot a generation uses, and when it is given back.

A session's own conversation (Generate, StartGenerate with an empty ConversationId) is keyed by the session; a
Converse conversation by the caller's identity (client certificate + user) and its ConversationId, so a PLC that
opens a session per call still continues it. A session's slot is freed when the session closes (CloseSession, its
timeout after its client vanished, shutdown), after the jobs still running on it; a conversation's when
EndConversation is called or `engine.conversation_ttl_s` of disuse has passed.
"""
from __future__ import annotations

import hashlib
import time

from asyncua import ua

from core.errors import OUT_OF_RANGE, InvalidArgument
from core.model_port import CONVERSATION_PREFIX, GenerativeModel

from .asyncua_internals import ApplianceSession
from core.method_arguments import CONVERSATION_ID, CONVERSE_IN, GENERATE_OUT
from .method_table import MethodSpec
from .methods import CallContext, require_ready, require_type

V = ua.VariantType


class Conversations:
    def __init__(self, services: dict, all_models, arms, conversation_ttl_s: float, audit_event):
        self.services = services
        self._all_models = all_models  # () -> every served model, variants included
        self._arms = arms  # (model) -> it and its A/B variants: a caller's conversation is on the one routed to
        self.conversation_ttl_s = conversation_ttl_s
        self._audit_event = audit_event
        self._last_use: dict[str, tuple[str, float]] = {}  # conversation key -> (model, last use, monotonic)
        self._jobs_on: dict[tuple[str, str], int] = {}  # (model, session key) -> its running jobs
        self._closed_with_jobs: set[tuple[str, str]] = set()  # ... whose session closed: free the slot after

    def method_specs(self, generate_body) -> list[MethodSpec]:
        """generate_body(svc, conversation=True): Converse is Generate on an identity's conversation."""
        specs = []
        for name, svc in self.services.items():
            if svc.kind != "generative":
                continue
            specs += [MethodSpec(name, "Converse", CONVERSE_IN, GENERATE_OUT, "operator", generate_body(svc, True)),
                      MethodSpec(name, "EndConversation", [CONVERSATION_ID], [], "operator",
                                 self._end_conversation_body(svc)),
                      MethodSpec(name, "ResetContext", [], [], "operator", self._reset_body(svc))]
        return specs

    def key(self, ctx: CallContext, conversation: str, model: str, index: int) -> str:
        """The KV slot of a conversation: keyed by the caller's identity and the id, not by the session, so a PLC
        that opens a session per call continues it; another identity's same id is another conversation."""
        if not (1 <= len(conversation) <= 64) or not all(32 <= ord(ch) < 127 for ch in conversation):
            raise InvalidArgument("ConversationId must be 1-64 printable ASCII characters", index, OUT_OF_RANGE)
        owner = hashlib.sha256(f"{ctx.caller}\0{conversation}".encode()).hexdigest()[:32]
        key = f"{CONVERSATION_PREFIX}{owner}"
        self._last_use[key] = (model, time.monotonic())
        return key

    def expire(self) -> None:
        """Give back the slots of conversations unused for conversation_ttl_s (called by the publishing loop)."""
        now = time.monotonic()
        for key, (model, used) in list(self._last_use.items()):
            if now - used > self.conversation_ttl_s:
                del self._last_use[key]
                for arm in self._arms(self.services[model]):
                    arm.release(key)

    # ---- sessions ----

    def session_closed(self, session: ApplianceSession) -> None:
        """Every close path of a session ends here: its slots go back, those with running jobs after the jobs."""
        reason = f": {session.close_reason}" if session.close_reason else ""
        self._audit_event("session_close", session=session, detail=f"from {session.peer}{reason}")
        for model in self._all_models():
            if model.kind != "generative":
                continue
            if (model.name, session.key) in self._jobs_on:
                self._closed_with_jobs.add((model.name, session.key))
            else:
                model.release(session.key)

    def job_started(self, model: GenerativeModel, key: str) -> None:
        """A job on a session's own conversation: the slot stays until the job ends, even if the session closes."""
        self._jobs_on[(model.name, key)] = self._jobs_on.get((model.name, key), 0) + 1

    def job_ended(self, model: GenerativeModel, key: str) -> None:
        left = self._jobs_on.get((model.name, key), 1) - 1
        if left > 0:
            self._jobs_on[(model.name, key)] = left
            return
        self._jobs_on.pop((model.name, key), None)
        if (model.name, key) in self._closed_with_jobs:
            self._closed_with_jobs.discard((model.name, key))
            model.release(key)

    # ---- methods ----

    def _end_conversation_body(self, svc: GenerativeModel):
        async def body(ctx: CallContext, args):
            conversation = require_type(args[0], 0, (V.String,), array=False) or ""
            key = self.key(ctx, conversation, svc.name, 0)
            self._last_use.pop(key, None)
            require_ready(svc)
            await self._reset_everywhere(svc, key)
            return []
        return body

    def _reset_body(self, svc: GenerativeModel):
        async def body(ctx: CallContext, args):
            require_ready(svc)
            await self._reset_everywhere(svc, ctx.session.key)
            return []
        return body

    async def _reset_everywhere(self, svc: GenerativeModel, key: str) -> None:
        """Forget the conversation on the model and on each of its variants that runs: the caller's Generate was
        routed to one of them (a variant not Ready lost its conversations with its worker)."""
        for arm in self._arms(svc):
            if arm is svc or arm.status().state == "Ready":
                await arm.reset(key)
