"""What the appliance costs on top of a bare asyncua server, and what batching buys.

Calls per second and p50/p99 latency of `Infer` on the demo fault classifier through the appliance, and of an Echo
method on a bare asyncua server with the same security policy (Basic256Sha256, SignAndEncrypt), in the same run, with
1 and 16 concurrent clients (one outstanding call each). Each server runs in its own process; the clients share this
one. Prints the ratios appliance/bare: calls per second at 1 client (goal >= 0.6) and at 16 (goal >= 0.65), the
p99 latency at 16 (goal <= 2) and serve's CPU per call (goal <= 1.6).

Each run also gives the server process's CPU time per call (from /proc), split into user and system time, its
blocking waits per call (voluntary context switches: epoll, the GIL, locks), for the appliance its model worker's,
and the clients' (this process's, while the calls ran). Other load on the machine inflates CPU time (caches, a
thread holding the GIL while it waits for a CPU), so the server's CPU per call is also taken over each 0.5 s of the
run and the quietest windows' figure (their 20th percentile) printed beside it: compare those on a busy machine.
`--profile DIR` records both servers with py-spy (GIL-holding samples only: the Python work per call) and prints
the top functions and files, each in microseconds per call. `--cpu-latency-us 0` runs everything with no CPU halting when idle (PM QoS, root): what the wake-ups of
idle CPUs cost each server, from one run to the next.

Then, with 1 client, the paths for PLCs that must not block, each beside a synchronous `Infer` in the same run:
`StartInfer` + `GetInferResult(WaitMs=2000)` (two calls; the second returns as soon as the job is done), and a
mailbox request-to-Done (one Write of Input and Request, then the subscription's publish of Response/Done) at each
`--publishing-ms` interval. Prints p50/p99 and the ratios to Infer (goal: the mailbox within 2x of Infer at p50).

    .venv/bin/python bench/ua_overhead.py [--seconds 5] [--clients 1 16] [--publishing-ms 1 10] [--recovery 5]
                                          [--profile DIR] [--cpu-latency-us 0]
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from asyncua import Client, ua
from asyncua.crypto import security_policies

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/ports.py

from appliance.client import call_method, connect, model_node  # noqa: E402
from certs.pki import PKI  # noqa: E402
from models.te_classifier import INPUT_SHAPE, load_te_test_windows  # noqa: E402
from ports import free_ports, wait_port  # noqa: E402


WINDOW_S = 0.5  # the server's CPU per call is also taken over windows this long while the calls run
QUIET_PERCENTILE = 20  # ... and the windows' 20th percentile reported: the least disturbed by other load


async def drive(make_call, clients: int, seconds: float, server_pid: int | None = None) \
        -> tuple[float, list[float], float, list[float]]:
    """Calls per second, each call's latency, this process's CPU seconds while the calls ran (the clients' own
    cost per call, connecting and warming up left out), and with server_pid the server's CPU microseconds per call
    in each WINDOW_S of the run (its threads' time on a CPU, from /proc/PID/task/*/schedstat: nanoseconds)."""
    latencies: list[float] = []
    windows: list[float] = []
    stop = math.inf  # set once the connections are made and warm

    async def worker(call):
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    async def sample():
        calls0, cpu0 = len(latencies), on_cpu_seconds(server_pid)
        while time.perf_counter() + WINDOW_S < stop:
            await asyncio.sleep(WINDOW_S)
            calls1, cpu1 = len(latencies), on_cpu_seconds(server_pid)
            if calls1 > calls0:
                windows.append((cpu1 - cpu0) / (calls1 - calls0) * 1e6)
            calls0, cpu0 = calls1, cpu1

    calls = [await make_call() for _ in range(clients)]
    for call in calls:  # warm up each connection
        await call()
    t0, cpu0 = time.perf_counter(), time.process_time()
    stop = t0 + seconds
    await asyncio.gather(*[worker(c) for c in calls], *([sample()] if server_pid else []))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in calls:
        await c.close()
    return len(latencies) / elapsed, latencies, cpu, windows


def on_cpu_seconds(pid: int) -> float:
    """Seconds the process's threads have spent on a CPU (the scheduler's own count, in nanoseconds)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total / 1e9


class ApplianceCaller:
    def __init__(self, endpoint, cert, key, sample):
        self.endpoint, self.cert, self.key, self.sample = endpoint, cert, key, sample

    async def open(self):
        self.client = await connect(self.endpoint, self.cert, self.key)
        self.model, ns = await model_node(self.client, "te-classifier")
        self.method = await self.model.get_child(f"{ns}:Infer")
        self.args = [ua.Variant(self.sample, ua.VariantType.Float)]
        return self

    async def __call__(self):
        r = await call_method(self.client, self.model, self.method, self.args)
        if not r.StatusCode.is_good():
            raise RuntimeError(r.StatusCode.name)

    async def close(self):
        await self.client.disconnect()


class BareCaller:
    def __init__(self, endpoint, cert, key, sample):
        self.endpoint, self.cert, self.key, self.sample = endpoint, cert, key, sample

    async def open(self):
        from appliance.client import certificate_uri
        c = Client(self.endpoint, timeout=30)
        c.application_uri = certificate_uri(self.cert)
        await c.set_security(security_policies.SecurityPolicyBasic256Sha256, str(self.cert), str(self.key),
                             mode=ua.MessageSecurityMode.SignAndEncrypt)
        await c.connect()
        self.client = c
        ns = await c.get_namespace_index("urn:bench:bare")
        self.obj = await c.nodes.objects.get_child(f"{ns}:Bench")
        self.method = await self.obj.get_child(f"{ns}:Echo")
        self.args = [ua.Variant(self.sample, ua.VariantType.Float)]
        return self

    async def __call__(self):
        r = await call_method(self.client, self.obj, self.method, self.args)
        if not r.StatusCode.is_good():
            raise RuntimeError(r.StatusCode.name)

    async def close(self):
        await self.client.disconnect()


class JobCaller(ApplianceCaller):
    """StartInfer, then GetInferResult with WaitMs 2000 (answers once the job is done): two round trips per result,
    as a PLC that must not block would do. Results are left to the result TTL (jobs.max_per_client is raised for
    the run), so ReleaseJob does not count."""

    async def open(self):
        await super().open()
        ns = self.method.nodeid.NamespaceIndex
        self.start = await self.model.get_child(f"{ns}:StartInfer")
        self.get = await self.model.get_child(f"{ns}:GetInferResult")
        return self

    async def __call__(self):
        r = await call_method(self.client, self.model, self.start, self.args)
        if not r.StatusCode.is_good():
            raise RuntimeError(r.StatusCode.name)
        job = r.OutputArguments[0]
        r = await call_method(self.client, self.model, self.get, [job, ua.Variant(2000, ua.VariantType.UInt32)])
        if not r.StatusCode.is_good() or not r.OutputArguments[0].Value:
            raise RuntimeError(f"GetInferResult: {r.StatusCode.name}")


class MailboxCaller:
    """A client that only writes and subscribes: one Write of Input and Request, then waits for the publish that
    shows Response == Request (Done, Busy and Output come in the same publish)."""

    def __init__(self, endpoint, cert, key, sample, publishing_ms: float):
        self.endpoint, self.cert, self.key, self.sample = endpoint, cert, key, sample
        self.publishing_ms = publishing_ms
        self.request = 0
        self.waiting: asyncio.Future | None = None
        self.write_s: list[float] = []  # Write round trip of each request
        self.after_write_s: list[float] = []  # from the Write's answer to the publish with the result

    def datachange_notification(self, node, val, data):
        if self.waiting is not None and not self.waiting.done() and val == self.request:
            self.waiting.set_result(time.perf_counter())

    async def open(self):
        self.client = await connect(self.endpoint, self.cert, self.key)
        ns = await self.client.get_namespace_index("urn:opcua-inference-appliance")
        box = await self.client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Mailboxes", f"{ns}:te-classifier"])
        self.input, self.request_node, response = [await box.get_child(f"{ns}:{k}")
                                                   for k in ("Input", "Request", "Response")]
        self.request = await response.read_value()
        self.sub = await self.client.create_subscription(self.publishing_ms, self)
        await self.sub.subscribe_data_change(response)
        return self

    async def __call__(self):
        self.request += 1
        self.waiting = asyncio.get_running_loop().create_future()
        params = ua.WriteParameters()
        for node, variant in ((self.input, ua.Variant(self.sample, ua.VariantType.Float)),
                              (self.request_node, ua.Variant(self.request, ua.VariantType.UInt32))):
            wv = ua.WriteValue()
            wv.NodeId, wv.AttributeId, wv.Value = node.nodeid, ua.AttributeIds.Value, ua.DataValue(variant)
            params.NodesToWrite.append(wv)
        t0 = time.perf_counter()
        statuses = await self.client.uaclient.write(params)
        t1 = time.perf_counter()
        if not all(st.is_good() for st in statuses):
            raise RuntimeError(str([st.name for st in statuses]))
        done = await asyncio.wait_for(self.waiting, 10)
        self.write_s.append(t1 - t0)
        self.after_write_s.append(done - t1)

    async def close(self):
        MailboxCaller.last = self
        await self.client.disconnect()


def async_paths(endpoint: str, cert, key, sample, seconds: float, publishing: list[float]) -> None:
    """Infer beside StartInfer + GetInferResult and the mailbox, 1 client each, alternating in the same run."""
    rows = []

    def run(label, make):
        rate, lat, _, _ = asyncio.run(drive(make, 1, seconds))
        rows.append((label, lat))
        print(f"{label:34s} {summary(rate, lat)}", flush=True)
        return lat

    async def infer():
        return await ApplianceCaller(endpoint, cert, key, sample).open()

    async def job():
        return await JobCaller(endpoint, cert, key, sample).open()
    base = run("Infer (synchronous)", infer)
    jobs = run("StartInfer + GetInferResult", job)
    boxes = {}
    for ms in publishing:
        async def box(ms=ms):
            return await MailboxCaller(endpoint, cert, key, sample, ms).open()
        boxes[ms] = run(f"mailbox request-to-Done, publish {ms:g} ms", box)
        last = MailboxCaller.last
        print(f"{'':34s} of which: Write answered p50 {np.percentile(last.write_s, 50) * 1000:.2f} ms, then the "
              f"result's publish p50 {np.percentile(last.after_write_s, 50) * 1000:.2f} ms", flush=True)
    base2 = run("Infer (synchronous), again", infer)
    p50 = float(np.percentile(base + base2, 50))
    p99 = float(np.percentile(base + base2, 99))
    print(f"jobs / Infer: p50 {np.percentile(jobs, 50) / p50:.2f}x  p99 {np.percentile(jobs, 99) / p99:.2f}x")
    for ms, lat in boxes.items():
        print(f"mailbox (publishing interval {ms:g} ms) / Infer: p50 {np.percentile(lat, 50) / p50:.2f}x "
              f"(goal <= 2)  p99 {np.percentile(lat, 99) / p99:.2f}x")


def wait_ready(listen: str, timeout: float = 300) -> None:
    import urllib.request
    end = time.time() + timeout
    while time.time() < end:
        try:
            if urllib.request.urlopen(f"http://{listen}/readyz", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the appliance did not become ready")


def worker_pids(serve_pid: int) -> dict[str, int]:
    """group name -> pid of serve's worker processes (their command line names the group)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != serve_pid:
                continue
            args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            pids[args[args.index(b"--group") + 1].decode()] = int(entry)
        except (OSError, ValueError, IndexError):
            pass
    return pids


def measure_recovery(app: subprocess.Popen, cert, key, sample, port: int, times: int) -> None:
    """kill -9 of each demo model's worker: seconds until a call is answered Good again (median of `times`)."""
    import signal
    import statistics

    async def first_good(model: str, killed_at: float) -> float:
        client = await connect(f"opc.tcp://127.0.0.1:{port}", cert, key)
        try:
            parent, ns = await model_node(client, model)
            if model == "assistant":
                method, args = await parent.get_child(f"{ns}:Generate"), [
                    ua.Variant("Hi", ua.VariantType.String), ua.Variant(1, ua.VariantType.UInt32),
                    ua.Variant(0.0, ua.VariantType.Float)]
            else:
                method, args = await parent.get_child(f"{ns}:Infer"), [ua.Variant(sample, ua.VariantType.Float)]
            while True:
                r = await call_method(client, parent, method, args)
                if r.StatusCode.is_good():
                    return time.perf_counter() - killed_at
                await asyncio.sleep(0.02)
        finally:
            await client.disconnect()

    for model in ("te-classifier", "assistant"):
        seconds = []
        for _ in range(times):
            pid = worker_pids(app.pid)[model]
            os.kill(pid, signal.SIGKILL)
            seconds.append(asyncio.run(first_good(model, time.perf_counter())))
            time.sleep(1.0)
        goal = 3 if model == "te-classifier" else 10
        print(f"recovery after kill -9, {model}: median {statistics.median(seconds):.2f} s of "
              f"{[round(x, 2) for x in seconds]} (goal <= {goal} s)", flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used (its threads included)."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds the process has used (its threads included): system time is the kernel's work
    for it (socket reads and writes, epoll waits, wake-ups), user time its own code."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


PROFILE_RATE = 500  # py-spy samples per second


def voluntary_switches(pid: int) -> int:
    """How often the process's threads blocked so far (voluntary context switches: epoll waits, a thread waiting for
    the GIL or a lock). Unlike CPU time, other load on the machine does not inflate it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):  # a thread that ended meanwhile
            pass
    return total


def profile_seconds(seconds: float) -> int:
    return max(1, int(seconds) - 1)


def profile_start(pid: int, folder: Path, name: str, seconds: float) -> subprocess.Popen:
    """py-spy sampling a server process (its Python threads) for the length of one run, after the warm-up."""
    folder.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy into this environment)")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(profile_seconds(seconds)),
                             "--rate", str(PROFILE_RATE), "--gil", "--format", "raw", "--output",
                             str(folder / f"{name}.txt"), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_report(spy: subprocess.Popen, path: Path, calls: float, top: int = 25) -> None:
    """Print the functions with the most samples of their own (self) and in total, and the files with the most of
    their own, from py-spy's collapsed stacks; each as a share of the samples and as microseconds per call (a sample
    stands for 1/PROFILE_RATE s of the GIL held; `calls`: how many calls the profiled seconds served)."""
    spy.wait(60)
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    files: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a frame name with a line break in it (py-spy writes what the code object holds)
            continue
        frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")]
        n = int(count)
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
        leaf = stack.rsplit(";", 1)[-1]
        where = leaf[leaf.find("(") + 1:].rsplit(":", 1)[0] if "(" in leaf else leaf
        thread = "[thread] " if "Thread._bootstrap" in stack else ""
        files[thread + where] = files.get(thread + where, 0) + n
    us = 1e6 / PROFILE_RATE / max(calls, 1)
    print(f"profile ({path}): {samples} samples, {samples * us:.0f} us of the GIL held per call")
    for title, table in (("self", own), ("total", total), ("file (self)", files)):
        print(f"  top by {title}:")
        for frame, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"    {100 * n / samples:5.1f} % {n * us:6.1f} us  {frame}")


def hold_cpu_latency(microseconds: int) -> None:
    """Ask the kernel (PM QoS) to keep every CPU within `microseconds` of waking until this process exits: the file
    descriptor stays open for the process's life. With 0 the idle loop polls and no CPU halts."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as exc:
        raise SystemExit(f"--cpu-latency-us: cannot open /dev/cpu_dma_latency ({exc.strerror}; it takes root)") from None
    os.write(fd, microseconds.to_bytes(4, sys.byteorder, signed=True))
    print(f"/dev/cpu_dma_latency held at {microseconds} us for this run", flush=True)


def summary(rate: float, lat: list[float]) -> str:
    q = np.percentile(np.array(lat) * 1000, [50, 99])
    return f"{rate:8.0f} calls/s   p50 {q[0]:6.2f} ms   p99 {q[1]:6.2f} ms   ({len(lat)} calls)"


def main() -> int:
    import logging
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--recovery", type=int, default=0, metavar="N",
                    help="also kill -9 each demo model's worker N times and time until it answers again")
    ap.add_argument("--publishing-ms", type=float, nargs="*", default=[1.0, 10.0],
                    help="publishing intervals of the mailbox client's subscription (none: skip the async paths)")
    ap.add_argument("--queue-delay-ms", type=float, default=None,
                    help="engine.max_queue_delay_ms for the appliance (default: the configuration default)")
    ap.add_argument("--cpu-latency-us", type=int, default=None, metavar="N",
                    help="hold /dev/cpu_dma_latency at N for the whole run (root; what tuned's latency-performance "
                         "profile does): with 0 idle CPUs poll instead of halting, for both servers alike")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="record the serve process with py-spy (pip install py-spy) while the appliance's calls run: "
                         "DIR/serve-<clients>.txt, collapsed stacks, and the top functions printed")
    args = ap.parse_args()

    if args.cpu_latency_us is not None:
        hold_cpu_latency(args.cpu_latency_us)
    work = Path(tempfile.mkdtemp(prefix="ua-bench-"))
    state = work / "state"
    pki = PKI(state)
    pki.init("urn:bench:appliance", ["localhost", socket.gethostname()], ["127.0.0.1"])
    pki.issue("bench", "operator", work / "clients", socket.gethostname())
    cert, key = work / "clients" / "bench.der", work / "clients" / "bench.key.pem"
    sample = load_te_test_windows(1)[0][0].astype(np.float32).ravel().tolist()
    assert len(sample) == int(np.prod(INPUT_SHAPE))

    app_port, bare_port, metrics_port = free_ports(3)
    cfg = {"server": {"endpoint": f"opc.tcp://127.0.0.1:{app_port}", "state_dir": str(state),
                      "application_uri": "urn:bench:appliance"},
           "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "audit": {"enabled": True},
           "logging": {"level": "WARNING"}, "watchdog": {"backend": "none"},
           "models": {"te-classifier": {"kind": "tensor", "path": "builtin:te-classifier"}},
           "mailboxes": {"te-classifier": {"model": "te-classifier"}}, "jobs": {"max_per_client": 10000}}
    if args.recovery:
        cfg["models"]["assistant"] = {"kind": "generative", "path": "builtin:smollm2"}
        cfg["engine"] = {"compile": "off"}  # its background compile would take the CPU from the calls measured
    if args.queue_delay_ms is not None:
        cfg.setdefault("engine", {})["max_queue_delay_ms"] = args.queue_delay_ms
    (work / "appliance.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    app = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(work / "appliance.yaml")],
                           env=env, stdout=subprocess.DEVNULL)
    bare = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_server.py"), str(bare_port),
                             str(pki.layout.own_cert_der), str(pki.layout.own_key_pem)], env=env,
                            stdout=subprocess.DEVNULL)
    try:
        wait_port(app_port, app)
        wait_port(bare_port, bare)
        wait_ready(cfg["metrics"]["listen"])
        results, p99s, cpus, quiet = {}, {}, {}, {}
        pids_of = {app_port: app.pid, bare_port: bare.pid}
        for n in args.clients:
            for name, cls, port in (("bare asyncua Echo", BareCaller, bare_port),
                                    ("appliance Infer", ApplianceCaller, app_port)):
                endpoint = f"opc.tcp://127.0.0.1:{port}"

                async def make(cls=cls, endpoint=endpoint):
                    return await cls(endpoint, cert, key, sample).open()
                label = f"serve-{n}" if port == app_port else f"bare-{n}"
                spy = profile_start(pids_of[port], args.profile, label, args.seconds) if args.profile else None
                pids = [bare.pid] if port == bare_port else [app.pid, *worker_pids(app.pid).values()]
                cpu0 = [cpu_seconds(pid) for pid in pids]
                split0 = cpu_split(pids[0])
                switches0 = voluntary_switches(pids[0])
                rate, lat, client_cpu, windows = asyncio.run(drive(make, n, args.seconds, pids[0]))
                cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0)]
                user, system = (b - a for a, b in zip(split0, cpu_split(pids[0])))
                switches = (voluntary_switches(pids[0]) - switches0) / len(lat)
                if spy is not None:
                    profile_report(spy, args.profile / f"{label}.txt",
                                   rate * profile_seconds(args.seconds))
                results[(name, n)] = rate
                p99s[(name, n)] = float(np.percentile(lat, 99))
                cpus[(name, n)] = cpu[0] / len(lat) * 1e6
                quiet[(name, n)] = float(np.percentile(windows, QUIET_PERCENTILE)) if windows else float("nan")
                workers = f" + worker {sum(cpu[1:]) / len(lat) * 1e6:.0f} us" if len(cpu) > 1 else ""
                per_call = 1e6 / len(lat)
                print(f"{name:20s} {n:3d} clients: {summary(rate, lat)}   server CPU per call "
                      f"{cpus[(name, n)]:.0f} us (user {user * per_call:.0f}, system {system * per_call:.0f}, "
                      f"{switches:.1f} waits){workers}, clients' {client_cpu * per_call:.0f} us; server CPU per call "
                      f"in the quietest windows (p{QUIET_PERCENTILE} of {len(windows)} x {WINDOW_S} s) "
                      f"{quiet[(name, n)]:.0f} us", flush=True)
        for n in args.clients:
            rate = results[("appliance Infer", n)] / results[("bare asyncua Echo", n)]
            p99 = p99s[("appliance Infer", n)] / p99s[("bare asyncua Echo", n)]
            goal = "goal >= 0.6" if n == 1 else "goal >= 0.65"  # the serving path's goals (serve CPU: <= 1.6x)
            print(f"{n:3d} clients: appliance/bare calls/s {rate:.2f} ({goal}); p99 appliance/bare {p99:.2f}"
                  + ("  (goal <= 2)" if n > 1 else "")
                  + f"; serve CPU per call / bare's (goal <= 1.6) {cpus[('appliance Infer', n)] / cpus[('bare asyncua Echo', n)]:.2f}"
                  f" (quietest windows {quiet[('appliance Infer', n)] / quiet[('bare asyncua Echo', n)]:.2f})")
        if args.publishing_ms:
            async_paths(f"opc.tcp://127.0.0.1:{app_port}", cert, key, sample, args.seconds, args.publishing_ms)
        if args.recovery:
            measure_recovery(app, cert, key, sample, app_port, args.recovery)
    finally:
        for p in (app, bare):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
