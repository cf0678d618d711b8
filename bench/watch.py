"""The appliance watching the line: S plant servers x N nodes written every interval, the appliance subscribed to all
of them (`sources:`), each source's first 52 nodes feeding the demo TE classifier (20-row windows, a window every
`--stride` rows), and a PLC calling Infer on the same model, in one run:

1. samples taken in per second, and whether any was lost (what the plant servers wrote against
   appliance_source_samples_total);
2. the sources client process's CPU: per 1,000 samples, and as a share of one core;
3. the delay from a window's last SourceTimestamp to its result in the address space, p50 / p99
   (appliance_source_delay_seconds: interpolated within its buckets);
4. a PLC's Infer p99 on the same model without the watch load (sources connected, plants idle), then with it,
   then without it again once the plants stopped, and the ratio against both baselines pooled (the machine's other
   load drifts during a run);
5. the plant servers' own figures, kept apart from the appliance's: their CPU, and their time from a row's
   SourceTimestamp to its last value written (they publish the row only after it: part of the delay).

Each plant server is an asyncua server of its own (SignAndEncrypt, a self-signed certificate the appliance trusts
as `appliance sources trust` stores it) at nice 19; their rows are spread over the interval (`--aligned`: all at
the same instant); `--pin` puts them on a CPU of their own. The appliance is `appliance serve` in a process of its own.

    .venv/bin/python bench/watch.py [--sources 4] [--nodes 250] [--interval-ms 100] [--seconds 20] [--calls 300]
                                    [--publishing-ms 20] [--aligned] [--pin] [--sources-cpu N] [--stamp row|value]

Goals (issue 44): 4 x 250 at 100 ms (10,000 samples/s) with none lost at <= 40 % of one core; delay p99 <= 50 ms +
the model's own time; Infer p99 with the watch load <= 1.25 x without it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
URI = "urn:bench-plant"


# ---- a plant server (run as `bench/watch.py --plant ...`) ----

async def plant(port: int, cert: str, key: str, nodes: int, interval_s: float, stamp: str) -> None:
    import numpy as np
    from asyncua import Server, ua
    from datetime import datetime, timezone
    server = Server()
    await server.init()
    server.set_endpoint(f"opc.tcp://127.0.0.1:{port}")
    await server.set_application_uri("urn:bench-plant:server")
    await server.load_certificate(cert)
    await server.load_private_key(key)
    server.set_security_policy([ua.SecurityPolicyType.Basic256Sha256_SignAndEncrypt])
    ns = await server.register_namespace(URI)
    obj = await server.nodes.objects.add_object(ua.NodeId("Plant", ns), ua.QualifiedName("Plant", ns))
    variables = [await obj.add_variable(ua.NodeId(f"N{i}", ns), ua.QualifiedName(f"N{i}", ns), 0.0)
                 for i in range(nodes)]
    rng = np.random.default_rng(port)
    async with server:
        print("listening", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        words = line.split()
        stop_at = float(words[1]) if len(words) > 1 else 1e18
        offset = float(words[2]) if len(words) > 2 else 0.0  # this plant's phase within the interval
        rows, next_at, took = 0, time.monotonic() + offset, []
        await asyncio.sleep(offset)
        while time.monotonic() < stop_at:
            now = datetime.now(timezone.utc)
            values = rng.normal(size=nodes)
            for v, x in zip(variables, values):
                # stamp "value": each value stamped as it is written (a PLC samples its values at once, in
                # microseconds; this Python server needs tens of ms for a row, its own time, not the appliance's)
                when = datetime.now(timezone.utc) if stamp == "value" else now
                await server.write_attribute_value(v.nodeid, ua.DataValue(ua.Variant(float(x), ua.VariantType.Double),
                                                                          SourceTimestamp=when, ServerTimestamp=when))
            took.append((datetime.now(timezone.utc) - now).total_seconds())  # the plant's own time per row
            rows += 1
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        print(f"rows {rows} late {max(0.0, time.monotonic() - next_at):.3f} took {' '.join(f'{t:.4f}' for t in took)}",
              flush=True)
        await asyncio.Event().wait()


# ---- the run ----

def metrics_text(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def metric_sum(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def histogram_quantile(text: str, name: str, q: float) -> float:
    """The q-quantile of a histogram summed over its series, interpolated linearly within the bucket."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = \
                buckets.get(float("inf") if le == "+Inf" else float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for edge in edges:
        if buckets[edge] >= rank:
            if edge == float("inf"):
                return lower
            width = buckets[edge] - below
            return lower + (edge - lower) * ((rank - below) / width if width else 1.0)
        lower, below = edge, buckets[edge]
    return lower


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sources_process(serve_pid: int) -> int:
    from serve_process import children, command_line
    for pid in children(serve_pid):
        if "appliance.sources.process" in command_line(pid):
            return pid
    raise RuntimeError("no sources client process")


