"""`appliance serve`: the appliance's one composition root. It reads the configuration once and builds every part
from it: PKI, metrics, audit, accounts, watchdog, the model workers, the domain services the OPC UA server is
handed (rate limiter, job store, variant routing, drift detectors, classifier states, call checks: ua_services),
the OPC UA server itself, the sources client, monitoring HTTP. What it hands a part to builds none itself.

Start order: PKI (created on first start), metrics, audit, accounts, watchdog, OPC UA server (State Starting),
monitoring HTTP, then the models load in the background; each turns Ready on its own. Stop order is the reverse,
and every session's KV slot is freed before the engine stops.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import signal
import socket
from pathlib import Path
from urllib.parse import urlparse

from core.alarm_names import DAEMON_ALARMS
from core.config import ApplianceConfig
from core.errors import DeadlineExceeded
from core.model_port import GenerativeModel, TensorModel
from core.services import UaServices
from core.task_set import TaskSet

from . import logs
from .call_checks import CallChecks
from .classify import classifier_states
from .device import on_gpu, resolve_device
from .jobs import JobStore
from .metrics import Metrics
from .model_specs import model_spec
from .rate_limit import RateLimiter
from .supervision import SupervisedFacts, Supervision
from .systemd_loop import tell_systemd
from .variants import VariantRouter

log = logging.getLogger(__name__)


def certificate_names(config: ApplianceConfig) -> tuple[list[str], list[str]]:
    """Host names and IPs for the server certificate's SubjectAltName."""
    hostnames = {"localhost", socket.gethostname()}
    try:
        hostnames.add(socket.getfqdn())
    except OSError:
        pass
    hostnames.update(config.server.dns_names)
    ips = {"127.0.0.1"}
    ips.update(config.server.ip_addresses)
    for host in (urlparse(config.server.endpoint).hostname, config.server.advertised_host):
        if not host:
            continue
        try:
            ip = ipaddress.ip_address(host)
            if not ip.is_unspecified:
                ips.add(str(ip))
        except ValueError:
            hostnames.add(host)
    try:
        for ip in socket.gethostbyname_ex(socket.gethostname())[2]:
            ips.add(ip)
    except OSError:
        pass
    return sorted(hostnames), sorted(ips)


def ua_services(config: ApplianceConfig) -> UaServices:
    """The domain services the OPC UA server is handed, each built from its part of the configuration (the NodeSet2
    export builds the same, for the same address space)."""
    from .drift import DriftDetector  # numpy only; a detector exists where a model has a drift reference
    jobs = config.jobs
    return UaServices(
        rate_limiter=RateLimiter(config.security.rate_limits),
        jobs=JobStore(max_per_client=jobs.max_per_client, result_ttl_s=jobs.result_ttl_s,
                      max_wait_s=jobs.max_wait_ms / 1000.0),
        variants=VariantRouter.for_config(config),
        drift={name: d for name, m in config.models.items() if m.kind == "tensor"
               and (d := DriftDetector.for_model(m)) is not None},
        classifiers=classifier_states(config),
        call_checks=CallChecks(config.engine.max_new_tokens))


def offline_ua_server(config: ApplianceConfig, services: dict):
    """The OPC UA server as `serve` builds it, for the NodeSet2 export (appliance.nodeset_export): the same
    construction and domain services, without PKI, accounts, alarms raised or listening, so that the exported file
    and a running box's address space cannot differ."""
    from uaserver.server import ApplianceUaServer
    return ApplianceUaServer(config, pki=None, trust_list=None, user_store=None, services=services,
                             domain=ua_services(config), device=config.engine.device,
                             alarms=lambda: dict.fromkeys(DAEMON_ALARMS, False))


