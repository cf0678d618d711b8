"""Typed tasks and Choose: the methods a PLC calls for an answer of a fixed shape.

    Models/<model>/Tasks/<task>
      Run(<inputs>) -> (<fields>, FinishReason, ModelVersion)
      StartTask(<inputs>) -> (JobId)        GetTaskResult(JobId, WaitMs) -> (Done, <fields>, FinishReason, ModelVersion)
    Models/<model>
      Choose(Prompt, Options String[]) -> (Index Int32, Option String, Scores Float[], ModelVersion)

A task's inputs are checked by type and bound (BadInvalidArgument with the argument's BadTypeMismatch or
BadOutOfRange entry), put into its prompt template and sent as a one-shot turn (session "": no conversation) with the
task's JSON Schema as the grammar (core/task_answers.py); the engine decodes under it, so a complete answer is
valid by construction and read back into typed output arguments (validated again: an invalid one is
BadInternalError). An answer the engine could not complete (FinishReason length, context_full, deadline) is
BadNoDataAvailable (BadTimeout past the call's deadline): no partial value is presented as Good.

Both go through MethodHandlers.wrap (roles, rate limits, audit, metrics) and Governance.route (variants, fallback)
like Generate; jobs are kept by appliance/jobs.py like StartGenerate's, CancelJob / ReleaseJob on the model.
"""
from __future__ import annotations

import json
import logging
import math
import time

from asyncua import ua

from core.audit_digest import DigestOf
from core.config.tasks import TaskConfig
from core.errors import INVALID, OUT_OF_RANGE, EngineFailure, InvalidArgument
from core.model_port import CHOOSE_MAX_OPTION_CHARS, CHOOSE_MAX_OPTIONS, GenerateResult, GenerativeModel
from core.services import CallChecks
from core.task_answers import ZERO, AnswerIncomplete, AnswerInvalid, read_answer, schema_text

from .inference import Inference
from core.method_arguments import (CHOOSE_IN, CHOOSE_OUT, GET_RESULT_IN, START_OUT, TASK_TYPES, get_task_result_outputs,
                                   task_inputs, task_outputs)
from .method_table import MethodSpec
from .methods import CallContext, MethodStatus, require_type

log = logging.getLogger(__name__)
V = ua.VariantType
JOB_ANSWER_GRACE_S = 10.0  # past a task job's bound, how long the engine has to answer


def task_values(task: TaskConfig, args: tuple, checks: CallChecks) -> dict:
    """The inputs' values from the call's arguments: each of its declared type and within its bounds."""
    values = {}
    for i, (name, cfg) in enumerate(task.inputs.items()):
        arg = args[i]
        value = require_type(arg, i, (TASK_TYPES[cfg.type],), array=False)
        if cfg.type == "String":
            value = value or ""
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(f"{name} is not valid UTF-8", i, INVALID) from None
            if len(value) > cfg.effective_max_length:
                raise InvalidArgument(f"{name} holds {len(value)} characters; at most {cfg.effective_max_length} "
                                      "are allowed", i, OUT_OF_RANGE)
            checks.task_text(name, value, i)  # the prompt's own rule (control characters, bidi overrides)
        elif cfg.type in ("Int32", "Double"):
            if cfg.type == "Double" and not math.isfinite(value):
                raise InvalidArgument(f"{name} is not finite", i, OUT_OF_RANGE)
            if (cfg.minimum is not None and value < cfg.minimum) or (cfg.maximum is not None and value > cfg.maximum):
                raise InvalidArgument(f"{name} is out of its range", i, OUT_OF_RANGE)
        values[name] = value
    return values


def answer_outputs(task: TaskConfig, fields: dict | None, finish_reason: str, version: str) -> list[ua.Variant]:
    """The fields as typed output arguments (their zeros when there is no answer yet), FinishReason, ModelVersion."""
    out = []
    for name, f in task.output.items():
        value = fields[name] if fields is not None else ZERO[f.type]
        out.append(ua.Variant(value, TASK_TYPES[f.type]))
    return [*out, ua.Variant(finish_reason, V.String), ua.Variant(version, V.String)]


def incomplete_reason(r: GenerateResult) -> str:
    return {"length": "the answer was not complete within the task's max_tokens",
            "context_full": "the answer did not fit the model's context",
            "deadline": "the answer was not complete within the job's time"}.get(
                r.finish_reason, f"the answer ended early ({r.finish_reason})")