async def infer_times(endpoint: str, cert: Path, key: Path, calls: int) -> list[float]:
    import numpy as np
    from asyncua import ua

    from appliance.client import call_method, connect, model_node
    from models.te_classifier import load_te_rows
    window = load_te_rows(0, test=True)[:20].reshape(-1).tolist()
    client = await connect(endpoint, cert, key)
    try:
        parent, ns = await model_node(client, "te")
        method = await parent.get_child(f"{ns}:Infer")
        arg = [ua.Variant(window, ua.VariantType.Float)]
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            r = await call_method(client, parent, method, arg)
            times.append(time.perf_counter() - started)
            assert r.StatusCode.is_good(), r.StatusCode
        return times
    finally:
        await client.disconnect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=250)
    ap.add_argument("--interval-ms", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--stride", type=int, default=10)
    ap.add_argument("--publishing-ms", type=float, default=20.0, help="the subscriptions' publishing interval")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--pin", action="store_true",
                    help="the plant servers on the last CPU, the appliance and the PLC client on the others (baseline "
                         "and load alike): the plant's CPU kept out of the appliance's")
    ap.add_argument("--aligned", action="store_true",
                    help="every plant writes its row at the same instant (default: their phases spread over the "
                         "interval, as the PLCs of a line are not synchronised)")
    ap.add_argument("--sources-cpu", type=int, default=-1,
                    help="pin the sources client process to this CPU (serve, its workers and the PLC client keep the "
                         "others when --pin is given)")
    ap.add_argument("--stamp", choices=("row", "value"), default="row",
                    help="the plant's SourceTimestamp: one per row, taken before its values are written, or each "
                         "value's own, taken as it is written")
    ap.add_argument("--plant", nargs=6, metavar=("PORT", "CERT", "KEY", "NODES", "INTERVAL_S", "STAMP"))
    args = ap.parse_args()
    if args.plant:
        port, cert, key, nodes, interval, stamp = args.plant
        asyncio.run(plant(int(port), cert, key, int(nodes), float(interval), stamp))
        return
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from appliance.sources.identity import SourceFiles
    from certificates import make_test_certificate
    from harness import free_ports
    print(f"bench/watch.py: {args.sources} sources x {args.nodes} nodes every {args.interval_ms:g} ms "
          f"({args.sources * args.nodes * 1000 / args.interval_ms:,.0f} samples/s offered), publishing every "
          f"{args.publishing_ms:g} ms, SourceTimestamp per {args.stamp}, plants "
          f"{'aligned' if args.aligned else 'out of phase'}, {args.seconds:g} s, "
          f"CPU {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    plant_cpus = {cpus[-1]} if args.pin and len(cpus) > 1 else set(cpus)
    if args.pin and len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[:-1]))  # this process (the PLC's client) and serve with its children
        print(f"pinned: plant servers on CPU {cpus[-1]}, the appliance and the PLC client on CPU "
              f"{','.join(map(str, cpus[:-1]))}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    ports = free_ports(args.sources)
    plants, sources = [], {}
    made = make_test_certificate("bench-plant", application_uri="urn:bench-plant:server",
                                 extended_key_usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert, key = made.write(tmp, "plant")
    for s, port in enumerate(ports):
        proc = subprocess.Popen([sys.executable, __file__, "--plant", str(port), str(cert), str(key), str(args.nodes),
                                 str(args.interval_ms / 1000), args.stamp], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)},
                                preexec_fn=lambda: (os.nice(19), os.sched_setaffinity(0, plant_cpus)))
        # the line's servers: not the appliance's CPU (nice 19; with --pin on a CPU of their own)
        assert proc.stdout.readline().strip() == "listening"
        plants.append(proc)
        nodes = {f"n{i}": f"nsu={URI};s=N{i}" for i in range(args.nodes)}
        sources[f"plant{s}"] = {"endpoint": f"opc.tcp://127.0.0.1:{port}", "nodes": nodes,
                                "sampling_interval_ms": args.interval_ms, "publishing_interval_ms": args.publishing_ms,
                                "queue_size": 10, "stale_after_s": 60,
                                "feeds": {f"feed{s}": {"model": "te", "columns": [f"n{i}" for i in range(52)],
                                                       "window": 20, "stride": args.stride}}}
    state = tmp / "state"
    for name in sources:
        SourceFiles.of(state, name).trust(made.cert_der)  # what `appliance sources trust NAME --yes` stores
    serve = None
    try:
        serve = WatchServe(tmp, sources)
        plc_cert, plc_key = serve.issue("bench-plc", "operator")
        text = ""
        for _ in range(120):
            text = metrics_text(serve.metrics_url)
            if all(metric_sum(text, "appliance_source_state", source=n) == 0 and
                   f'appliance_source_state{{source="{n}"}}' in text for n in sources):
                break
            time.sleep(0.5)
        else:
            raise SystemExit("the sources did not connect:\n" + serve.log_path.read_text()[-3000:])
        pid = sources_process(serve.proc.pid)
        if args.sources_cpu >= 0:  # every thread of it
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {args.sources_cpu})
            print(f"pinned: the sources client process on CPU {args.sources_cpu}", flush=True)
        import numpy as np
        quiet1 = asyncio.run(infer_times(serve.endpoint, plc_cert, plc_key, args.calls))
        print(f"Infer p99 without the watch load, before it: {np.percentile(quiet1, 99) * 1000:.2f} ms "
              f"({args.calls} calls)", flush=True)
        for _ in range(40):  # every source's initial values counted (statuses come once a second) before the run
            before = metrics_text(serve.metrics_url)
            samples0 = metric_sum(before, "appliance_source_samples_total")
            if samples0 >= args.sources * args.nodes:
                break
            time.sleep(0.25)
        cpu0, started = cpu_seconds(pid), time.monotonic()
        plant_cpu0 = sum(cpu_seconds(proc.pid) for proc in plants)
        stop_at = time.monotonic() + args.seconds  # CLOCK_MONOTONIC is one clock for every process here
        for s, proc in enumerate(plants):
            offset = 0.0 if args.aligned else s * args.interval_ms / 1000 / len(plants)
            proc.stdin.write(f"go {stop_at} {offset}\n")
            proc.stdin.flush()
        time.sleep(min(3.0, args.seconds / 4))
        loaded = asyncio.run(infer_times(serve.endpoint, plc_cert, plc_key, args.calls))
        print(f"Infer p99 with the watch load: {np.percentile(loaded, 99) * 1000:.2f} ms ({args.calls} calls)",
              flush=True)
        left = stop_at - time.monotonic()
        if left > 0:
            time.sleep(left)
        written, took = 0, []
        for proc in plants:
            line = proc.stdout.readline().split()
            written += int(line[1]) * args.nodes
            took += [float(t) for t in line[5:]]
            if float(line[3]) > args.interval_ms / 1000:
                print(f"  a plant server fell {line[3]} s behind its schedule (the machine is loaded)", flush=True)
        time.sleep(2.0)  # the last samples and counters arrive
        elapsed, cpu = time.monotonic() - started - 2.0, cpu_seconds(pid) - cpu0
        plant_cpu = sum(cpu_seconds(proc.pid) for proc in plants) - plant_cpu0
        after = metrics_text(serve.metrics_url)
        received = metric_sum(after, "appliance_source_samples_total") - samples0
        print(f"samples written by the plants: {written:,.0f}; taken in: {received:,.0f} "
              f"({received / elapsed:,.0f} /s); lost: {written - received:,.0f}", flush=True)
        import numpy as np
        print(f"plant servers' own time from a row's SourceTimestamp to its last value written (before they publish "
              f"it; part of the delay, not the appliance's): p50 {np.percentile(took, 50) * 1000:.1f} ms, p99 "
              f"{np.percentile(took, 99) * 1000:.1f} ms", flush=True)
        print(f"sources client process CPU: {cpu:.2f} s = {cpu / elapsed * 100:.1f} % of one core; "
              f"{cpu / max(1.0, received) * 1000 * 1000:.1f} ms per 1,000 samples", flush=True)
        print(f"plant servers' CPU (not the appliance's): {plant_cpu:.2f} s = {plant_cpu / elapsed * 100:.1f} % of "
              f"one core", flush=True)
        skipped = metric_sum(after, "appliance_source_windows_skipped_total")
        run_ = metric_sum(after, "appliance_source_windows_total", outcome="run")
        dropped = metric_sum(after, "appliance_source_windows_total", outcome="dropped")
        reasons = {r: metric_sum(after, "appliance_source_windows_skipped_total", reason=r) -
                   metric_sum(before, "appliance_source_windows_skipped_total", reason=r)
                   for r in ("bad", "uncertain", "type", "missing", "stale", "gap")}
        print(f"windows run {run_:.0f}, dropped (model busy) {dropped:.0f}, skipped {skipped:.0f} "
              f"({', '.join(f'{r} {n:.0f}' for r, n in reasons.items() if n)})", flush=True)
        p50 = histogram_quantile(after, "appliance_source_delay_seconds", 0.5)
        p99 = histogram_quantile(after, "appliance_source_delay_seconds", 0.99)
        model_ms = histogram_quantile(after, "appliance_request_duration_seconds", 0.5) * 1000
        print(f"delay from a window's last SourceTimestamp to its result: p50 {p50 * 1000:.1f} ms, p99 "
              f"{p99 * 1000:.1f} ms (Infer call p50 {model_ms:.2f} ms)", flush=True)
        # the baseline again once the plants stopped: the machine's other load drifts over a run, so the ratio is
        # taken against both baselines pooled (the one before and the one after the watch load)
        quiet2 = asyncio.run(infer_times(serve.endpoint, plc_cert, plc_key, args.calls))
        quiet, with_load = np.percentile(quiet1 + quiet2, 99), np.percentile(loaded, 99)
        print(f"Infer p99 without the watch load, after it: {np.percentile(quiet2, 99) * 1000:.2f} ms; both "
              f"baselines pooled: {quiet * 1000:.2f} ms ({2 * args.calls} calls); with the load {with_load * 1000:.2f} "
              f"ms: ratio {with_load / quiet:.2f} x (goal <= 1.25)", flush=True)
    finally:
        for proc in plants:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if serve is not None:
            serve.close()


