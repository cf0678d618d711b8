"""Jobs over OPC UA: StartInfer / StartGenerate answer a JobId at once, Get...Result waits at most WaitMs, CancelJob,
ReleaseJob; a JobResultReady event (JobId, Model) on the model's object when a result is there (OPC 40100 style).

Start checks its arguments exactly as the synchronous call does (the daemon's CallChecks, appliance/call_checks.py), so only a call that could
run gets a JobId. A job belongs to the caller's identity and its model (appliance/jobs.py keeps them); it is bounded
by `jobs.timeout_s`, not by the synchronous request deadline: a generation job that reaches it ends Done with the
text so far and FinishReason `deadline`.
"""
from __future__ import annotations

import logging
import time

from asyncua import Server, ua

from core.audit_digest import DigestOf
from core.errors import InvalidArgument, ResourceUnavailable
from core.model_port import GenerativeModel, TensorModel
from core.services import CallChecks, Job, Jobs
from core.task_set import TaskSet

from .address_space import ApplianceNodes
from .inference import Inference
from core.method_arguments import (GET_GENERATE_RESULT_OUT, GET_INFER_RESULT_OUT, GET_RESULT_IN, INFER_IN, JOB_ID,
                                   START_GENERATE_IN)
from .method_table import MethodSpec, generate_outputs
from .methods import CallContext, MethodStatus, require_type

log = logging.getLogger(__name__)
V = ua.VariantType
JOB_ANSWER_GRACE_S = 10.0  # past a generation job's bound, how long the engine has to answer with what it has
START_OUT = [JOB_ID]