class TaskMethods:
    def __init__(self, config, services: dict, inference: Inference, jobs, checks: CallChecks):
        self.config = config
        self.services = services
        self.inference = inference
        self.jobs = jobs  # job_methods.JobMethods: its store keeps task jobs beside the model's other jobs
        self.checks = checks  # the daemon's CallChecks: a task's prompt is refused as Generate would refuse it
        self.tasks = {name: m.tasks for name, m in config.models.items() if m.kind == "generative" and m.tasks}
        self.schemas = {(model, t): schema_text(task) for model, ts in self.tasks.items() for t, task in ts.items()}

    def method_specs(self) -> list[MethodSpec]:
        specs = []
        for name, svc in self.services.items():
            if svc.kind != "generative":
                continue
            specs.append(MethodSpec(name, "Choose", CHOOSE_IN, CHOOSE_OUT, "operator", self._choose(svc)))
            for task in self.tasks.get(name, {}).values():
                inputs = task_inputs(task)
                specs += [
                    MethodSpec(name, "Run", inputs, task_outputs(task), "operator", self._run(svc, task), task.name),
                    MethodSpec(name, "StartTask", inputs, START_OUT, "operator", self._start(svc, task), task.name),
                    MethodSpec(name, "GetTaskResult", GET_RESULT_IN, get_task_result_outputs(task), "operator",
                               self._get_result(svc, task), task.name)]
        return specs

    # ---- one answer: shared by Run, StartTask and the task mailboxes ----

    def prepare(self, svc: GenerativeModel, task: TaskConfig, ctx: CallContext, args: tuple):
        """Check the inputs, render the prompt, choose the answering model: (model, prompt)."""
        values = task_values(task, args, self.checks)
        prompt = task.prompt_for(values)
        self.checks.generate(prompt, task.effective_max_tokens, task.temperature)
        ctx.input_digest = DigestOf(prompt)
        return self.inference.governance.route(svc, ctx), prompt

    async def answer(self, owner: str, model: GenerativeModel, task: TaskConfig, prompt: str, ctx: CallContext,
                     deadline: float, finish_by: float | None = None) -> tuple[dict, GenerateResult]:
        """The task's answer from `model` (the owner model's, or its variant's or fallback's): typed fields, or
        AnswerIncomplete when the engine stopped before the document was complete."""
        r = await model.generate("", prompt, task.effective_max_tokens, task.temperature, deadline,
                                 finish_by=finish_by, grammar=self.schemas[(owner, task.name)])
        ctx.version = r.model_version
        ctx.output_digest = DigestOf(r.text)
        if r.finish_reason != "stop":
            ctx.status_text = incomplete_reason(r)
            raise AnswerIncomplete(ctx.status_text)
        try:
            return read_answer(task, r.text), r
        except AnswerInvalid as e:  # BadInternalError, counted in appliance_requests_total with that status
            log.error("task %s of %s: the engine's answer broke the schema: %s", task.name, model.name, e)
            raise

    def _run(self, svc: GenerativeModel, task: TaskConfig):
        async def body(ctx: CallContext, args):
            model, prompt = self.prepare(svc, task, ctx, args)
            fields, r = await self.answer(svc.name, model, task, prompt, ctx, self.inference.handlers.deadline())
            return answer_outputs(task, fields, r.finish_reason, r.model_version)
        return body

    def _start(self, svc: GenerativeModel, task: TaskConfig):
        async def body(ctx: CallContext, args):
            model, prompt = self.prepare(svc, task, ctx, args)  # refused now, as Run would refuse it
            finish_by = time.monotonic() + self.config.jobs.timeout_s
            deadline = finish_by + JOB_ANSWER_GRACE_S
            job_ctx = CallContext(session=ctx.session, method=ctx.method, model=ctx.model)

            async def run(on_progress):
                return await self.answer(svc.name, model, task, prompt, job_ctx, deadline, finish_by)
            job = self.jobs.store.start(ctx.caller, svc.name, task_job_kind(task.name), run)
            return [ua.Variant(job.id, V.UInt32)]
        return body

    def _get_result(self, svc: GenerativeModel, task: TaskConfig):
        async def body(ctx: CallContext, args):
            handlers = self.inference.handlers
            job_id = handlers.uint32(args[0], 0)
            wait_ms = handlers.uint32(args[1], 1)
            owner = ctx.caller
            if self.jobs.store.get(owner, svc.name, job_id).kind != task_job_kind(task.name):
                raise MethodStatus("BadNotFound")  # another task's or a Generate job: not this task's (no wait)
            job = await self.jobs.store.wait(owner, svc.name, job_id, wait_ms / 1000.0)
            if isinstance(job.error, InvalidArgument):
                raise MethodStatus("BadInvalidArgument")
            if job.error is not None:
                ctx.status_text = str(job.error) if isinstance(job.error, AnswerIncomplete) else ""
                raise job.error
            if job.result is None:
                return [ua.Variant(False, V.Boolean), *answer_outputs(task, None, "", "")]
            fields, r = job.result
            ctx.version, ctx.output_digest = r.model_version, DigestOf(r.text)
            return [ua.Variant(True, V.Boolean), *answer_outputs(task, fields, r.finish_reason, r.model_version)]
        return body

    # ---- Choose ----

    def _choose(self, svc: GenerativeModel):
        async def body(ctx: CallContext, args):
            prompt = self.inference.handlers.text(args[0], 0)
            options = require_type(args[1], 1, (V.String,), array=True) or []
            if not 1 <= len(options) <= CHOOSE_MAX_OPTIONS:
                raise InvalidArgument(f"Options holds {len(options)} options; 1 to {CHOOSE_MAX_OPTIONS} are "
                                      "allowed", 1, OUT_OF_RANGE)
            for option in options:
                if not option or not option.strip():
                    raise InvalidArgument("an option is empty", 1, INVALID)
                if len(option) > CHOOSE_MAX_OPTION_CHARS:
                    raise InvalidArgument(f"an option is longer than {CHOOSE_MAX_OPTION_CHARS} characters", 1,
                                          OUT_OF_RANGE)
                try:
                    option.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidArgument("an option is not valid UTF-8", 1, INVALID) from None
            self.checks.generate(prompt, 1, 0.0)
            ctx.input_digest = DigestOf(json.dumps([prompt, *options], ensure_ascii=False))
            model = self.inference.governance.route(svc, ctx)
            r = await model.choose(prompt, list(options), self.inference.handlers.deadline())
            ctx.version = r.model_version
            scores = [float(s) for s in r.scores]
            if len(scores) != len(options) or not 0 <= r.index < len(options) or \
                    not all(math.isfinite(s) for s in scores):
                raise EngineFailure("the engine's scores do not fit the options")  # PLCs reject non-finite values
            ctx.output_digest = DigestOf(scores)
            return [ua.Variant(int(r.index), V.Int32), ua.Variant(options[r.index], V.String),
                    ua.Variant(scores, V.Float), ua.Variant(r.model_version, V.String)]
        return body


def task_job_kind(task: str) -> str:
    return f"task:{task}"

