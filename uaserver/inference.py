"""The synchronous model calls: Infer, Classify (tensor models) and Generate, Converse (generative), and the steps
that jobs and mailboxes share with them.

A call's path: MethodHandlers.wrap (role, rate limit, audit, metrics, status codes) -> a body here (arguments
checked, the answering model chosen by governance, the call sent to its worker through appliance/workers/remote.py)
-> the result as output arguments.
"""
from __future__ import annotations

import asyncio

from asyncua import ua

from core.audit_digest import DigestOf
from core.model_port import GenerativeModel, InferResult, TensorModel

from .alarms import Alarms
from .conversations import Conversations
from .governance import Governance
from core.method_arguments import CLASSIFY_OUT, GENERATE_IN, GENERATE_OUT, INFER_IN, INFER_OUT
from .method_table import MethodSpec, generate_outputs, infer_outputs
from .methods import CallContext, MethodHandlers, require_type

V = ua.VariantType


class Inference:
    def __init__(self, services: dict, handlers: MethodHandlers, governance: Governance, alarms: Alarms,
                 conversations: Conversations):
        self.services = services
        self.handlers = handlers
        self.governance = governance
        self.alarms = alarms
        self.conversations = conversations

    def method_specs(self) -> list[MethodSpec]:
        specs = []
        for name, svc in self.services.items():
            if svc.kind == "tensor":
                specs.append(MethodSpec(name, "Infer", INFER_IN, INFER_OUT, "operator", self._infer_body(svc)))
                if name in self.alarms.classifiers:
                    specs.append(MethodSpec(name, "Classify", INFER_IN, CLASSIFY_OUT, "operator",
                                            self._infer_body(svc, classify=True)))
            else:
                specs.append(MethodSpec(name, "Generate", GENERATE_IN, GENERATE_OUT, "operator",
                                        self.generate_body(svc)))
        return specs

    # ---- tensor models ----

    def samples(self, svc: TensorModel, arg: ua.Variant, index: int = 0):
        """Input's floats (type, emptiness, size bound, finiteness checked); the shape is the model's to check."""
        return self.handlers.float_array(arg, index, svc.max_floats)

    async def infer(self, svc: TensorModel, ctx: CallContext, samples_arg: ua.Variant) -> InferResult:
        """One Infer as Infer, Classify and mailboxes run it: the samples checked, the answering model (variant or
        fallback), its result recorded for the audit, drift updated after the answer is sent."""
        samples = self.samples(svc, samples_arg)
        ctx.input_digest = DigestOf(samples)
        model = self.governance.route(svc, ctx)
        r = await model.infer(samples, self.handlers.deadline())
        ctx.version = r.model_version
        ctx.output_digest = DigestOf(r.output)
        if svc.name in self.governance.drift:  # after the answer is sent: drift costs the caller nothing
            asyncio.get_running_loop().call_soon(self.governance.drift_update, svc.name, samples, r.output)
        return r

    def _infer_body(self, svc: TensorModel, classify: bool = False):
        labelled = svc.name in self.alarms.classifiers

        async def body(ctx: CallContext, args):
            r = await self.infer(svc, ctx, args[0])
            if not labelled:
                return infer_outputs(r)
            source = self.alarms.classifiers[svc.name].source_of(identity=ctx.session.identity)
            result = await self.alarms.classified(svc.name, r.output, source)
            if not classify:
                return infer_outputs(r)
            return [ua.Variant(result.class_index, V.Int32), ua.Variant(result.label, V.String),
                    ua.Variant(result.confidence, V.Float), ua.Variant(r.model_version, V.String)]
        return body

    # ---- generative models ----

    def generate_args(self, args, first: int) -> tuple[str, int, float]:
        """Prompt, MaxTokens, Temperature from argument `first` on (their types; their values are the engine's to
        check, with call_checks)."""
        return (self.handlers.text(args[first], first), self.handlers.uint32(args[first + 1], first + 1),
                self.handlers.real(args[first + 2], first + 2))

    def generate_body(self, svc: GenerativeModel, conversation: bool = False):
        """Generate (the session's conversation) or Converse (ConversationId first: the identity's conversation)."""
        async def body(ctx: CallContext, args):
            first = 1 if conversation else 0
            key = ctx.session.key
            if conversation:
                key = self.conversations.key(ctx, require_type(args[0], 0, (V.String,), array=False) or "",
                                             svc.name, 0)
            prompt, max_tokens, temperature = self.generate_args(args, first)
            ctx.input_digest = DigestOf(prompt)
            model = self.governance.route(svc, ctx)
            r = await model.generate(key, prompt, max_tokens, temperature, self.handlers.deadline())
            ctx.version = r.model_version
            ctx.output_digest = DigestOf(r.text)
            return generate_outputs(r)
        return body

