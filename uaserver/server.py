"""The appliance's OPC UA server: secure endpoints only, the contract's address space, and the feature modules wired
together. The engine's models and the domain services (rate limiter, job store, variant routing, drift detectors,
classifier states, call checks: core/services.py) are passed in by the daemon; the server builds none of them and
never runs inference itself.

Where things are: the call path in inference.py (Infer, Classify, Generate) and methods.py (the wrapper every method
runs through); jobs in job_methods.py, conversations and session slots in conversations.py, mailboxes in
mailboxes.py, alarms and Part 9 conditions in alarms.py / conditions.py, variants, fallback, drift and Admin in
governance.py, the 0.25 s value publishing in publishing.py, the address space's objects and variables in
address_space.py, and everything reaching into asyncua's internals in the package asyncua_internals/.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from urllib.parse import urlparse

from asyncua import ua
from asyncua.crypto import security_policies
from cryptography import x509

from core.namespace import NAMESPACE_URI
from core.model_port import GenerativeModel, TensorModel
from core.services import RateLimits, UaServices
from core.task_set import TaskSet

from .address_space import AddressSpaceBuilder, ApplianceNodes
from .ai_properties import AiProperties
from .alarms import Alarms
from .asyncua_internals import (AppServer, ChannelGuard, advertise_host, configure_limits, external_sessions,
                                install_session_factory, listening_port)
from .conversations import Conversations
from .governance import Governance
from .identity import ApplianceUserManager
from .inference import Inference
from .job_methods import JobMethods
from .mailboxes import Mailboxes
from .method_table import MethodSpec
from .methods import MethodHandlers
from .publishing import NO_GPU, Publisher, Sources
from .server_configuration import ServerConfiguration
from .sources import SourceObjects
from .tasks import TaskMethods

log = logging.getLogger(__name__)

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
    def __init__(self, config, *, pki, trust_list, user_store, services: dict[str, TensorModel | GenerativeModel],
                 domain: UaServices, metrics=None, audit=None, device: str = "cpu", health: Callable[[], dict] | None = None,
                 supervision_alive: Callable[[], bool] | None = None,
                 alarms: Callable[[], dict[str, bool]] | None = None,
                 variants: dict[str, dict[str, TensorModel | GenerativeModel]] | None = None,
                 certificate_changed: Callable[[], None] = lambda: None):
        self.config = config
        self.pki = pki
        self.trust_list = trust_list
        self.user_store = user_store
        self.services = services
        self.device = device
        self.server: AppServer | None = None
        self.nodes: ApplianceNodes | None = None
        self.ns = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event_gen = None
        self._event_tasks = TaskSet(log, "event")
        limits = config.security.limits
        self.handlers = MethodHandlers(metrics=metrics, audit=audit, max_array_length=limits.max_array_length,
                                       max_string_length=min(limits.max_string_length, 16 * 1024),
                                       request_timeout_s=config.engine.request_timeout_s,
                                       rate_limiter=domain.rate_limiter,
                                       audit_on_failure=config.audit.on_failure,
                                       audit_queue_size=config.audit.queue_size,
                                       engineers_manage_certificates=config.security.engineers_manage_certificates)
        self.governance = Governance(config, services, variants or {}, routing=domain.variants, drift=domain.drift,
                                     request_timeout_s=config.engine.request_timeout_s, metrics=metrics,
                                     emit_event=self.emit_event)
        self.alarms = Alarms(domain.classifiers, metrics=metrics, emit_event=self.emit_event)
        self.conversations = Conversations(services, self.governance.all_models, self.governance.arms,
                                           config.engine.conversation_ttl_s, self.handlers.event)
        self.inference = Inference(services, self.handlers, self.governance, self.alarms, self.conversations)
        self.sources = SourceObjects(config, services, self.governance, self.alarms,
                                     config.engine.request_timeout_s, metrics)
        self.sources.audit_event = self.handlers.event
        self.jobs = JobMethods(config, services, self.inference, domain.jobs, domain.call_checks)
        self.tasks = TaskMethods(config, services, self.inference, self.jobs, domain.call_checks)
        self.mailboxes: Mailboxes | None = None
        self.ai = AiProperties(config)
        self.publisher = Publisher(services, Sources(health or (lambda: NO_GPU), supervision_alive or (lambda: True),
                                                     alarms or dict),
                                   self.alarms, self.governance, self.jobs, self.conversations, metrics,
                                   describe=self.ai.values)
        # Part 12 certificate management (not in an address space built for `appliance nodeset`, which has no PKI);
        # certificate_changed: the expiry metric and alarm follow a new server certificate
        self.certificates = (ServerConfiguration(config, pki, self.handlers, certificate_changed, self.emit_event)
                             if pki is not None else None)

    def method_specs(self) -> list[MethodSpec]:
        """Every method of the models and Admin, from each feature's table."""
        return [*self.inference.method_specs(),
                *self.conversations.method_specs(self.inference.generate_body),
                *self.jobs.method_specs(), *self.tasks.method_specs(), *self.governance.method_specs()]

    # ---- lifecycle ----

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        server = await self._secure_server()
        await self.build_address_space(server)
        self._event_gen = await server.get_event_generator()
        self.server = server
        await server.start()
        if self.certificates is not None:
            await self.certificates.start(server)
        self.publisher.start(server, self.nodes)
        self._event_tasks.start(asyncio.to_thread(lambda: [self.ai.weights_facts(n) for n in self.services]))
        log.info("OPC UA server listening on %s", self.config.server.endpoint)

    async def build_address_space(self, server) -> None:
        """The appliance namespace on `server`: ObjectTypes, instances, methods, mailboxes, alarms, events (what
        `appliance nodeset` exports, built the same way without listening)."""
        self.ns = await server.register_namespace(NAMESPACE_URI)
        builder = AddressSpaceBuilder(server, self.ns)
        classifiers = self.alarms.classifiers
        self.nodes = await builder.build(self.device, self.services, tuple(self.publisher.sources.alarms()),
                                         {n: (c.labels, c.alarm_classes, c.sources) for n, c in classifiers.items()},
                                         tuple(self.governance.drift), self.ai.values, self.tasks.tasks,
                                         frozenset((b.model, b.task) for b in self.config.mailboxes.values()
                                                   if b.task is not None))
        await builder.add_methods(self.nodes, self.method_specs(),
                                  lambda spec: self.handlers.wrap(spec.action, spec.owner, spec.role,
                                                                  len(spec.inputs), spec.body))
        self.mailboxes = Mailboxes.serving(server, self.ns, self.config.mailboxes, self.inference, self.handlers,
                                           self.tasks)
        await self.mailboxes.build(self.nodes.root)
        await builder.type_mailboxes(self.nodes, {n: b.kind for n, b in self.mailboxes.boxes.items()},
                                     {n: (b.config.model, b.config.task) for n, b in self.mailboxes.boxes.items()
                                      if b.task is not None})
        await self.sources.build(server, self.ns, self.nodes)
        await self.alarms.build(server, self.ns, self.nodes, self.handlers)
        await self.jobs.build_events(server, self.ns, self.nodes)

    async def _secure_server(self) -> AppServer:
        """asyncua's server with the appliance's user manager, endpoints, certificates, policies and limits."""
        cfg, sec = self.config, self.config.security
        manager = ApplianceUserManager(
            anonymous=sec.anonymous, user_names=sec.user_names, x509_users=sec.x509_users,
            validate_user_certificate=lambda der: self.trust_list.validate_user_certificate(der).status,
            configured_role=sec.role_for_certificate, role_for_certificate=self.pki.role_for_certificate,
            issuing_ca=lambda der: self.trust_list.issuing_ca(der),
            authenticate=self.user_store.authenticate if self.user_store is not None else (lambda *a: None))
        server = AppServer(user_manager=manager)
        await server.init()
        server.allow_remote_admin(False)
        install_session_factory(server, self.conversations.session_closed,
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
        await server.load_certificate(str(self.pki.layout.own_cert_der))
        await server.load_private_key(str(self.pki.layout.own_key_pem))
        server.ca_certificate = x509.load_der_x509_certificate(self.pki.layout.ca_cert_der.read_bytes())
        server.set_security_policy([POLICY_TYPES[(p, m)] for p in sec.policies for m in sec.modes])
        tokens = [t for on, t in ((sec.anonymous, ua.AnonymousIdentityToken), (sec.x509_users, ua.X509IdentityToken),
                                  (sec.user_names, ua.UserNameIdentityToken)) if on]
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
            max_array_length=lim.max_array_length, audit=self.handlers.event,
            dead_peer_timeout_s=cfg.server.dead_peer_timeout_s, max_sessions_per_client=lim.max_sessions_per_client)
        return server

    async def stop(self) -> None:
        await self.publisher.stop()
        await self.sources.stop()
        if self.server is None:
            return
        await self.jobs.store.cancel_all()
        if self.mailboxes is not None:
            await self.mailboxes.stop()
        # asyncua's stop() leaves sessions with subscriptions open: close every session so slots are freed.
        for session in external_sessions(self.server):
            await session.close_session(True)
        await self._event_tasks.cancel_all()
        await self.server.stop()
        self.server = None
        self.handlers.close()

    # ---- what the daemon reads and asks ----

    @property
    def running(self) -> bool:
        return self.server is not None

    def audit_failing(self) -> bool:
        """The audit log cannot be written now (Alarms/AuditLogFailed)."""
        return self.handlers.audit_failing()

    def set_rate_limiter(self, rate_limiter: RateLimits) -> None:
        """Apply `security.rate_limits` anew (SIGHUP's reload: the daemon builds the new limiter): from the next call
        on."""
        self.handlers.set_rate_limits(rate_limiter)

    async def drain(self, timeout_s: float, answer_overdue: Callable[[], None]) -> int:
        """Stop taking calls (new ones answer BadInvalidState) and wait up to timeout_s for those in flight; if some
        still run, answer_overdue() makes the engine answer them, and their answers get 2 s to go out. Returns how
        many were still running at timeout_s."""
        handlers = self.handlers
        handlers.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while handlers.in_flight and loop.time() < end:
            await asyncio.sleep(0.02)
        overdue = handlers.in_flight
        if overdue:
            answer_overdue()
            end = loop.time() + 2.0
            while handlers.in_flight and loop.time() < end:  # the answers go out
                await asyncio.sleep(0.01)
        return overdue

    @property
    def port(self) -> int:
        return listening_port(self.server) if self.server else 0

    @property
    def state(self) -> str:
        """The appliance's state now (the address space shows it from the next publish on): systemd's READY=1 and
        STATUS= are sent the moment the last model is Ready, before that publish."""
        return self.publisher.appliance_state()

    @property
    def heartbeat(self) -> int:
        return self.publisher.heartbeat

    async def publish_values(self) -> None:
        """Write the values now instead of at the next tick (tests and start-up)."""
        await self.publisher.publish()

    def emit_event(self, message: str, severity: int = 500) -> None:
        """Raise an OPC UA event on the Server object; callable from any thread."""
        if self._loop is None or self._event_gen is None:
            return
        try:
            self._loop.call_soon_threadsafe(lambda: self._event_tasks.start(self._trigger(message, severity)))
        except RuntimeError:
            pass  # the loop is closed: shutting down

    async def _trigger(self, message: str, severity: int) -> None:
        self._event_gen.event.Severity = severity
        await self._event_gen.trigger(message=message)