class WatchServe:
    """`appliance serve` in a process of its own with the sources in its YAML (as systemd would run it)."""

    def __init__(self, tmp: Path, sources: dict):
        import yaml

        from harness import free_ports
        port, metrics_port = free_ports(2)
        self.state_dir = tmp / "state"
        self.endpoint, self.metrics_url = f"opc.tcp://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
        doc = {"server": {"endpoint": self.endpoint, "state_dir": str(self.state_dir)},
               "metrics": {"listen": f"127.0.0.1:{metrics_port}"}, "watchdog": {"backend": "none"},
               "audit": {"enabled": False},
               "models": {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": "labels.txt"}},
               "sources": sources}
        config = tmp / "appliance.yaml"
        config.write_text(yaml.safe_dump(doc))
        self.log_path = tmp / "serve.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(config)],
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        for _ in range(600):
            try:
                if urllib.request.urlopen(self.metrics_url + "/readyz", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("serve did not become ready:\n" + self.log_path.read_text()[-3000:])

    def issue(self, name: str, role: str):
        import socket

        from certs.pki import PKI
        out = self.state_dir / "clients"
        PKI(self.state_dir).issue(name, role, out, socket.gethostname())
        return out / f"{name}.der", out / f"{name}.key.pem"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


if __name__ == "__main__":
    main()