class Appliance:
    def __init__(self, config: ApplianceConfig):
        self.config = config
        # the models as the UA layer reaches them (core.model_port), each answered by its worker (RemoteModel)
        self.services: dict[str, TensorModel | GenerativeModel] = {}
        self.variant_services: dict[str, dict[str, TensorModel | GenerativeModel]] = {}  # model -> {variant -> it}
        self.supervisors: list = []
        self.ua = None
        self.http = None
        self.watchdog = None
        self.audit = None
        self.crl_watch = None
        self.metrics: Metrics | None = None
        self._watchdog_task: asyncio.Task | None = None
        self._background = TaskSet(log, "background")  # short tasks (a prompt publish, a GPU worker's stop), kept
        self.cert_expiry_s = 0.0  # what appliance_server_certificate_expiry_seconds shows
        # the 1 Hz tick, alarms, readiness, status: it reads the models and workers, and these few facts
        self.supervision = Supervision(self.services, self.supervisors, SupervisedFacts(
            metrics=lambda: self.metrics, watchdog=lambda: self.watchdog, gpu_fault=lambda: self.gpu_fault,
            audit_torn=lambda: self.audit is not None and bool(self.audit.torn),
            cert_expiry_s=lambda: self.cert_expiry_s, ua=lambda: self.ua,
            sources=lambda: self.sources.statuses if self.sources is not None else {}))
        self._stopping = False
        self.gpu_fault: str | None = None  # the watchdog stopped the GPU workers: State Fault
        self.sources = None  # appliance.sources.supervisor.SourcesSupervisor, when the YAML has sources

    def build_services(self, device: str) -> dict[str, TensorModel | GenerativeModel]:
        """One supervised worker per model, or per `worker` group of models."""
        from .workers.cpu_share import CpuShares, worker_shares
        from .workers.remote import RemoteModel
        from .workers.supervisor import WorkerPolicy, WorkerSupervisor

        eng = self.config.engine
        policy = WorkerPolicy(timeout_s=eng.worker_timeout_s, memory_mb=eng.worker_memory_mb,
                              max_restarts=eng.worker_max_restarts, restart_window_s=eng.worker_restart_window_s,
                              backoff_s=eng.worker_restart_backoff_s, backoff_max_s=eng.worker_restart_backoff_max_s,
                              threads=eng.threads, log_level=self.config.logging.level,
                              log_format=self.config.logging.format)
        groups: dict[str, list] = {}
        for name, m in self.config.models.items():
            groups.setdefault(m.worker or name, []).append(m)
        cpu_shares = CpuShares(worker_shares(self.config), enabled=eng.cpu_shares != "off", threads=eng.threads)
        services = self.services  # filled in place: supervision holds the same dict
        self.variant_services.clear()
        for m in self.config.models.values():  # each A/B variant in a worker of its own
            for variant, v in m.variants.items():
                clone = dataclasses.replace(m, name=f"{m.name}@{variant}", path=str(v.resolved_path),
                                            resolved_path=v.resolved_path, version=v.version, variants={},
                                            fallback=None, worker=None)
                spec = model_spec(clone, eng, device.split(" ")[0], Path(self.config.server.state_dir))
                sup = WorkerSupervisor(clone.name, [spec], policy, on_event=self._model_event, metrics=self.metrics,
                                       cpu_shares=cpu_shares)
                sup.on_change.append(self._publish_soon)
                self.supervisors.append(sup)
                self.variant_services.setdefault(m.name, {})[variant] = RemoteModel(
                    clone.name, m.kind, sup, max_samples=m.max_samples,
                    served_path=self._served_path(clone, eng, device))
        for group, members in groups.items():
            specs = [model_spec(m, eng, device.split(" ")[0], Path(self.config.server.state_dir)) for m in members]
            sup = WorkerSupervisor(group, specs, policy,
                                   on_event=self._model_event, metrics=self.metrics, cpu_shares=cpu_shares)
            sup.on_change.append(self._publish_soon)
            self.supervisors.append(sup)
            for m in members:
                services[m.name] = RemoteModel(m.name, m.kind, sup, max_samples=m.max_samples,
                                               served_path=self._served_path(m, eng, device))
        return services

    def _served_path(self, m, eng, device: str):
        """What a reload loads: the version a deploy checks, else `current` (or the configured path)."""
        return lambda: model_spec(m, eng, device.split(" ")[0], Path(self.config.server.state_dir), candidate=True)

    def _model_event(self, name: str, kind: str, message: str) -> None:
        """A model's worker or engine reports a failure (load failed, worker replaced, given up)."""
        log.warning("model %s: %s: %s", name, kind, message)
        if self.audit is not None:
            self.audit.record(event="model_event", action=kind, session="", client="", user="appliance", role="",
                              model=name, status="BadInternalError", detail=message)
        if self.ua is not None:
            self.ua.emit_event(f"Model {name}: {kind}: {message}", severity=800)

    def _publish_soon(self) -> None:
        """A worker's restart began or ended: the address space (State, WorkerRestarting and its condition) shows it
        now, not at the next 0.25 s tick, so a control room sees the alarm clear as the model turns Ready."""
        if self.ua is not None and self.ua.server is not None and not self._stopping:
            self._background.start(self.ua.publish_values())

    def _audit_state(self, failing: bool, reason: str) -> None:
        """From the audit writer's thread: the log cannot be written (disk full, ...) or is written again."""
        if self.ua is None:
            return
        policy = self.config.audit.on_failure
        self.ua.emit_event("Audit log cannot be written: calls are " + ("refused" if policy == "refuse" else
                           "answered unaudited") + " until it can" if failing else "Audit log is written again",
                           severity=900 if failing else 300)

    async def start(self) -> None:
        from certs.pki import PKI
        from certs.validate import TrustList
        from uaserver.server import ApplianceUaServer

        from .audit import AuditLog
        from .http_server import MonitoringServer
        from .users import UserStore
        from .watchdog import Watchdog, make_backend

        cfg = self.config
        state_dir = Path(cfg.server.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        pki = PKI(state_dir)
        hostnames, ips = certificate_names(cfg)
        if pki.ensure(cfg.server.application_uri, hostnames, ips):
            log.info("created the appliance CA and server certificate in %s", state_dir / "pki")
        trust_list = TrustList(state_dir / "pki", require_crl=cfg.security.require_crl)

        device = resolve_device(cfg.engine.device)
        backend = make_backend(cfg.watchdog.backend)
        self.metrics = Metrics(gpu_present=backend is not None)
        self._watch_certificate(pki)
        if cfg.audit.enabled:
            audit_path = Path(cfg.audit.path) if cfg.audit.path else state_dir / "audit" / "audit.jsonl"
            self.audit = AuditLog(audit_path, max_bytes=cfg.audit.max_bytes, keep_files=cfg.audit.keep_files,
                                  metrics=self.metrics, on_state=self._audit_state, max_held=cfg.audit.queue_size)
        users = UserStore(state_dir, [(u.name, u.role, u.password_hash) for u in cfg.users],
                          backoff_s=cfg.security.login_backoff_s, backoff_max_s=cfg.security.login_backoff_max_s)
        wd = cfg.watchdog
        self.watchdog = Watchdog.from_config(backend, wd, metrics=self.metrics, on_state=self._watchdog_event,
                                             on_fault=self._watchdog_fault)
        self.watchdog.poll()
        self._watchdog_task = asyncio.create_task(self.watchdog.run(wd.interval_s), name="watchdog")

        self.build_services(device)
        for sup in self.supervisors:  # workers start loading while the server comes up
            if self._stopping:
                sup.begin_stop()  # SIGTERM came while starting: start no worker
            else:
                await sup.start()
        self.supervision.start()
        self.ua = ApplianceUaServer(cfg, pki=pki, trust_list=trust_list, user_store=users, services=self.services,
                                    domain=ua_services(cfg), metrics=self.metrics, audit=self.audit, device=device, health=self.supervision.health,
                                    supervision_alive=self.supervision.alive, alarms=self.supervision.alarms,
                                    variants=self.variant_services,
                                    certificate_changed=lambda: self._watch_certificate(pki))  # Part 12 ApplyChanges
        await self.ua.start()
        if self.audit is not None and self.audit.torn:
            self.ua.emit_event(f"Audit log: {self.audit.torn}", severity=800)
        self._start_crl_watch(pki)
        if self.cert_expiry_s < cfg.security.cert_expiry_warning_days * 86400:
            self.ua.emit_event("The server certificate expires within "
                               f"{cfg.security.cert_expiry_warning_days} days: renew it (a GDS's push, `appliance certs "
                               "csr` + `install-server`, or `appliance certs init --force`)", severity=700)
        if cfg.sources and not self._stopping:
            await self._start_sources(state_dir)
        if cfg.metrics.enabled:
            self.http = MonitoringServer(cfg.metrics.host, cfg.metrics.port, self.metrics,
                                         self.supervision.readiness, status=self.supervision.status_snapshot,
                                         ready_details=self.supervision.sources_down)
            await self.http.start()

    def _start_crl_watch(self, pki) -> None:
        """The CA's CRL re-signed in time by serve itself, with its metric and event (appliance/crl_watch.py); the
        CAs the validator will refuse for want of a CRL are named once at start."""
        from certs.store import load_snapshot
        from .crl_watch import CrlWatch
        sec = self.config.security
        self.crl_watch = CrlWatch(pki, metrics=self.metrics, audit=self.audit, emit_event=self.ua.emit_event,
                                  interval_s=sec.crl_check_interval_s, warning_days=sec.cert_expiry_warning_days)
        self.crl_watch.publish(False, pki.crl_next_update())  # ensure() has just re-signed it if it was due
        self.crl_watch.start()
        if sec.require_crl:
            for ca in load_snapshot(pki.layout).cas_without_crl():
                message = (f"The trusted CA {ca.cert.subject.rfc4514_string()} has no CRL in pki/crl: the "
                           "certificates it issued are refused (security.require_crl)")
                log.warning(message)
                self.ua.emit_event(message, severity=700)

    async def _start_sources(self, state_dir: Path) -> None:
        """The sources client process (appliance/sources): each source's client certificate from the appliance CA
        on first start, then the process, whose windows and states go to the address space (uaserver/sources.py)."""
        from .sources.identity import SourceFiles
        from .sources.specs import source_spec
        from .sources.supervisor import SourcesSupervisor
        for warning in self.config.warnings:
            log.warning("%s", warning)
        for name in self.config.sources:
            if SourceFiles.of(state_dir, name).ensure_client_certificate(state_dir, name):
                log.info("issued the client certificate for source %s (pki/sources/%s/client.der: import it into "
                         "the source server's trust list)", name, name)
        specs = [source_spec(src, state_dir) for src in self.config.sources.values()]
        self.sources = SourcesSupervisor(specs, on_window=self.ua.sources.window, on_status=self.ua.sources.status,
                                         log_level=self.config.logging.level, log_format=self.config.logging.format,
                                         metrics=self.metrics)
        self.ua.sources.writer = self.sources.write  # results into the YAML's write_back NodeIds, audited there
        await self.sources.start()

    def _watch_certificate(self, pki) -> None:
        from datetime import datetime, timezone
        left = (pki.server_cert_not_after() - datetime.now(timezone.utc)).total_seconds()
        self.metrics.server_cert_expiry.set(left)
        self.cert_expiry_s = left
        expiring = left < self.config.security.cert_expiry_warning_days * 86400
        self.metrics.server_cert_expiring.set(1 if expiring else 0)
        if expiring:
            log.warning("the server certificate expires in %.0f days: renew it (a GDS's push, `appliance certs csr` "
                        "+ `install-server`, or `appliance certs init --force` with the appliance CA)",
                        left / 86400)

    def _watchdog_fault(self, message: str) -> None:
        """A lost GPU or an uncorrectable ECC error: stop the workers of models on the GPU (the appliance is Fault);
        models on the CPU keep serving. Called from the watchdog's task on the loop."""
        log.error("watchdog fault: %s: stopping the GPU workers", message)
        self.gpu_fault = message
        if self.ua is not None:
            self.ua.emit_event(f"Watchdog fault: {message}; models on the GPU stopped", severity=1000)
        for sup in self.supervisors:
            if any(on_gpu(spec) for spec in sup.specs):
                self._background.start(sup.give_up(f"stopped by the GPU watchdog: {message}"))  # Failed, with why

    def _watchdog_event(self, state: str, previous: str, message: str) -> None:
        log.warning("watchdog %s -> %s: %s", previous, state, message)
        shed = self.watchdog.actions.shed_load if self.watchdog is not None else False
        for model in self.services.values():
            if model.shedding != shed:
                model.shed_load(shed)
        if self.ua is not None:
            self.ua.emit_event(f"Watchdog {state}: {message}", severity=900 if state == "Critical" else 600)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            models = [*self.services.values(), *(v for arms in self.variant_services.values() for v in arms.values())]
            if all(s.status().state != "Loading" for s in models):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("models did not finish loading")

    def reload_soon(self, notifier) -> None:
        """SIGHUP's handler: the reload runs as a kept task (a failure is logged, the stop waits for it)."""
        self._background.start(self.reload_config(notifier))

    async def reload_config(self, notifier) -> None:
        """SIGHUP (`systemctl reload`): re-read what can change live: the log level and the rate limits (the trust
        list is re-read whenever its folders change anyway). Everything else needs a restart; the log says so."""
        notifier.reloading()
        try:
            from core.config import ConfigError, load_config
            if self.config.source.startswith("<") or not Path(self.config.source).exists():
                log.warning("reload: the built-in demo configuration has no file to re-read")
                return
            try:
                new = load_config(self.config.source)
            except ConfigError as e:
                log.error("reload refused, the configuration has errors (the running one stays):\n%s",
                          "\n".join(e.errors))
                return
            configure_logging(new)
            if self.ua is not None:
                self.ua.set_rate_limiter(RateLimiter(new.security.rate_limits))
            log.warning("configuration re-read from %s: logging and rate limits applied; other changes need a "
                        "restart", self.config.source)
        finally:
            notifier.ready(self.supervision.status_line())

    async def drain(self) -> None:
        """Stop taking calls; let those in flight finish within server.drain_timeout_s; answer the rest BadTimeout."""
        if self.ua is None:
            return
        timeout_s = self.config.server.drain_timeout_s

        def answer_overdue() -> None:
            log.warning("calls still running after %.1f s: answering them BadTimeout", timeout_s)
            for sup in self.supervisors:
                sup.fail_pending(DeadlineExceeded("the appliance is shutting down"))
        await self.ua.drain(timeout_s, answer_overdue)

    def begin_stop(self) -> None:
        """SIGTERM (systemctl stop, a reboot): from now on a worker that ends is no crash, and none is started.
        Called in the signal's own loop turn, before anything could take a worker's end for a death."""
        self._stopping = True
        for sup in self.supervisors:
            sup.begin_stop()

    async def stop(self) -> None:
        self.begin_stop()
        await self.drain()
        if self.ua is not None:
            await self.ua.stop()  # closes sessions first: their slots are freed; flushes the audit records
        if self.http is not None:
            await self.http.stop()
        if self.sources is not None:
            await self.sources.stop()
        await asyncio.gather(*(sup.stop() for sup in self.supervisors), return_exceptions=True)
        await self.supervision.stop()
        if self.crl_watch is not None:
            await self.crl_watch.stop()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        await self._background.cancel_all()
        if self.watchdog is not None and self.watchdog.backend is not None:
            self.watchdog.backend.close()  # each backend's close handles its own errors


SIGNAL_MEANING = {signal.SIGINT: "Ctrl-C will not drain calls before the appliance stops",
                  signal.SIGTERM: "`systemctl stop` will not drain calls before the appliance stops",
                  signal.SIGHUP: "`systemctl reload` will not re-read the configuration"}


def install_signal_handlers(loop: asyncio.AbstractEventLoop, handlers: dict) -> list[signal.Signals]:
    """Each signal's handler on the loop: signal -> (callback, *args). One that cannot be installed (a loop
    outside the main thread, a platform without signals) is logged with what it costs, never silently absent.
    Returns the signals whose handler is missing."""
    missing = []
    for sig, (callback, *args) in handlers.items():
        try:
            loop.add_signal_handler(sig, callback, *args)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            missing.append(sig)
            log.error("cannot install the %s handler (%s): %s", signal.Signals(sig).name, e,
                      SIGNAL_MEANING.get(sig, "the signal keeps its default action"))
    return missing


def configure_logging(config: ApplianceConfig) -> None:
    logs.configure_logging(config.logging.level, config.logging.format)


async def serve(config: ApplianceConfig) -> int:
    import gc
    import sys
    # The event loop shares the GIL with the inference and audit threads; after a blocking call (a socket send)
    # it waits up to the switch interval to get the GIL back. 5 ms by default is longer than a whole call here.
    sys.setswitchinterval(0.0005)
    from .sdnotify import Notifier

    app = Appliance(config)
    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop_signal() -> None:
        app.begin_stop()
        stop.set()
    install_signal_handlers(loop, {signal.SIGINT: (on_stop_signal,), signal.SIGTERM: (on_stop_signal,),
                                   signal.SIGHUP: (app.reload_soon, notifier)})
    notifier.status("starting: PKI, OPC UA server, model workers")
    await app.start()
    # What start built (the address space, certificates, modules) lives as long as the process: an asyncua server's
    # standard address space alone is 460,000 tracked objects, and one full collection of them stalled the loop for
    # 185 ms here. Frozen, the collector never walks them again; what calls allocate is still collected.
    gc.freeze()
    print(f"appliance: OPC UA on {config.server.endpoint}"
          + (f", monitoring on http://{config.metrics.listen}" if config.metrics.enabled else "")
          + f", state in {config.server.state_dir}", flush=True)
    systemd = asyncio.create_task(tell_systemd(app, notifier), name="systemd")
    try:
        await stop.wait()
    finally:
        notifier.stopping()
        systemd.cancel()
        await app.stop()
        notifier.close()
    return 0