class JobMethods:
    def __init__(self, config, services: dict, inference: Inference, store: Jobs, checks: CallChecks):
        self.config = config
        self.services = services
        self.inference = inference
        self.store = store  # the daemon's JobStore; its results are announced here
        store.on_ready = self._ready
        self.checks = checks
        self._events: dict[str, object] = {}  # model -> the event generator of JobResultReady on its object
        self._event_tasks = TaskSet(log, "JobResultReady event")

    async def build_events(self, server: Server, ns: int, nodes: ApplianceNodes) -> None:
        job_event = await server.create_custom_event_type(
            ns, "JobResultReadyEventType", ua.ObjectIds.BaseEventType,
            [("JobId", ua.VariantType.UInt32), ("Model", ua.VariantType.String)])
        for name, m in nodes.models.items():
            self._events[name] = await server.get_event_generator(job_event, m.obj)

    def method_specs(self) -> list[MethodSpec]:
        specs = []
        for name, svc in self.services.items():
            if svc.kind == "tensor":
                specs += [MethodSpec(name, "StartInfer", INFER_IN, START_OUT, "operator", self._start_infer(svc)),
                          MethodSpec(name, "GetInferResult", GET_RESULT_IN, GET_INFER_RESULT_OUT, "operator",
                                     self._get_result(name))]
            else:
                specs += [MethodSpec(name, "StartGenerate", START_GENERATE_IN, START_OUT, "operator",
                                     self._start_generate(svc)),
                          MethodSpec(name, "GetGenerateResult", GET_RESULT_IN, GET_GENERATE_RESULT_OUT, "operator",
                                     self._get_result(name))]
            specs += [MethodSpec(name, "CancelJob", [JOB_ID], [], "operator", self._cancel(name, release=False)),
                      MethodSpec(name, "ReleaseJob", [JOB_ID], [], "operator", self._cancel(name, release=True))]
        return specs

    def _bound(self) -> float:
        """Where a job started now ends (jobs.timeout_s), instead of the synchronous call's deadline."""
        return time.monotonic() + self.config.jobs.timeout_s

    def _start_infer(self, svc: TensorModel):
        inference, alarms = self.inference, self.inference.alarms

        async def body(ctx: CallContext, args):
            samples = inference.samples(svc, args[0])
            ctx.input_digest = DigestOf(samples)
            model = inference.governance.route(svc, ctx)
            st = model.status()
            self.checks.samples(samples, st.input_shape, st.max_samples)  # refused now, as Infer would refuse it
            deadline = self._bound()
            classifier = alarms.classifiers.get(svc.name)
            source = classifier.source_of(identity=ctx.session.identity) if classifier is not None else ""

            async def run(on_progress):
                r = await model.infer(samples, deadline)
                inference.governance.drift_update(svc.name, samples, r.output)
                if classifier is not None:
                    await alarms.classified(svc.name, r.output, source)
                return r
            job = self.store.start(ctx.caller, svc.name, "infer", run)
            return [ua.Variant(job.id, V.UInt32)]
        return body

    def _start_generate(self, svc: GenerativeModel):
        inference, conversations = self.inference, self.inference.conversations

        async def body(ctx: CallContext, args):
            conversation = require_type(args[0], 0, (V.String,), array=False) or ""
            prompt, max_tokens, temperature = inference.generate_args(args, 1)
            # refused now, as Generate would refuse it (whether it fits the context is known once it runs)
            self.checks.generate(prompt, max_tokens, temperature, first=1)
            ctx.input_digest = DigestOf(prompt)
            key = conversations.key(ctx, conversation, svc.name, 0) if conversation else ctx.session.key
            model = inference.governance.route(svc, ctx)  # the variant or fallback Generate would meet
            finish_by = self._bound()
            deadline = finish_by + JOB_ANSWER_GRACE_S
            on_session = not conversation  # the session's own slot: kept for the job if the session closes

            async def run(on_progress):
                try:
                    return await model.generate(key, prompt, max_tokens, temperature, deadline, on_progress,
                                                finish_by=finish_by)
                finally:
                    if on_session:
                        conversations.job_ended(model, key)
            if on_session:  # counted before the session can close
                conversations.job_started(model, key)
            try:
                job = self.store.start(ctx.caller, svc.name, "generate", run)
            except ResourceUnavailable:
                if on_session:
                    conversations.job_ended(model, key)
                raise
            return [ua.Variant(job.id, V.UInt32)]
        return body

    def _get_result(self, name: str):
        async def body(ctx: CallContext, args):
            job_id = self.inference.handlers.uint32(args[0], 0)
            wait_ms = self.inference.handlers.uint32(args[1], 1)
            job = await self.store.wait(ctx.caller, name, job_id, wait_ms / 1000.0)
            if job.kind not in ("infer", "generate"):  # a task's job: its GetTaskResult answers it (uaserver/tasks.py)
                raise MethodStatus("BadNotFound")
            if isinstance(job.error, InvalidArgument):
                # the code StartX's call would have answered; its argument index is not one of Get's arguments
                raise MethodStatus("BadInvalidArgument")
            if job.error is not None:
                raise job.error
            r = job.result
            if job.kind == "infer":
                if r is None:
                    return [ua.Variant(False, V.Boolean), ua.Variant([], V.Float), ua.Variant("", V.String)]
                ctx.version, ctx.output_digest = r.model_version, DigestOf(r.output)
                return [ua.Variant(True, V.Boolean), ua.Variant(r.output.tolist(), V.Float),
                        ua.Variant(r.model_version, V.String)]
            if r is None:
                return [ua.Variant(False, V.Boolean), ua.Variant(job.partial_text, V.String),
                        ua.Variant(job.partial_tokens, V.UInt32), ua.Variant("", V.String),
                        ua.Variant(0, V.UInt32), ua.Variant(False, V.Boolean), ua.Variant("", V.String)]
            ctx.version, ctx.output_digest = r.model_version, DigestOf(r.text)
            return [ua.Variant(True, V.Boolean), *generate_outputs(r)]
        return body

    def _cancel(self, name: str, release: bool):
        async def body(ctx: CallContext, args):
            job_id = self.inference.handlers.uint32(args[0], 0)
            if release:
                self.store.release(ctx.caller, name, job_id)
            else:
                self.store.cancel(ctx.caller, name, job_id)
            return []
        return body

    def _ready(self, job: Job) -> None:
        gen = self._events.get(job.model)
        if gen is None:
            return

        async def trigger():
            gen.event.JobId = ua.Variant(job.id, V.UInt32)
            gen.event.Model = ua.Variant(job.model, V.String)
            await gen.trigger(message=f"JobResultReady {job.id} {job.model}")
        self._event_tasks.start(trigger())
