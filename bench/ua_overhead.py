"""What the appliance costs on top of a bare asyncua server, and what batching buys.

Calls per second and p50/p99 latency of `Infer` on the demo fault classifier through the appliance, and of an Echo
method on a bare asyncua server with the same security policy (Basic256Sha256, SignAndEncrypt), in the same run, with
1 and 16 concurrent clients (one outstanding call each). Each server runs in its own process; the clients share this
one. Prints the ratios: appliance/bare at 1 client (goal >= 0.7) and appliance 16 clients / 1 client (goal >= 3).

    .venv/bin/python bench/ua_overhead.py [--seconds 5] [--clients 1 16] [--recovery 5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
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

from appliance.client import call_method, connect, model_node  # noqa: E402
from certs.pki import PKI  # noqa: E402
from models.te_classifier import INPUT_SHAPE, load_te_test_windows  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError("server did not start")


async def drive(make_call, clients: int, seconds: float) -> tuple[float, list[float]]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def worker(call):
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    calls = [await make_call() for _ in range(clients)]
    for call in calls:  # warm up each connection
        await call()
    t0 = time.perf_counter()
    await asyncio.gather(*[worker(c) for c in calls])
    elapsed = time.perf_counter() - t0
    for c in calls:
        await c.close()
    return len(latencies) / elapsed, latencies


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
    ap.add_argument("--queue-delay-ms", type=float, default=None,
                    help="engine.max_queue_delay_ms for the appliance (default: the configuration default)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ua-bench-"))
    state = work / "state"
    pki = PKI(state)
    pki.init("urn:bench:appliance", ["localhost", socket.gethostname()], ["127.0.0.1"])
    pki.issue("bench", "operator", work / "clients", socket.gethostname())
    cert, key = work / "clients" / "bench.der", work / "clients" / "bench.key.pem"
    sample = load_te_test_windows(1)[0][0].astype(np.float32).ravel().tolist()
    assert len(sample) == int(np.prod(INPUT_SHAPE))

    app_port, bare_port = free_port(), free_port()
    cfg = {"server": {"endpoint": f"opc.tcp://127.0.0.1:{app_port}", "state_dir": str(state),
                      "application_uri": "urn:bench:appliance"},
           "metrics": {"listen": f"127.0.0.1:{free_port()}"}, "audit": {"enabled": True},
           "logging": {"level": "WARNING"}, "watchdog": {"backend": "none"},
           "models": {"te-classifier": {"kind": "tensor", "path": "builtin:te-classifier"}}}
    if args.recovery:
        cfg["models"]["assistant"] = {"kind": "generative", "path": "builtin:smollm2"}
    if args.queue_delay_ms is not None:
        cfg["engine"] = {"max_queue_delay_ms": args.queue_delay_ms}
    (work / "appliance.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    app = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(work / "appliance.yaml")],
                           env=env, stdout=subprocess.DEVNULL)
    bare = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_server.py"), str(bare_port),
                             str(pki.own_cert_path), str(pki.own_key_path)], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_port(app_port, app)
        wait_port(bare_port, bare)
        wait_ready(cfg["metrics"]["listen"])
        results, p99s = {}, {}
        for n in args.clients:
            for name, cls, port in (("bare asyncua Echo", BareCaller, bare_port),
                                    ("appliance Infer", ApplianceCaller, app_port)):
                endpoint = f"opc.tcp://127.0.0.1:{port}"

                async def make(cls=cls, endpoint=endpoint):
                    return await cls(endpoint, cert, key, sample).open()
                rate, lat = asyncio.run(drive(make, n, args.seconds))
                results[(name, n)] = rate
                p99s[(name, n)] = float(np.percentile(lat, 99))
                print(f"{name:20s} {n:3d} clients: {summary(rate, lat)}", flush=True)
        for n in args.clients:
            rate = results[("appliance Infer", n)] / results[("bare asyncua Echo", n)]
            p99 = p99s[("appliance Infer", n)] / p99s[("bare asyncua Echo", n)]
            goal = "goal >= 0.7" if n == 1 else "goal >= 0.6"
            print(f"{n:3d} clients: appliance/bare calls/s {rate:.2f} ({goal}); p99 appliance/bare {p99:.2f}"
                  + ("  (goal <= 2)" if n > 1 else ""))
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
