"""Who answers a call and what watches the answers: A/B variants and their promotion, the fallback model, input drift,
and the Admin methods (ReloadModel, PromoteVariant).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping

from asyncua import ua

from core.config import MAIN_VARIANT
from core.errors import INVALID, ApplianceError, InvalidArgument
from core.model_port import ServedModel
from core.services import DriftWatch, VariantRouting

from .address_space import ApplianceNodes, write
from .method_table import ADMIN, MethodSpec
from core.method_arguments import PROMOTE_IN, RELOAD_IN, RELOAD_OUT
from .methods import CallContext, require_ready, require_type

log = logging.getLogger(__name__)
V = ua.VariantType


_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?(?:[/\\][^/\\\s:'\"(),;]+)+[/\\]?")


def public_reason(message: str) -> str:
    """A failure's message as a status text may show it: every file path reduced to its last part (a status text
    never reveals where the appliance keeps its files), one line, at most 400 characters."""
    text = _PATH.sub(lambda m: m.group(0).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or "?", message)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:399] + "…"


class Governance:
    def __init__(self, config, services: dict[str, ServedModel], variants: dict[str, dict[str, ServedModel]],
                 *, routing: VariantRouting, drift: Mapping[str, DriftWatch], request_timeout_s: float, metrics,
                 emit_event: Callable[..., None]):
        self.config = config
        self.services = services
        self.variants = variants  # model -> {variant name -> its served model}
        self.routing = routing  # which variant answers a caller, and promotions (the daemon's)
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.emit_event = emit_event
        self.drift = drift  # tensor model -> its drift detector (the daemon's)
        self._drift_published: dict[str, str] = {}  # model -> the state last published

    def method_specs(self) -> list[MethodSpec]:
        return [MethodSpec(ADMIN, "ReloadModel", RELOAD_IN, RELOAD_OUT, "engineer", self._reload),
                MethodSpec(ADMIN, "PromoteVariant", PROMOTE_IN, [], "engineer", self._promote)]

    # ---- who answers ----

    def route(self, model: ServedModel, ctx: CallContext) -> ServedModel:
        """The one routing of every model call, synchronous or a job (Infer, Classify, Generate, Converse, StartInfer,
        StartGenerate, mailboxes): the answering model (variant, fallback), refused with BadInvalidState unless it
        is Ready. A PLC meets the same variant through a job as through the call."""
        answering = self.answering(model, ctx)
        require_ready(answering)
        return answering

    def answering(self, model: ServedModel, ctx: CallContext) -> ServedModel:
        """The model that answers the call: the one asked (or its caller's A/B variant), or the first of its
        fallbacks (YAML `fallback`) that can when it cannot: not Ready, its worker restarting, or so much queued that
        the deadline would be missed."""
        model = self.variant_of(model, ctx)
        configured = self.config.models.get(model.name)
        fallback = configured.fallback if configured is not None else None  # a variant has none of its own
        if fallback is None:
            return model
        reason = self._cannot_answer(model)
        if reason is None:
            return model
        asked = model.status()
        while fallback is not None:
            other = self.services[fallback]
            st = other.status()
            same_shapes = asked.kind != "tensor" or not asked.input_shape or st.input_shape == asked.input_shape
            if same_shapes and self._cannot_answer(other) is None:
                ctx.answered_by = fallback
                if self.metrics is not None:
                    self.metrics.fallback.labels(model.name, reason).inc()
                return other
            fallback = self.config.models[fallback].fallback
        return model  # none of them can: the model answers what it answers (BadInvalidState, ...)

    def variant_of(self, svc: ServedModel, ctx: CallContext) -> ServedModel:
        """The A/B variant that serves this caller (sticky: a hash of its identity), or the promoted one; the
        model's own weights when it has no variants, or when the chosen variant is not Ready."""
        if not self.routing.variants(svc.name):
            return svc
        name = self.routing.variant_for(svc.name, ctx.caller)
        model = self.variants[svc.name].get(name) if name != MAIN_VARIANT else None
        if model is not None and model.status().state != "Ready":
            ctx.detail = f"variant {name} is not Ready: answered by {MAIN_VARIANT}"
            model = None
        ctx.variant = name if model is not None else MAIN_VARIANT
        return model or svc

    def _cannot_answer(self, model: ServedModel) -> str | None:
        st = model.status()
        if st.state != "Ready":
            return "restarting" if st.restarting else "not_ready"
        if st.queue_depth and st.last_latency_ms * st.queue_depth / 1000.0 > self.request_timeout_s:
            return "deadline"  # the calls queued before this one would outlast its deadline
        return None

    def arms(self, svc: ServedModel) -> list[ServedModel]:
        """A model and its A/B variants: where one caller's conversation with it may live."""
        return [svc, *self.variants.get(svc.name, {}).values()]

    def all_models(self) -> list[ServedModel]:
        """Every served model, the variants' included (a session's state may live in any of them)."""
        return [*self.services.values(), *(v for variants in self.variants.values() for v in variants.values())]

    # ---- drift ----

    def drift_update(self, model: str, samples, output) -> None:
        """After a call's answer is sent: drift is advisory, never the call's failure."""
        detector = self.drift.get(model)
        if detector is None:
            return
        try:
            status = detector.update(samples, output)
        except (ValueError, ArithmeticError):  # a sample the reference cannot take
            log.exception("drift update of model %s failed", model)
            return
        previous = self._drift_published.get(model)
        self._drift_published[model] = status.state
        if previous is not None and previous != status.state and status.state != "NoReference":
            drifting = status.state == "Drifting"
            self.emit_event(f"Model {model}: input drift {'detected' if drifting else 'cleared'} (score "
                            f"{status.score:.2f}, {status.feature or 'no feature'})", severity=700 if drifting else 300)

    async def publish_drift(self, server, nodes: ApplianceNodes, set_alarm) -> None:
        for model, detector in self.drift.items():
            st, values = detector.status, nodes.models[model].values
            await write(server, values["Drift/State"], st.state, V.String)
            await write(server, values["Drift/Score"], float(st.score), V.Double)
            await write(server, values["Drift/Feature"], st.feature, V.String)
            await write(server, values["Drift/Since"], st.since, V.DateTime)
            await set_alarm(f"Drift/{model}", st.state == "Drifting",
                            f"Model {model}: input drift (score {st.score:.2f}, {st.feature or 'no feature'})")
            if self.metrics is not None:
                self.metrics.drift_score.labels(model).set(st.score)
                self.metrics.drift_state.labels(model).set({"Ok": 0, "Drifting": 1}.get(st.state, 2))

    # ---- Admin ----

    async def _promote(self, ctx: CallContext, args):
        model = require_type(args[0], 0, (V.String,), array=False) or ""
        variant = require_type(args[1], 1, (V.String,), array=False) or ""
        if model not in self.services:
            raise InvalidArgument("no model of that name", 0, INVALID)
        ctx.model, ctx.event = model, "promote"
        known = self.routing.variants(model)
        if not known:
            raise InvalidArgument("the model has no variants", 0, INVALID)
        if variant and variant != MAIN_VARIANT and variant not in known:
            raise InvalidArgument("no variant of that name", 1, INVALID)
        self.routing.promote(model, variant or None)
        ctx.detail = (f"all traffic of {model} to variant {variant}" if variant
                      else f"{model} back to its configured split")
        log.warning("Admin/PromoteVariant: %s", ctx.detail)
        self.emit_event(f"PromoteVariant: {ctx.detail}", severity=500)
        return []

    async def _reload(self, ctx: CallContext, args):
        name = require_type(args[0], 0, (V.String,), array=False)
        svc = self.services.get(name)
        if svc is None:
            raise InvalidArgument("no model of that name", 0, INVALID)
        ctx.model, ctx.event = name, "reload"
        try:
            version = await svc.reload()
        except ApplianceError as e:
            ctx.status_text = public_reason(str(e))  # the engineer reads why, with the code (no paths)
            self.emit_event(f"Reloading model {name} failed: {ctx.status_text}", severity=800)
            raise
        ctx.version = version
        self.emit_event(f"Model {name} reloaded, version {version}", severity=300)
        return [ua.Variant(version, V.String)]
