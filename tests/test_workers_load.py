"""Worker deaths under load and a short soak: every call gets exactly one answer (Good or a contract code) no later
than its deadline, the killed model comes back, the others never notice, and nothing leaks.

The soak runs SOAK_S seconds (default 100, about the two minutes the issue asks of CI with set-up); set
APPLIANCE_SOAK_S for a long soak. Leaks are judged by rate (MB/s of RSS, a least-squares slope over the later half
of each process's settled samples), not by the growth over a process's life: the workers are killed mid-soak, so a
worker lives 30-80 s and a 0.7 MB/s leak grew less than a bound in MB allowed. APPLIANCE_SOAK_LEAK_MB_S=R makes every
process of the appliance (serve and its workers) leak R MB/s, to check that the check catches it."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time

import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, read, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType
DEADLINE_S = 6.0
SLACK_S = 1.0  # a loaded 2-core machine: the answer may trail the server's deadline by network and scheduling
ALLOWED_DURING_DEATH = {"Good", "BadInternalError", "BadInvalidState", "BadTimeout", "BadResourceUnavailable"}
SOAK_S = float(os.environ.get("APPLIANCE_SOAK_S", "100"))


def gen_args(prompt: str, max_tokens: int = 6):
    return [ua.Variant(prompt, V.String), ua.Variant(max_tokens, V.UInt32), ua.Variant(0.0, V.Float)]


LEAK_CHECK_MB_S = float(os.environ.get("APPLIANCE_SOAK_LEAK_MB_S", "0") or 0)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    if LEAK_CHECK_MB_S:  # the workers load tests/hooks/sitecustomize.py, which leaks (checking the check)
        hooks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks")
        os.environ["PYTHONPATH"] = hooks + os.pathsep + os.environ.get("PYTHONPATH", "")
        os.environ["APPLIANCE_TEST_LEAK_MB_S"] = str(LEAK_CHECK_MB_S)
    d = tmp_path_factory.mktemp("workers_load")
    make_model_dir(d / "chat")
    models = {"classifier": {"kind": "tensor", "path": str(affine_model(d / "affine.onnx"))},
              "chat": {"kind": "generative", "path": str(d / "chat"), "max_text_chars": 200}}
    a = RunningAppliance(d / "state", models, {
        "engine": {"request_timeout_s": DEADLINE_S, "kv_slots": 40, "max_seq_len": 512, "max_new_tokens": 32,
                   "worker_restart_backoff_s": 0.1, "worker_max_restarts": 50},
        "security": {"limits": {"max_sessions": 128, "max_secure_channels": 128}}})
    a.operator = a.issue("plc1", "operator")
    a.engineer = a.issue("eng", "engineer")
    yield a
    a.stop()


class Ledger:
    """Every call made and its one answer."""

    def __init__(self):
        self.calls: list[tuple[str, str, float, float]] = []  # (model, status, started, latency)

    async def timed(self, model: str, coro):
        started = time.monotonic()
        r = await coro
        self.calls.append((model, status_name(r), started, time.monotonic() - started))
        return r


async def classifier_client(app, ledger: Ledger, stop: asyncio.Event):
    async with session(app, *app.operator) as c:
        while not stop.is_set():
            await ledger.timed("classifier", call(c, "classifier", "Infer", [floats([1, 2, 3, 4])]))


async def chat_client(app, ledger: Ledger, stop: asyncio.Event, n: int):
    async with session(app, *app.operator) as c:
        turn = 0
        while not stop.is_set():
            turn += 1
            r = await ledger.timed("chat", call(c, "chat", "Generate", gen_args(f"Valve {n} turn {turn}")))
            if status_name(r) == "Good" and turn > 6:  # keep contexts short: start over now and then
                await call(c, "chat", "ResetContext", [])
                turn = 0


def kill_worker(app, model: str) -> tuple[int, float]:
    pid = app.app.services[model].supervisor.process.pid
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


async def answers_again(app, model: str, since: float) -> float:
    """Seconds from `since` until the model answers a call Good again."""
    async with session(app, *app.operator) as c:
        while True:
            if model == "chat":
                r = await call(c, "chat", "Generate", gen_args("Are you back?", 2))
            else:
                r = await call(c, model, "Infer", [floats([1, 1, 1, 1])])
            if status_name(r) == "Good":
                return time.monotonic() - since
            await asyncio.sleep(0.05)


def audited_calls(app, after_line: int) -> int:
    lines = (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()[after_line:]
    return sum(1 for line in lines if json.loads(line).get("action") in ("Infer", "Generate"))


def audit_lines(app) -> int:
    path = app.state_dir / "audit" / "audit.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def check_ledger(ledger: Ledger, unaffected: str = "classifier") -> None:
    for model, status, _, latency in ledger.calls:
        assert status in ALLOWED_DURING_DEATH, (model, status)
        assert latency <= DEADLINE_S + SLACK_S, (model, status, latency)
        if model == unaffected:
            assert status == "Good", (model, status)


def test_kill_of_the_language_model_worker_under_load(app):
    ledger = Ledger()
    first_audit_line = audit_lines(app)

    async def go():
        stop = asyncio.Event()
        clients = [asyncio.create_task(classifier_client(app, ledger, stop)) for _ in range(16)]
        clients += [asyncio.create_task(chat_client(app, ledger, stop, n)) for n in range(8)]
        await asyncio.sleep(4)
        pid, killed_at = kill_worker(app, "chat")
        recovery = await answers_again(app, "chat", killed_at)
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*clients)
        return pid, recovery

    pid, recovery = run(go(), timeout=120)
    print(f"language model answers again {recovery:.2f} s after kill -9")
    check_ledger(ledger)
    statuses = [s for m, s, _, _ in ledger.calls if m == "chat"]
    assert "Good" in statuses and len([s for m, s, _, _ in ledger.calls if m == "classifier"]) > 50
    assert recovery < 30
    time.sleep(1.0)  # the audit writer thread catches up
    # exactly once: the server audited as many model calls as the clients got answers (+ the recovery probes)
    audited = audited_calls(app, first_audit_line)
    assert len(ledger.calls) <= audited <= len(ledger.calls) + 200


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _processes(app) -> dict[str, int]:
    procs = {"serve": os.getpid()}
    for name, model in app.app.services.items():
        procs[name] = model.supervisor.process.pid
    return procs


def test_soak_with_worker_kills_and_reloads(app):
    """32 sessions on both models for SOAK_S seconds; each worker killed once and a model reloaded twice."""
    ledger = Ledger()

    samples: dict[int, list[tuple[str, float, float, int]]] = {}  # pid -> (process, time, RSS MB, fds)

    leak: list[bytes] = []

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            if LEAK_CHECK_MB_S:  # the serve process's share of the checking leak, pages touched
                leak.append(b"\x01" * int(LEAK_CHECK_MB_S * 2**20))
            for name, pid in _processes(app).items():
                try:
                    samples.setdefault(pid, []).append((name, time.monotonic(), _rss_mb(pid), _fds(pid)))
                except OSError:  # a worker just killed
                    pass
            await asyncio.sleep(1.0)

    async def go():
        stop = asyncio.Event()
        clients = [asyncio.create_task(classifier_client(app, ledger, stop)) for _ in range(16)]
        clients += [asyncio.create_task(chat_client(app, ledger, stop, n)) for n in range(16)]
        sampler = asyncio.create_task(sample(stop))
        await asyncio.sleep(min(10, SOAK_S / 5))
        events = ["kill classifier", "reload chat", "kill chat", "reload classifier"]
        step = (SOAK_S - 20) / len(events)
        for event in events:
            await asyncio.sleep(step)
            what, model = event.split()
            if what == "kill":
                _, at = kill_worker(app, model)
                await answers_again(app, model, at)
            else:
                async with session(app, *app.engineer) as c:
                    r = await call(c, "", "ReloadModel", [ua.Variant(model, V.String)])
                    assert status_name(r) == "Good", event
        await asyncio.sleep(max(12, SOAK_S / 10))  # the last worker restarted runs under load long enough too
        stop.set()
        await asyncio.gather(*clients, sampler)
        await asyncio.sleep(1.5)  # closed sessions release their slots; values published within 1 s
        async with session(app, *app.operator) as c:
            in_use = await read(c, "Engine", "SlotsInUse")
        return in_use

    in_use = run(go(), timeout=SOAK_S + 120)
    growth, rates = process_growth(samples), leak_rates(samples)
    if os.environ.get("APPLIANCE_SOAK_SERIES"):
        for pid, rows in samples.items():
            print(rows[0][0], pid, [round(r[2]) for r in rows])
    ok = [latency for _, status, _, latency in ledger.calls if status == "Good"]
    print(f"soak: {len(ledger.calls)} calls, {len(ok)} Good, p50 {statistics.median(ok) * 1000:.1f} ms; "
          f"growth per process (MB RSS, fds) {growth}; RSS slope of the later half (MB/s) {rates}")
    for model, status, _, latency in ledger.calls:
        assert status in ALLOWED_DURING_DEATH, (model, status)
        assert latency <= DEADLINE_S + SLACK_S, (model, status, latency)
    assert in_use <= 1  # the probe session of this check may hold one; every soak session's slot came back
    # Flat, every process: serve (alive throughout) and each worker process, the killed ones and their
    # replacements alike, from a few seconds after it came up to its last sample (bounds stated in the README).
    assert {name for name, _pid in growth} == {"serve", "classifier", "chat"}, growth
    for (name, pid), (rss, fds) in growth.items():
        assert rss < SOAK_RSS_GROWTH_MB[name], (name, pid, rss)
        assert fds < SOAK_FD_GROWTH, (name, pid, fds)
    # no process leaks at a rate: every model's worker and serve judged over at least LEAK_SPAN_S
    assert {name for name, _pid in rates} == {"serve", "classifier", "chat"}, rates
    for (name, pid), rate in rates.items():
        assert rate < SOAK_LEAK_MB_S, (name, pid, f"RSS grows {rate:.2f} MB/s")


SOAK_RSS_GROWTH_MB = {"serve": 80, "classifier": 60, "chat": 150}  # README: "Workers and restarts"
SOAK_FD_GROWTH = 20
SETTLE_S = 10.0  # a process's first seconds (imports, model load, the engine's kernels for its shapes) are not growth
# Rates: measured here the serve process (which holds the test's 32 clients and its ledger too) grew 0.1 MB/s and
# the workers' later halves 0-0.06 MB/s; a 0.7 MB/s leak shows as 0.7.
SOAK_LEAK_MB_S = 0.25
LEAK_SPAN_S = 20.0
WARM_S = 30.0  # a generative worker touches its KV cache's pages as calls fill its slots: 20-30 s here


def _settled(rows: list) -> list:
    """A process's samples from SETTLE_S after its first on, without those of its end (a killed worker's zombie
    has no RSS: 0 would read as shrinking and hide a leak)."""
    first = rows[0][1]
    return [r for r in rows if r[1] >= first + SETTLE_S and r[2] > 0]


def leak_rates(samples: dict) -> dict:
    """(process, pid) -> MB/s: the least-squares slope of RSS over the later half of its settled samples, from WARM_S
    on (a worker's warm-up, its KV slots filled by the first calls, is not a leak), for each process whose samples
    there span at least LEAK_SPAN_S."""
    out = {}
    for pid, rows in samples.items():
        settled = _settled(rows)
        later = [r for r in settled[len(settled) // 2:] if r[1] >= rows[0][1] + WARM_S]
        if len(later) < 3 or later[-1][1] - later[0][1] < LEAK_SPAN_S:
            continue
        ts, ms = [r[1] for r in later], [r[2] for r in later]
        t0, m0 = statistics.fmean(ts), statistics.fmean(ms)
        slope = sum((t - t0) * (m - m0) for t, m in zip(ts, ms)) / sum((t - t0) ** 2 for t in ts)
        out[(rows[0][0], pid)] = round(slope, 3)
    return out


def process_growth(samples: dict) -> dict:
    """(process, pid) -> (RSS MB, fds) grown from SETTLE_S after its first sample to its last, for every process
    sampled over at least 5 s after it settled."""
    out = {}
    for pid, rows in samples.items():
        name = rows[0][0]
        settled = _settled(rows)
        if len(settled) >= 2 and settled[-1][1] - settled[0][1] >= 5:
            out[(name, pid)] = (round(settled[-1][2] - settled[0][2], 1), settled[-1][3] - settled[0][3])
    return out


def test_a_session_whose_worker_died_sees_context_lost_once(app):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "chat", "Generate", gen_args("Remember valve 7"))
            assert status_name(r) == "Good" and r.OutputArguments[4].Value is False
            _, at = kill_worker(app, "chat")
            await answers_again(app, "chat", at)
            r = await call(c, "chat", "Generate", gen_args("Which valve?"))
            assert status_name(r) == "Good" and r.OutputArguments[4].Value is True  # ContextLost
            r = await call(c, "chat", "Generate", gen_args("And now?"))
            assert status_name(r) == "Good" and r.OutputArguments[4].Value is False
    run(go())
