"""The appliance's OPC UA server: secure endpoints only, the contract's address space, method handlers.

Built on asyncua's Server with the hardened processor of asyncua_internals.py; everything a client sees is set up here
from the validated configuration. The engine services are passed in; the server never runs inference itself.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from datetime import datetime, timezone
from urllib.parse import urlparse

from asyncua import ua
from asyncua.crypto import security_policies
from cryptography import x509

from appliance import NAMESPACE_URI
from appliance.audit import digest
from appliance.call_checks import check_generate, check_samples
from appliance.classify import ClassifierState
from appliance.drift import DriftDetector
from appliance.rate_limit import RateLimiter
from appliance.errors import INVALID, OUT_OF_RANGE, InvalidArgument, ResourceUnavailable
from appliance.jobs import Job, JobStore
from appliance.model_port import CONVERSATION_PREFIX
from appliance.config import MAIN_VARIANT
from appliance.variants import Promotions, choose

from .address_space import AddressSpaceBuilder, ApplianceNodes, write
from .asyncua_internals import (AppServer, ApplianceSession, ChannelGuard, advertise_host, configure_limits,
                                external_sessions, install_session_factory, listening_port)
from .identity import ApplianceUserManager
from .conditions import CONDITION_REFRESH, METHODS as CONDITION_METHODS, AlarmConditions, ConditionError, ConditionSpec
from .mailboxes import MailboxAnswer, Mailboxes
from .methods import CallContext, MethodHandlers, MethodStatus, caller_identity, require_ready, require_type

log = logging.getLogger(__name__)
V = ua.VariantType
JOB_ANSWER_GRACE_S = 10.0  # past a generation job's bound, how long the engine has to answer with what it has

POLICIES = {
    "Basic256Sha256": security_policies.SecurityPolicyBasic256Sha256,
    "Aes128_Sha256_RsaOaep": security_policies.SecurityPolicyAes128Sha256RsaOaep,
    "Aes256_Sha256_RsaPss": security_policies.SecurityPolicyAes256Sha256RsaPss,
}
POLICY_TYPES = {
    ("Basic256Sha256", "SignAndEncrypt"): ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt,
    ("Basic256Sha256", "Sign"): ua.SecurityPolicyType.Basic256Sha256_Sign,
    ("Aes128_Sha256_RsaOaep", "SignAndEncrypt"): ua.SecurityPolicyType.Aes128Sha256RsaOaep_SignAndEncrypt,
    ("Aes128_Sha256_RsaOaep", "Sign"): ua.SecurityPolicyType.Aes128Sha256RsaOaep_Sign,
    ("Aes256_Sha256_RsaPss", "SignAndEncrypt"): ua.SecurityPolicyType.Aes256Sha256RsaPss_SignAndEncrypt,
    ("Aes256_Sha256_RsaPss", "Sign"): ua.SecurityPolicyType.Aes256Sha256RsaPss_Sign,
}
MODES = {"SignAndEncrypt": ua.MessageSecurityMode.SignAndEncrypt, "Sign": ua.MessageSecurityMode.Sign}


class ApplianceUaServer:
    def __init__(self, config, *, pki, trust_list, user_store, services: dict, metrics=None, audit=None,
                 device: str = "cpu", health: Callable[[], dict] | None = None,
                 supervision_alive: Callable[[], bool] | None = None,
                 alarms: Callable[[], dict[str, bool]] | None = None, variants: dict | None = None):
        self.config = config
        self.pki = pki
        self.trust_list = trust_list
        self.user_store = user_store
        self.services = services
        self.metrics = metrics
        self.audit = audit
        self.device = device
        self.health = health or (lambda: {"WatchdogState": "NoGpu", "GpuTemperatureC": 0.0,
                                          "GpuMemoryUsedBytes": 0, "GpuEccErrors": 0})
        self.supervision_alive = supervision_alive or (lambda: True)
        self.alarms = alarms or (lambda: {})
        # A/B variants: model -> {variant name -> its RemoteModel}; the weights come from the YAML
        self.variants: dict[str, dict] = variants or {}
        self.variant_weights = {name: {v: c.weight for v, c in m.variants.items()}
                                for name, m in config.models.items() if m.variants}
        self.promotions = Promotions(Path(config.server.state_dir) / "variants.json")
        self.server: AppServer | None = None
        self.nodes: ApplianceNodes | None = None
        self.mailboxes: Mailboxes | None = None
        self.conditions: AlarmConditions | None = None
        self._alarm_values: dict[str, bool] = {}  # alarm name -> the value its Boolean and condition show
        self.ns = 0
        self._updater: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event_gen = None
        self.heartbeat = 0
        self.state = "Starting"
        limits = config.security.limits
        self.classifiers = {name: ClassifierState(m.labels, m.alarm_class_indices, m.alarm_confidence,
                                                  m.alarm_on_results, m.alarm_off_results, m.alarm_sources)
                            for name, m in config.models.items() if m.kind == "tensor" and m.labels}
        self.drift = {name: d for name, m in config.models.items() if m.kind == "tensor"
                      and (d := DriftDetector.for_model(m)) is not None}
        self._drift_published: dict[str, str] = {}  # model -> state last written
        jobs = config.jobs
        self.jobs = JobStore(max_per_client=jobs.max_per_client, result_ttl_s=jobs.result_ttl_s,
                             max_wait_s=jobs.max_wait_ms / 1000.0, on_ready=self._job_ready)
        self._job_events: dict[str, object] = {}
        self._jobs_published: set[tuple[str, str]] = set()  # appliance_jobs series that exist  # model -> event generator of JobResultReady on its object
        self._conversations: dict[str, tuple[str, float]] = {}  # slot key -> (model, last use, monotonic)
        self._session_jobs: dict[tuple[str, str], int] = {}  # (model, session key) -> its running jobs
        self._closed_with_jobs: set[tuple[str, str]] = set()  # ... whose session closed: free the slot after
        self.conversation_ttl_s = config.engine.conversation_ttl_s
        self.handlers = MethodHandlers(metrics=metrics, audit=audit, max_array_length=limits.max_array_length,
                                       max_string_length=min(limits.max_string_length, 16 * 1024),
                                       request_timeout_s=config.engine.request_timeout_s,
                                       rate_limiter=RateLimiter(config.security.rate_limits),
                                       audit_on_failure=config.audit.on_failure,
                                       audit_queue_size=config.audit.queue_size)

    # ---- lifecycle ----

    async def start(self) -> None:
        cfg, sec = self.config, self.config.security
        self._loop = asyncio.get_running_loop()
        manager = ApplianceUserManager(
            anonymous=sec.anonymous, user_names=sec.user_names, x509_users=sec.x509_users,
            validate_user_certificate=lambda der: self.trust_list.validate_user_certificate(der).status,
            configured_role=sec.role_for_certificate, role_for_certificate=self.pki.role_for_certificate,
            authenticate=self.user_store.authenticate if self.user_store is not None else (lambda *a: None))
        server = AppServer(user_manager=manager)
        await server.init()
        server.allow_remote_admin(False)
        install_session_factory(server, self._session_closed,
                                lambda: self.mailboxes.on_write if self.mailboxes is not None else None)

        url = urlparse(cfg.server.endpoint)
        if cfg.server.advertised_host:
            advertise_host(server, f"opc.tcp://{cfg.server.advertised_host}:{url.port}", (url.hostname, url.port))
        else:
            server.set_endpoint(cfg.server.endpoint)
        server.set_server_name(cfg.server.application_name)
        await server.set_application_uri(cfg.server.application_uri)
        server.product_uri = NAMESPACE_URI
        server.manufacturer_name = "OPC UA Inference Appliance"
        server.application_type = ua.ApplicationType.Server
        await server.load_certificate(str(self.pki.own_cert_path))
        await server.load_private_key(str(self.pki.own_key_path))
        server.ca_certificate = x509.load_der_x509_certificate(self.pki.ca_cert_path.read_bytes())
        server.set_security_policy([POLICY_TYPES[(p, m)] for p in sec.policies for m in sec.modes])
        tokens = []
        if sec.anonymous:
            tokens.append(ua.AnonymousIdentityToken)
        if sec.x509_users:
            tokens.append(ua.X509IdentityToken)
        if sec.user_names:
            tokens.append(ua.UserNameIdentityToken)
        server.set_identity_tokens(tokens)

        lim = sec.limits
        configure_limits(server, max_chunk_count=lim.max_chunk_count, max_message_size=lim.max_message_size,
                         max_secure_channels=lim.max_secure_channels,
                         session_activation_timeout_s=lim.session_activation_timeout_s,
                         session_timeout_s=cfg.server.session_timeout_s)
        server.guard = ChannelGuard(
            allowed=frozenset((POLICIES[p].URI, MODES[m]) for p in sec.policies for m in sec.modes),
            validate_client_certificate=lambda der, uri: self.trust_list.validate_application_certificate(
                der, uri).status,
            max_sessions=lim.max_sessions, max_requests_per_session=lim.max_requests_per_session,
            sessions=lambda: len(external_sessions(server)), max_nesting_depth=lim.max_nesting_depth,
            max_array_length=lim.max_array_length, audit=self.handlers.event)

        self.ns = await server.register_namespace(NAMESPACE_URI)
        builder = AddressSpaceBuilder(server, self.ns)
        self.nodes = await builder.build(self.device, self.services, self._callbacks(), tuple(self.alarms()),
                                         {n: (c.labels, c.alarm_classes, c.sources)
                                          for n, c in self.classifiers.items()},
                                         tuple(self.drift))
        self.mailboxes = Mailboxes(server, self.ns, cfg.mailboxes,
                                   {name: svc.kind for name, svc in self.services.items()},
                                   {name: c.labels for name, c in self.classifiers.items()},
                                   self._mailbox_request(), self._mailbox_refused)
        await self.mailboxes.build(self.nodes.root)
        self.conditions = AlarmConditions(server, self.ns)
        await self.conditions.build(self._condition_specs())
        condition_methods = {name: self.handlers.wrap(name, "", "engineer", n_args, self._condition_method(name))
                             for name, _, n_args in CONDITION_METHODS}
        for name, type_method, _ in CONDITION_METHODS:  # called on the type's method or on the condition's own
            server.link_method(server.get_node(type_method), condition_methods[name])
        for nodeid, name in self.conditions.instance_methods():
            server.link_method(server.get_node(nodeid), condition_methods[name])
        server.link_method(server.get_node(CONDITION_REFRESH),
                           self.handlers.wrap("ConditionRefresh", "", "monitor", 1, self._condition_refresh))
        self._event_gen = await server.get_event_generator()
        job_event = await server.create_custom_event_type(
            self.ns, "JobResultReadyEventType", ua.ObjectIds.BaseEventType,
            [("JobId", ua.VariantType.UInt32), ("Model", ua.VariantType.String)])
        for name, m in self.nodes.models.items():
            self._job_events[name] = await server.get_event_generator(job_event, m.obj)
        self.server = server
        await server.start()
        self._updater = asyncio.create_task(self._update_loop())
        log.info("OPC UA server listening on %s", cfg.server.endpoint)

    async def stop(self) -> None:
        if self._updater:
            self._updater.cancel()
            try:
                await self._updater
            except asyncio.CancelledError:
                pass
        if self.server is None:
            return
        self.jobs.cancel_all()
        if self.mailboxes is not None:
            await self.mailboxes.stop()
        # asyncua's stop() leaves sessions with subscriptions open: close every session so slots are freed.
        for session in external_sessions(self.server):
            try:
                await session.close_session(True)
            except Exception:
                log.exception("closing a session on shutdown failed")
        await self.server.stop()
        self.server = None
        self.handlers.close()

    @property
    def port(self) -> int:
        return listening_port(self.server) if self.server else 0

    def _session_closed(self, session: ApplianceSession) -> None:
        self.handlers.event("session_close", session=session, detail=f"from {session.peer}")
        models = [*self.services.values(), *(v for variants in self.variants.values() for v in variants.values())]
        for model in models:
            if model.kind != "generative":
                continue
            if (model.name, session.key) in self._session_jobs:
                # a job on the session's conversation runs to its end; its slot is freed after it
                self._closed_with_jobs.add((model.name, session.key))
            else:
                model.release(session.key)

    # ---- events ----

    def emit_event(self, message: str, severity: int = 500) -> None:
        """Raise an OPC UA event on the Server object; callable from any thread."""
        if self._loop is None or self._event_gen is None:
            return

        def trigger():
            asyncio.ensure_future(self._trigger(message, severity))
        try:
            self._loop.call_soon_threadsafe(trigger)
        except RuntimeError:
            pass  # loop closed: shutting down

    async def _trigger(self, message: str, severity: int) -> None:
        try:
            self._event_gen.event.Severity = severity
            await self._event_gen.trigger(message=message)
        except Exception:
            log.exception("event failed")

    # ---- values ----

    def appliance_state(self, statuses: list | None = None) -> str:
        statuses = statuses if statuses is not None else [m.status() for m in self.services.values()]
        states = [st.state for st in statuses]
        wd = self.health().get("WatchdogState", "NoGpu")
        restarted = any(st.restarting or st.worker_restarts for st in statuses)
        if not restarted and any(s == "Loading" for s in states) and not any(s == "Ready" for s in states):
            return "Starting"
        if self.alarms().get("EngineFault"):  # the watchdog stopped the engine; a Failed model alone degrades
            return "Fault"
        if wd in ("Warning", "Critical") or any(s != "Ready" for s in states):
            return "Degraded"
        return "Ready"

    async def _update_loop(self) -> None:
        last_beat = time.monotonic()
        while True:
            try:
                now = time.monotonic()
                if now - last_beat >= 1.0:
                    last_beat = now
                    if self.supervision_alive():
                        self.heartbeat = (self.heartbeat + 1) % 2**32
                await self.publish_values()
                self.jobs.sweep()
                self._expire_conversations()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("address-space update failed")
            await asyncio.sleep(0.25)

    async def publish_values(self) -> None:
        s, n = self.server, self.nodes
        statuses = [model.status() for model in self.services.values()]
        self.state = self.appliance_state(statuses)
        await write(s, n.values["State"], self.state, V.String)
        await write(s, n.values["Heartbeat"], self.heartbeat, V.UInt32)
        queue = slots_total = slots_used = 0
        for st in statuses:
            m = n.models[st.name]
            await write(s, m.values["Version"], st.version, V.String)
            await write(s, m.values["Backend"], st.backend, V.String)
            await write(s, m.values["State"], st.state, V.String)
            await write(s, m.values["RequestCount"], int(st.request_count), V.UInt64)
            await write(s, m.values["ErrorCount"], int(st.error_count), V.UInt64)
            await write(s, m.values["LastLatencyMs"], float(st.last_latency_ms), V.Double)
            await write(s, m.values["Heartbeat"], int(st.heartbeat), V.UInt32)
            await write(s, m.values["WorkerRestarts"], int(st.worker_restarts) % 2**32, V.UInt32)
            if st.kind == "tensor":
                await write(s, m.values["InputShape"], [int(d) for d in st.input_shape], V.UInt32)
                await write(s, m.values["OutputShape"], [int(d) for d in st.output_shape], V.UInt32)
            else:
                slots_total += st.slots_total
                slots_used += st.slots_in_use
            queue += st.queue_depth
        for alarm, active in self.alarms().items():
            if alarm in n.alarms:
                await self.set_alarm(alarm, bool(active))
        await self._publish_drift()
        await write(s, n.values["Engine/QueueDepth"], queue, V.UInt32)
        await write(s, n.values["Engine/SlotsTotal"], slots_total, V.UInt32)
        await write(s, n.values["Engine/SlotsInUse"], slots_used, V.UInt32)
        h = self.health()
        await write(s, n.values["Health/WatchdogState"], h["WatchdogState"], V.String)
        await write(s, n.values["Health/GpuTemperatureC"], float(h["GpuTemperatureC"]), V.Double)
        await write(s, n.values["Health/GpuMemoryUsedBytes"], int(h["GpuMemoryUsedBytes"]), V.UInt64)
        await write(s, n.values["Health/GpuEccErrors"], int(h["GpuEccErrors"]), V.UInt64)
        if self.metrics is not None:
            self.metrics.ua_sessions.set(len(external_sessions(self.server)))
            counts = self.jobs.counts()
            for name in self.services:
                for state in ("running", "done", "failed"):
                    if counts.get((name, state)) or (name, state) in self._jobs_published:
                        self.metrics.jobs.labels(name, state).set(counts.get((name, state), 0))
                        self._jobs_published.add((name, state))

    # ---- methods ----

    def _callbacks(self) -> dict:
        h = self.handlers
        cbs = {("", "ReloadModel"): h.wrap("ReloadModel", "", "engineer", 1, self._reload),
               ("", "PromoteVariant"): h.wrap("PromoteVariant", "", "engineer", 2, self._promote)}
        for name, svc in self.services.items():
            cbs.update(self._job_callbacks(name, svc))
            if svc.kind == "tensor":
                cbs[(name, "Infer")] = h.wrap("Infer", name, "operator", 1, self._infer_body(svc))
                if name in self.classifiers:
                    cbs[(name, "Classify")] = h.wrap("Classify", name, "operator", 1,
                                                     self._infer_body(svc, classify=True))
            else:
                cbs[(name, "Generate")] = h.wrap("Generate", name, "operator", 3, self._generate_body(svc))
                cbs[(name, "ResetContext")] = h.wrap("ResetContext", name, "operator", 0, self._reset_body(svc))
        return cbs

    def _job_callbacks(self, name: str, model) -> dict:
        h, cbs = self.handlers, {}
        if model.kind == "tensor":
            cbs[(name, "StartInfer")] = h.wrap("StartInfer", name, "operator", 1, self._start_infer_body(model))
            cbs[(name, "GetInferResult")] = h.wrap("GetInferResult", name, "operator", 2, self._get_result_body(name))
        else:
            cbs[(name, "Converse")] = h.wrap("Converse", name, "operator", 4, self._generate_body(model, True))
            cbs[(name, "EndConversation")] = h.wrap("EndConversation", name, "operator", 1,
                                                    self._end_conversation_body(model))
            cbs[(name, "StartGenerate")] = h.wrap("StartGenerate", name, "operator", 4,
                                                  self._start_generate_body(model))
            cbs[(name, "GetGenerateResult")] = h.wrap("GetGenerateResult", name, "operator", 2,
                                                      self._get_result_body(name))
        cbs[(name, "CancelJob")] = h.wrap("CancelJob", name, "operator", 1, self._cancel_job_body(name, False))
        cbs[(name, "ReleaseJob")] = h.wrap("ReleaseJob", name, "operator", 1, self._cancel_job_body(name, True))
        return cbs

    # ---- jobs and conversations ----

    def _job_bound(self) -> float:
        """Where a job started now ends (jobs.timeout_s), instead of the synchronous call's deadline."""
        return time.monotonic() + self.config.jobs.timeout_s

    def _start_infer_body(self, svc):
        async def body(ctx: CallContext, args):
            samples = self.handlers.float_array(args[0], 0, _most_floats(svc))
            ctx.input_digest = digest(samples)
            model = self._answering(svc, ctx)
            require_ready(model)
            st = model.status()
            check_samples(samples, st.input_shape, st.max_samples)  # refused now, as Infer would refuse it
            deadline = self._job_bound()
            classifier = self.classifiers.get(svc.name)
            source = classifier.source_of(identity=ctx.session.identity) if classifier is not None else ""

            async def run(on_progress):
                r = await model.infer(samples, deadline)
                if svc.name in self.drift:
                    self._drift_update(svc.name, samples, r.output)
                if classifier is not None:
                    await self._classified(svc.name, classifier, r.output, source)
                return r
            job = self.jobs.start(caller_identity(ctx.session), svc.name, "infer", run)
            return [ua.Variant(job.id, V.UInt32)]
        return body

    def _start_generate_body(self, svc):
        async def body(ctx: CallContext, args):
            conversation = require_type(args[0], 0, (V.String,), array=False) or ""
            prompt, max_tokens, temperature = self._generate_args(args, 1)
            # refused now, as Generate would refuse it (whether it fits the context is known once it runs)
            check_generate(prompt, max_tokens, temperature, self.config.engine.max_new_tokens, first=1)
            ctx.input_digest = digest(prompt)
            key = self._slot_key(ctx, conversation, svc.name, 0) if conversation else ctx.session.key
            require_ready(svc)
            finish_by = self._job_bound()
            deadline = finish_by + JOB_ANSWER_GRACE_S
            holds_session_slot = not conversation

            async def run(on_progress):
                try:
                    return await svc.generate(key, prompt, max_tokens, temperature, deadline, on_progress,
                                              finish_by=finish_by)
                finally:
                    if holds_session_slot:
                        self._session_job_ended(svc, key)
            if holds_session_slot:  # counted before the session can close: its slot is freed after the job
                self._session_jobs[(svc.name, key)] = self._session_jobs.get((svc.name, key), 0) + 1
            try:
                job = self.jobs.start(caller_identity(ctx.session), svc.name, "generate", run)
            except ResourceUnavailable:
                if holds_session_slot:
                    self._session_job_ended(svc, key)
                raise
            return [ua.Variant(job.id, V.UInt32)]
        return body

    def _get_result_body(self, name: str):
        async def body(ctx: CallContext, args):
            job_id = self.handlers.uint32(args[0], 0)
            wait_ms = self.handlers.uint32(args[1], 1)
            job = await self.jobs.wait(caller_identity(ctx.session), name, job_id, wait_ms / 1000.0)
            if isinstance(job.error, InvalidArgument):
                # the code StartX's call would have answered; its argument index is not one of Get's arguments
                raise MethodStatus("BadInvalidArgument")
            if job.error is not None:
                raise job.error
            if job.kind == "infer":
                r = job.result
                if r is None:
                    return [ua.Variant(False, V.Boolean), ua.Variant([], V.Float), ua.Variant("", V.String)]
                ctx.version, ctx.output_digest = r.model_version, digest(r.output)
                return [ua.Variant(True, V.Boolean), ua.Variant(r.output.tolist(), V.Float),
                        ua.Variant(r.model_version, V.String)]
            r = job.result
            if r is None:
                return [ua.Variant(False, V.Boolean), ua.Variant(job.partial_text, V.String),
                        ua.Variant(job.partial_tokens, V.UInt32), ua.Variant("", V.String),
                        ua.Variant(0, V.UInt32), ua.Variant(False, V.Boolean), ua.Variant("", V.String)]
            ctx.version, ctx.output_digest = r.model_version, digest(r.text)
            return [ua.Variant(True, V.Boolean), *self._generate_outputs(r)]
        return body

    def _cancel_job_body(self, name: str, release: bool):
        async def body(ctx: CallContext, args):
            job_id = self.handlers.uint32(args[0], 0)
            if release:
                self.jobs.release(caller_identity(ctx.session), name, job_id)
            else:
                self.jobs.cancel(caller_identity(ctx.session), name, job_id)
            return []
        return body

    def _session_job_ended(self, model, key: str) -> None:
        """A job on a session's own conversation ended: the slot goes back now if the session closed meanwhile."""
        left = self._session_jobs.get((model.name, key), 1) - 1
        if left > 0:
            self._session_jobs[(model.name, key)] = left
            return
        self._session_jobs.pop((model.name, key), None)
        if (model.name, key) in self._closed_with_jobs:
            self._closed_with_jobs.discard((model.name, key))
            model.release(key)

    def _job_ready(self, job: Job) -> None:
        gen = self._job_events.get(job.model)
        if gen is None:
            return

        async def trigger():
            try:
                gen.event.JobId = ua.Variant(job.id, V.UInt32)
                gen.event.Model = ua.Variant(job.model, V.String)
                await gen.trigger(message=f"JobResultReady {job.id} {job.model}")
            except Exception:
                log.exception("JobResultReady event failed")
        asyncio.ensure_future(trigger())

    def _drift_update(self, model: str, samples, output) -> None:
        try:
            status = self.drift[model].update(samples, output)
        except Exception:  # a sample the reference cannot take: drift is advisory, never the call's failure
            log.exception("drift update of model %s failed", model)
            return
        previous = self._drift_published.get(model)
        self._drift_published[model] = status.state
        if previous is not None and previous != status.state and status.state != "NoReference":
            drifting = status.state == "Drifting"
            self.emit_event(f"Model {model}: input drift {'detected' if drifting else 'cleared'} (score "
                            f"{status.score:.2f}, {status.feature or 'no feature'})", severity=700 if drifting else 300)

    async def _publish_drift(self) -> None:
        s = self.server
        for model, detector in self.drift.items():
            st, values = detector.status, self.nodes.models[model].values
            await write(s, values["Drift/State"], st.state, V.String)
            await write(s, values["Drift/Score"], float(st.score), V.Double)
            await write(s, values["Drift/Feature"], st.feature, V.String)
            await write(s, values["Drift/Since"], st.since, V.DateTime)
            await self.set_alarm(f"Drift/{model}", st.state == "Drifting",
                                 f"Model {model}: input drift (score {st.score:.2f}, {st.feature or 'no feature'})")
            if self.metrics is not None:
                self.metrics.drift_score.labels(model).set(st.score)
                self.metrics.drift_state.labels(model).set({"Ok": 0, "Drifting": 1}.get(st.state, 2))
                self.metrics.alarm_active.labels(f"Drift/{model}").set(1 if st.state == "Drifting" else 0)

    # ---- alarms: the Alarms/<name> Booleans and the same Part 9 conditions ----

    def _alarm_nodes(self) -> dict[str, object]:
        """Every alarm's Boolean by alarm name: the appliance's, Drift/<model>, <model>/<label> (any source) and
        <model>/<source>/<label>."""
        n = self.nodes
        nodes = dict(n.alarms)
        for (model, c), node in n.class_alarms.items():
            nodes[f"{model}/{self.classifiers[model].labels[c]}"] = node
        for (model, source, c), node in n.source_alarms.items():
            nodes[f"{model}/{source}/{self.classifiers[model].labels[c]}"] = node
        return nodes

    def _condition_specs(self) -> list[ConditionSpec]:
        """The Part 9 conditions: the appliance's alarms, drift, and each source's class alarms (the debounced state
        a control room acts on; `Alarms/<label>`, any source, is a Boolean for PLCs only)."""
        fixed = {"EngineFault": 1000, "GpuCritical": 900, "ModelFailed": 800, "WorkerRestarting": 600,
                 "GpuWarning": 600}
        n, specs = self.nodes, []
        for name, node in n.alarms.items():
            if name.startswith("Drift/"):
                model = name.removeprefix("Drift/")
                specs.append(ConditionSpec(name, 500, n.models[model].obj.nodeid, model, node.nodeid))
            else:
                specs.append(ConditionSpec(name, fixed.get(name, 700), n.root.nodeid, "Appliance", node.nodeid))
        for (model, source, c), node in n.source_alarms.items():
            specs.append(ConditionSpec(f"{model}/{source}/{self.classifiers[model].labels[c]}", 700,
                                       n.models[model].obj.nodeid, model, node.nodeid))
        return specs

    async def set_alarm(self, name: str, active: bool, message: str = "") -> None:
        """The one place an alarm is raised or cleared: its Boolean and its condition change together."""
        if self._alarm_values.get(name) == active:
            return
        node = self._alarm_nodes().get(name)
        if node is None:
            return
        self._alarm_values[name] = active
        await write(self.server, node, active, V.Boolean)
        if self.conditions is not None:
            try:
                await self.conditions.set(name, active, f"{message or name} {'active' if active else 'cleared'}")
            except Exception:
                log.exception("alarm condition %s failed", name)

    def _condition_method(self, method: str):
        """Acknowledge / AddComment (EventId, Comment), Enable / Disable () on a condition (the call's object),
        audited as alarm_acknowledged, alarm_commented, alarm_enabled, alarm_disabled."""
        event = {"Acknowledge": "alarm_acknowledged", "AddComment": "alarm_commented", "Enable": "alarm_enabled",
                 "Disable": "alarm_disabled"}[method]

        async def body(ctx: CallContext, args):
            ctx.event = event
            text, event_id = "", None
            if method in ("Acknowledge", "AddComment"):
                event_id = require_type(args[0], 0, (V.ByteString,), array=False)
                comment = require_type(args[1], 1, (V.LocalizedText,), array=False)
                text = (comment.Text or "")[:512] if comment is not None else ""
            try:
                c = self.conditions.condition_of(ctx.parent)
                ctx.detail = f"condition {c.name}" + (f": {text[:200]}" if text else "")
                if method == "Acknowledge":
                    await self.conditions.acknowledge(ctx.parent, event_id, text, ctx.session.identity)
                elif method == "AddComment":
                    await self.conditions.add_comment(ctx.parent, event_id, text, ctx.session.identity)
                else:
                    await self.conditions.enable(ctx.parent, method == "Enable")
            except ConditionError as e:
                raise MethodStatus(e.status) from None
            return []
        return body

    async def _condition_refresh(self, ctx: CallContext, args):
        subscription_id = require_type(args[0], 0, (V.UInt32,), array=False)
        try:
            self.conditions.check_refresh(ctx.session.session_id, subscription_id)
        except ConditionError as e:
            raise MethodStatus(e.status) from None
        await self.conditions.refresh(subscription_id)  # that subscription only
        return []

    # ---- mailboxes ----

    def _mailbox_request(self):
        """A mailbox request runs through the method handlers like a call (role, rate limit, argument checks,
        fallback, status codes, audit and metrics as method `Mailbox`); the answer is a MailboxAnswer, or the
        CallMethodResult carrying the status code the call would have answered."""
        callbacks = {}
        for name, box in self.config.mailboxes.items():
            svc = self.services[box.model]
            body = self._mailbox_infer_body(svc, box) if svc.kind == "tensor" else self._mailbox_generate_body(svc, box)
            callbacks[name] = self.handlers.wrap("Mailbox", box.model, "operator", 3, body)

        async def request(box, session, value: ua.Variant, number: int):
            return await callbacks[box.name](ua.NodeId(f"Appliance/Mailboxes/{box.name}", self.ns), value,
                                             ua.Variant(f"{box.name}", V.String), ua.Variant(number, V.UInt32))
        return request

    def _mailbox_refused(self, box, session, status: str, number: int) -> None:
        ctx = CallContext(session=session, method="Mailbox", model=box.model,
                          detail=f"mailbox {box.name} Request {number}")
        self.handlers._account(ctx, status)

    def _mailbox_infer_body(self, svc, box):
        classifier = self.classifiers.get(svc.name)
        source = classifier.source_of(mailbox=box.name) if classifier is not None else ""

        async def body(ctx: CallContext, args):
            ctx.detail = f"mailbox {args[1].Value} Request {args[2].Value}"
            r = await self._infer(svc, ctx, args[0])
            classified = await self._classified(svc.name, classifier, r.output, source) if classifier else None
            return MailboxAnswer(r.model_version, output=r.output.tolist(), classified=classified)
        return body

    def _mailbox_generate_body(self, svc, box):
        key = f"mailbox:{box.name}"  # one turn per request: the slot is given back after each

        async def body(ctx: CallContext, args):
            ctx.detail = f"mailbox {args[1].Value} Request {args[2].Value}"
            prompt = self.handlers.text(args[0], 0)
            ctx.input_digest = digest(prompt)
            model = self._answering(svc, ctx)
            require_ready(model)
            try:
                r = await model.generate(key, prompt, box.effective_max_tokens, box.effective_temperature,
                                         self.handlers.deadline())
            finally:
                model.release(key)
            ctx.version = r.model_version
            ctx.output_digest = digest(r.text)
            return MailboxAnswer(r.model_version, text=r.text)
        return body

    def variant_of(self, svc, ctx: CallContext):
        """The A/B variant that serves this caller (sticky: a hash of its identity), or the promoted one; the
        model's own weights when it has no variants, or when the chosen variant is not Ready."""
        weights = self.variant_weights.get(svc.name)
        if not weights:
            return svc
        name = self.promotions.get(svc.name) or choose(caller_identity(ctx.session), svc.name, weights)
        model = self.variants[svc.name].get(name) if name != MAIN_VARIANT else None
        if model is not None and model.status().state != "Ready":
            ctx.detail = f"variant {name} is not Ready: answered by {MAIN_VARIANT}"
            model = None
        ctx.variant = name if model is not None else MAIN_VARIANT
        return model or svc

    async def _promote(self, ctx: CallContext, args):
        model = require_type(args[0], 0, (V.String,), array=False) or ""
        variant = require_type(args[1], 1, (V.String,), array=False) or ""
        if model not in self.services:
            raise InvalidArgument("no model of that name", 0, INVALID)
        ctx.model, ctx.event = model, "promote"
        known = self.variant_weights.get(model)
        if not known:
            raise InvalidArgument("the model has no variants", 0, INVALID)
        if variant and variant != MAIN_VARIANT and variant not in known:
            raise InvalidArgument("no variant of that name", 1, INVALID)
        self.promotions.set(model, variant or None)
        ctx.detail = (f"all traffic of {model} to variant {variant}" if variant
                      else f"{model} back to its configured split")
        log.warning("Admin/PromoteVariant: %s", ctx.detail)
        self.emit_event(f"PromoteVariant: {ctx.detail}", severity=500)
        return []

    def _answering(self, model, ctx: CallContext):
        """The model that answers the call: the one asked, or the first of its fallbacks (YAML `fallback`) that can
        when it cannot: not Ready, its worker restarting, or so much queued that the deadline would be missed."""
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

    def _cannot_answer(self, model) -> str | None:
        st = model.status()
        if st.state != "Ready":
            return "restarting" if st.restarting else "not_ready"
        if st.queue_depth and st.last_latency_ms * st.queue_depth / 1000.0 > self.handlers.request_timeout_s:
            return "deadline"  # the calls queued before this one would outlast its deadline
        return None

    def _slot_key(self, ctx: CallContext, conversation: str, model: str, index: int) -> str:
        """The KV slot of a conversation: keyed by the caller's identity and the id, not by the session, so a PLC
        that opens a session per call continues it; another identity's same id is another conversation."""
        if not (1 <= len(conversation) <= 64) or not all(32 <= ord(ch) < 127 for ch in conversation):
            raise InvalidArgument("ConversationId must be 1-64 printable ASCII characters", index, OUT_OF_RANGE)
        owner = hashlib.sha256(f"{caller_identity(ctx.session)}\0{conversation}".encode()).hexdigest()[:32]
        key = f"{CONVERSATION_PREFIX}{owner}"
        self._conversations[key] = (model, time.monotonic())
        return key

    def _end_conversation_body(self, svc):
        async def body(ctx: CallContext, args):
            conversation = require_type(args[0], 0, (V.String,), array=False) or ""
            key = self._slot_key(ctx, conversation, svc.name, 0)
            self._conversations.pop(key, None)
            require_ready(svc)
            await svc.reset(key)
            return []
        return body

    def _expire_conversations(self) -> None:
        now = time.monotonic()
        for key, (model, used) in list(self._conversations.items()):
            if now - used > self.conversation_ttl_s:
                del self._conversations[key]
                self.services[model].release(key)

    async def _infer(self, svc, ctx: CallContext, samples_arg: ua.Variant):
        """One Infer as Infer, Classify and mailboxes run it: the samples checked, the answering model (variant or
        fallback), its result recorded for the audit, drift updated."""
        samples = self.handlers.float_array(samples_arg, 0, _most_floats(svc))
        ctx.input_digest = digest(samples)
        model = self._answering(svc, ctx)
        require_ready(model)
        r = await model.infer(samples, self.handlers.deadline())
        ctx.version = r.model_version
        ctx.output_digest = digest(r.output)
        if svc.name in self.drift:  # after the answer is sent: drift costs the caller nothing
            asyncio.get_running_loop().call_soon(self._drift_update, svc.name, samples, r.output)
        return r

    def _infer_body(self, svc, classify: bool = False):
        classifier = self.classifiers.get(svc.name)

        async def body(ctx: CallContext, args):
            r = await self._infer(svc, ctx, args[0])
            if classifier is None:
                return [ua.Variant(r.output.tolist(), V.Float), ua.Variant(r.model_version, V.String)]
            result = await self._classified(svc.name, classifier, r.output,
                                            classifier.source_of(identity=ctx.session.identity))
            if not classify:
                return [ua.Variant(r.output.tolist(), V.Float), ua.Variant(r.model_version, V.String)]
            return [ua.Variant(result.class_index, V.Int32), ua.Variant(result.label, V.String),
                    ua.Variant(result.confidence, V.Float), ua.Variant(r.model_version, V.String)]
        return body

    async def _classified(self, model: str, classifier: ClassifierState, output, source: str):
        """Last, Last/<source> and the class alarms follow every Classify and Infer result of a labelled model;
        returns the classification."""
        u = classifier.update(output, source)
        result, s, m = u.result, self.server, self.nodes.models[model]
        now = datetime.now(timezone.utc)
        for last in ("Last", f"Last/{source}"):
            await write(s, m.values[f"{last}/ClassIndex"], result.class_index[-1], V.Int32)
            await write(s, m.values[f"{last}/Label"], result.label[-1], V.String)
            await write(s, m.values[f"{last}/Confidence"], result.confidence[-1], V.Float)
            await write(s, m.values[f"{last}/Time"], now, V.DateTime)
        for c in u.raised | u.cleared:
            active, label = c in u.raised, classifier.labels[c]
            await self._class_alarm(f"{model}/{source}/{label}", active,
                                    f"Alarm {label} of model {model} from {source}")
            self.emit_event(f"Alarm {label} of model {model} from {source} " + ("raised" if active else "cleared"),
                            severity=700 if active else 300)
        for c in u.any_raised | u.any_cleared:
            await self._class_alarm(f"{model}/{classifier.labels[c]}", c in u.any_raised)
        return result

    async def _class_alarm(self, name: str, active: bool, message: str = "") -> None:
        await self.set_alarm(name, active, message)
        if self.metrics is not None:
            self.metrics.alarm_active.labels(name).set(1 if active else 0)

    def _generate_args(self, args, first: int) -> tuple[str, int, float]:
        return (self.handlers.text(args[first], first), self.handlers.uint32(args[first + 1], first + 1),
                self.handlers.real(args[first + 2], first + 2))

    @staticmethod
    def _generate_outputs(r) -> list:
        return [ua.Variant(r.text, V.String), ua.Variant(r.token_count, V.UInt32),
                ua.Variant(r.finish_reason, V.String), ua.Variant(r.context_tokens, V.UInt32),
                ua.Variant(bool(r.context_lost), V.Boolean), ua.Variant(r.model_version, V.String)]

    def _generate_body(self, svc, conversation: bool = False):
        """Generate (the session's conversation) or Converse (ConversationId first: the identity's conversation)."""
        async def body(ctx: CallContext, args):
            first = 1 if conversation else 0
            key = ctx.session.key
            if conversation:
                key = self._slot_key(ctx, require_type(args[0], 0, (V.String,), array=False) or "", svc.name, 0)
            prompt, max_tokens, temperature = self._generate_args(args, first)
            ctx.input_digest = digest(prompt)
            model = self._answering(svc, ctx)
            require_ready(model)
            r = await model.generate(key, prompt, max_tokens, temperature, self.handlers.deadline())
            ctx.version = r.model_version
            ctx.output_digest = digest(r.text)
            return self._generate_outputs(r)
        return body

    def _reset_body(self, svc):
        async def body(ctx: CallContext, args):
            require_ready(svc)
            await svc.reset(ctx.session.key)
            return []
        return body

    async def _reload(self, ctx: CallContext, args):
        name = require_type(args[0], 0, (V.String,), array=False)
        svc = self.services.get(name)
        if svc is None:
            raise InvalidArgument("no model of that name", 0, INVALID)
        ctx.model, ctx.event = name, "reload"
        try:
            version = await svc.reload()
        except Exception as e:
            self.emit_event(f"Reloading model {name} failed: {e}", severity=800)
            raise
        ctx.version = version
        self.emit_event(f"Model {name} reloaded, version {version}", severity=300)
        return [ua.Variant(version, V.String)]



def _most_floats(model) -> int:
    """MaxSamples samples of the model's input, the most one Infer call may carry."""
    st = model.status()
    return st.max_samples * math.prod(st.input_shape) if st.input_shape else 0
