"""One answer's latency when the box is busy: a 16-token Generate on the demo's language model while four PLCs call
the demo classifier's Infer as fast as they can, with each model's CPU share enforced (engine.cpu_shares auto, equal
shares) and, as the baseline in the same run, without (engine.cpu_shares off: every worker at one nice level, the
library's thread counts, as before).

For each setting, a fresh `appliance serve` with the demo's two models (te-classifier, assistant = SmolLM2-135M;
engine.compile off so no background compile takes the CPU; worker_timeout_s 60 for a loaded
bench machine), all calls over SignAndEncrypt (bench/ua_overhead.py's
client and PKI set-up):
  1. idle: Generate (16 tokens, greedy) one after another: p50 / p99;
  2. the classifier alone: four sessions, one outstanding Infer each, from a load process of their own: calls/s;
  3. both: the same load, and Generate one after another meanwhile: Generate's p50 / p99 and its ratio to idle
     (goal: p50 <= 3x idle with the shares), the classifier's calls/s against its rate alone, and each worker's CPU
     time over the phase as a fraction of the workers' (from /proc) against its share.

    .venv/bin/python bench/cpu_share.py [--seconds 8] [--idle-calls 8] [--clients 4] [--settings off equal]
                                        [--llm-share 100]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from asyncua import ua

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/ports.py

from appliance.client import call_method, connect, model_node  # noqa: E402
from ua_overhead import ApplianceCaller, cpu_seconds, wait_ready, worker_pids  # noqa: E402

PROMPT = "Explain in a few sentences why a centrifugal pump cavitates and how an operator can prevent it."
MAX_TOKENS = 16


async def load_clients(endpoint: str, cert: Path, key: Path, sample: list[float], clients: int,
                       seconds: float) -> dict:
    """`clients` sessions, one outstanding Infer each, for `seconds`: calls made and how long they ran."""
    callers = [await ApplianceCaller(endpoint, cert, key, sample).open() for _ in range(clients)]
    for c in callers:
        await c()  # warm up each session
    done = 0
    stop = time.perf_counter() + seconds

    async def run(call):
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1
    t0 = time.perf_counter()
    await asyncio.gather(*[run(c) for c in callers])
    elapsed = time.perf_counter() - t0
    for c in callers:
        await c.close()
    return {"calls": done, "seconds": elapsed}


def start_load(endpoint: str, cert: Path, key: Path, clients: int, seconds: float) -> subprocess.Popen:
    """The four PLCs: a process of their own (its CPU is not this one's, which times Generate)."""
    return subprocess.Popen([sys.executable, __file__, "--load", endpoint, str(cert), str(key), str(clients),
                             str(seconds)], stdout=subprocess.PIPE, text=True, env=dict(os.environ,
                                                                                         PYTHONPATH=str(ROOT)))


def load_rate(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the load process failed ({proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    return result["calls"] / result["seconds"]


async def generate_calls(endpoint: str, cert: Path, key: Path, *, count: int = 0, until=None,
                         on_warm=None) -> list[float]:
    """Generate (MAX_TOKENS, greedy) one after another: `count` of them, or until `until()` is true (at least one);
    latencies. `on_warm()` runs once the session is connected and a first Generate answered."""
    client = await connect(endpoint, cert, key, timeout=120)
    try:
        parent, ns = await model_node(client, "assistant")
        method = await parent.get_child(f"{ns}:Generate")
        args = [ua.Variant(PROMPT, ua.VariantType.String), ua.Variant(MAX_TOKENS, ua.VariantType.UInt32),
                ua.Variant(0.0, ua.VariantType.Float)]
        r = await call_method(client, parent, method, args)  # warm up
        if not r.StatusCode.is_good():
            raise RuntimeError(r.StatusCode.name)
        if on_warm is not None:
            on_warm()
        latencies: list[float] = []
        while (len(latencies) < count) if count else not (latencies and until()):
            t0 = time.perf_counter()
            r = await call_method(client, parent, method, args)
            latencies.append(time.perf_counter() - t0)
            if not r.StatusCode.is_good():
                raise RuntimeError(r.StatusCode.name)
        return latencies
    finally:
        await client.disconnect()


def pcts(lat: list[float]) -> tuple[float, float]:
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


def run_setting(name: str, args, work: Path, cert: Path, key: Path) -> dict:
    from ports import free_ports, wait_port
    port, metrics_port = free_ports(2)
    endpoint = f"opc.tcp://127.0.0.1:{port}"
    cfg = {"server": {"endpoint": endpoint, "state_dir": str(work / "state"),
                      "application_uri": "urn:bench:appliance"},
           "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "logging": {"level": "WARNING"},
           "watchdog": {"backend": "none"},
           "engine": {"compile": "off", "worker_timeout_s": 60, "cpu_shares": "off" if name == "off" else "auto"},
           "models": {"te-classifier": {"kind": "tensor", "path": "builtin:te-classifier"},
                      "assistant": {"kind": "generative", "path": "builtin:smollm2"}}}
    if name != "off":
        cfg["models"]["assistant"]["cpu_share"] = args.llm_share
    shares = {"te-classifier": 100, "assistant": args.llm_share if name != "off" else 100}
    path = work / f"appliance-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    app = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(path)],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    try:
        wait_port(port, app)
        wait_ready(cfg["metrics"]["listen"])
        workers = worker_pids(app.pid)
        nice = {m: int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16]) for m, pid in workers.items()}
        print(f"[{name}] workers' nice: {nice}", flush=True)
        idle = asyncio.run(generate_calls(endpoint, cert, key, count=args.idle_calls))
        p50, p99 = pcts(idle)
        print(f"[{name}] idle Generate ({MAX_TOKENS} tokens): p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms "
              f"({len(idle)} calls)", flush=True)
        alone = load_rate(start_load(endpoint, cert, key, args.clients, args.seconds))
        print(f"[{name}] classifier alone, {args.clients} clients: {alone:.0f} calls/s", flush=True)
        cpu0 = {m: cpu_seconds(pid) for m, pid in workers.items()}
        serve0 = cpu_seconds(app.pid)
        loads: list[subprocess.Popen] = []

        def begin_load() -> None:
            loads.append(start_load(endpoint, cert, key, args.clients, args.seconds))
            time.sleep(1.0)  # the load's sessions connected and calling
        busy = asyncio.run(generate_calls(endpoint, cert, key, until=lambda: loads[0].poll() is not None,
                                          on_warm=begin_load))
        load = loads[0]
        rate = load_rate(load)
        used = {m: cpu_seconds(pid) - cpu0[m] for m, pid in workers.items()}
        serve_cpu = cpu_seconds(app.pid) - serve0
        b50, b99 = pcts(busy)
        print(f"[{name}] under load Generate: p50 {b50 * 1e3:.0f} ms, p99 {b99 * 1e3:.0f} ms ({len(busy)} calls); "
              f"p50 / idle {b50 / p50:.2f} (goal <= 3), p99 / idle {b99 / p50:.2f}", flush=True)
        total_share, total_cpu = sum(shares.values()), sum(used.values()) or 1.0
        print(f"[{name}] under load classifier: {rate:.0f} calls/s, {rate / alone:.2f} of its rate alone; "
              + "; ".join(f"{m} worker {used[m]:.1f} CPU s = {used[m] / total_cpu:.2f} of the workers' (share "
                          f"{shares[m] / total_share:.2f})" for m in sorted(used))
              + f"; serve {serve_cpu:.1f} CPU s", flush=True)
        return {"idle_p50": p50, "busy_p50": b50, "busy_p99": b99, "rate": rate, "alone": alone}
    finally:
        app.terminate()
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            app.kill()


def main() -> int:
    import logging
    logging.getLogger("asyncua").setLevel(logging.ERROR)
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        endpoint, cert, key, clients, seconds = sys.argv[2:7]
        from models.te_classifier import load_te_test_windows
        sample = load_te_test_windows(1)[0][0].astype(np.float32).ravel().tolist()
        print(json.dumps(asyncio.run(load_clients(endpoint, Path(cert), Path(key), sample, int(clients),
                                                  float(seconds)))))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0, help="each load phase")
    ap.add_argument("--idle-calls", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4, help="PLCs calling the classifier")
    ap.add_argument("--settings", nargs="+", default=["off", "equal"], choices=["off", "equal"],
                    help="off: engine.cpu_shares off (the baseline); equal: the shares enforced")
    ap.add_argument("--llm-share", type=int, default=100, help="the assistant's cpu_share (the classifier's: 100)")
    args = ap.parse_args()

    from certs.pki import PKI
    work = Path(tempfile.mkdtemp(prefix="cpu-share-bench-"))
    pki = PKI(work / "state")
    pki.init("urn:bench:appliance", ["localhost", socket.gethostname()], ["127.0.0.1"])
    pki.issue("bench", "operator", work / "clients", socket.gethostname())
    cert, key = work / "clients" / "bench.der", work / "clients" / "bench.key.pem"
    print(f"CPU: {os.cpu_count()} cores here, {len(os.sched_getaffinity(0))} usable", flush=True)
    results = {name: run_setting(name, args, work, cert, key) for name in args.settings}
    if "off" in results and "equal" in results:
        off, on = results["off"], results["equal"]
        print(f"Generate p50 under load: shares {on['busy_p50'] * 1e3:.0f} ms vs off {off['busy_p50'] * 1e3:.0f} ms "
              f"({off['busy_p50'] / on['busy_p50']:.2f}x faster); to idle: {on['busy_p50'] / on['idle_p50']:.2f} vs "
              f"{off['busy_p50'] / off['idle_p50']:.2f}; classifier {on['rate']:.0f} vs {off['rate']:.0f} calls/s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
