"""The demo appliance's start and memory: `appliance serve` (the built-in demo configuration, or --config) to
`/readyz` 200, first start (empty state directory: PKI made, the weight paths measured on this CPU, weights laid out
and cached) and second start (the same state directory), and the memory of the appliance and all its processes at
Ready (PSS: shared pages split between the processes that map them, so the sum is what the appliance costs the
machine; RSS for comparison). With `engine.compile: auto` the first start compiles the decode step in the background
after Ready, every later start loads its package before Ready: the benchmark gives when the log says "decode step
compiled" and the memory then.

With --generate N, right after each Ready one OPC UA session (SignAndEncrypt, a certificate issued by `appliance
certs issue`) calls Generate for N tokens on the first generative model, and --repeats sessions do so one after
another (default 3: one reply of the demo is ~0.2 s, too short to judge by one); the median tokens/s is set against
the median of as many replies of the engine driven directly (GenerativeModelService in this process, same
settings, its decode step loaded from the same package), measured after the starts; then --sessions sessions (default 16) call Generate at once and the memory is
measured again (every slot's cache filled).

    python bench/startup.py [--config FILE] [--starts 2] [--generate 64] [--repeats 3] [--sessions 16]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_URL = "http://127.0.0.1:9464/readyz"


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in kB of one process."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def memory(pid: int) -> dict:
    pids = descendants(pid)
    mem = [memory_kb(p) for p in pids]
    return {"pss_mb": sum(m[0] for m in mem) / 1024, "rss_mb": sum(m[1] for m in mem) / 1024, "processes": len(pids)}


PROMPT = "What is a centrifugal pump? Answer in three sentences."


def ua_generate(endpoint: str, cert: Path, key: Path, model: str, tokens: int,
                sessions: int = 1, repeats: int = 1) -> tuple[float, int]:
    """(generated tokens/s, tokens) of one Generate call on each of `sessions` sessions at once (their rates summed);
    with `repeats`, that many rounds one after another, each on new sessions: the round of the median rate."""
    import asyncio

    from asyncua import ua

    from appliance.client import call_method, connect, model_node

    async def one() -> tuple[float, int]:
        client = await connect(endpoint, cert, key, timeout=600)
        try:
            node, ns = await model_node(client, model)
            method = await node.get_child(f"{ns}:Generate")
            t0 = time.perf_counter()
            r = await call_method(client, node, method, [ua.Variant(PROMPT, ua.VariantType.String),
                                                         ua.Variant(tokens, ua.VariantType.UInt32),
                                                         ua.Variant(0.0, ua.VariantType.Float)])
            if not r.StatusCode.is_good():
                raise SystemExit(f"Generate answered {r.StatusCode.name}")
            count = int(r.OutputArguments[1].Value)
            return count / (time.perf_counter() - t0), count
        finally:
            await client.disconnect()

    async def run() -> tuple[float, int]:
        rounds = []
        for _ in range(repeats):
            results = await asyncio.gather(*(one() for _ in range(sessions)))
            rounds.append((sum(r[0] for r in results), sum(r[1] for r in results)))
        return median_round(rounds)
    return asyncio.run(run())


def median_round(rounds: list[tuple[float, int]]) -> tuple[float, int]:
    return sorted(rounds)[len(rounds) // 2]


def direct_generate(config, model: str, tokens: int, repeats: int = 1) -> float:
    """tokens/s of the same Generate through the engine in this process, compiled as a later start compiles it (the
    median of `repeats` replies, each in a new session)."""
    import asyncio

    from appliance.device import resolve_device
    from appliance.engine.llm.service import GenerativeModelService
    from appliance.engine.llm.settings import GenerativeSettings
    from appliance.model_specs import model_spec
    m = config.models[model]
    spec = model_spec(m, config.engine, resolve_device(config.engine.device).split(" ")[0],
                      Path(config.server.state_dir))
    settings = GenerativeSettings(**{**spec.settings, "threads": config.engine.threads})

    async def run() -> float:
        svc = GenerativeModelService(model, Path(spec.path), settings, version_label=None, metrics=None)
        await svc.start()
        if svc.state != "Ready":
            raise SystemExit(f"direct: {svc.failure_reason}")
        rates = []
        for i in range(repeats):
            t0 = time.perf_counter()
            result = await svc.generate(f"direct-{i}", PROMPT, tokens, 0.0, time.monotonic() + 600)
            rates.append(result.token_count / (time.perf_counter() - t0))
        await svc.stop()
        return sorted(rates)[len(rates) // 2]
    return asyncio.run(run())


def start_once(cmd: list[str], cwd: Path, log: Path, timeout: float = 600, generate=None,
               sessions: int = 0) -> dict:
    size_before = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}; see {log}")
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"not Ready within {timeout:.0f} s; see {log}")
            try:
                with urllib.request.urlopen(READY_URL, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        ready_s = time.monotonic() - t0
        ua_rate = generate(1, True) if generate else None  # right after Ready, while a first start's compile runs
        time.sleep(2.0)  # let the first liveness rounds and lazy imports settle
        row = {"ready_s": ready_s, "ua_rate": ua_rate, **memory(proc.pid)}
        compiled_s, settled = None, {}
        while time.monotonic() - t0 < timeout:  # the background compile of engine.compile: auto, if any
            text = log.read_text(errors="replace")[size_before:]
            if "decode step compiled" in text or "decode stays eager" in text or "compiling the decode" not in text:
                if "decode step compiled" in text:
                    compiled_s = time.monotonic() - t0
                    time.sleep(2.0)
                    settled = memory(proc.pid)
                break
            time.sleep(0.5)
        busy = {}
        if generate and sessions:  # memory once `sessions` sessions have each generated (their slots filled)
            busy = {"rate": generate(sessions), **memory(proc.pid)}
        return {**row, "compiled_s": compiled_s, "settled": settled, "busy": busy}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def generate_call(args, appliance: Path, work: Path, config_args: list[str]):
    """(a call that times one Generate over OPC UA, the configuration, the generative model's name)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from core.config import load_config
    from core.config.loader import demo_config
    prev = os.getcwd()
    os.chdir(work)  # the built-in demo's state directory is relative
    try:
        config = load_config(args.config.resolve()) if args.config else demo_config()
    finally:
        os.chdir(prev)
    model = next(n for n, m in config.models.items() if m.kind == "generative")
    port = int(config.server.endpoint.rsplit(":", 1)[1])
    clients = work / "clients"

    def call(sessions: int, repeated: bool = False):
        if not (clients / "bench.der").exists():
            subprocess.run([str(appliance), "certs", "issue", "bench", "--role", "operator", "--out", str(clients),
                            *config_args], cwd=work, check=True, capture_output=True)
        return ua_generate(f"opc.tcp://127.0.0.1:{port}", clients / "bench.der", clients / "bench.key.pem", model,
                           args.generate, sessions, args.repeats if repeated else 1)
    return call, config, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="default: the built-in demo configuration")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--generate", type=int, default=0, help="tokens of one Generate over OPC UA right after Ready")
    ap.add_argument("--repeats", type=int, default=3, help="with --generate: sessions one after another right "
                    "after Ready, and replies of the engine driven directly; the medians are compared")
    ap.add_argument("--sessions", type=int, default=16, help="with --generate: then this many sessions at once "
                    "(each one Generate), and the memory after them")
    args = ap.parse_args()
    appliance = Path(sys.executable).with_name("appliance")
    work = Path(tempfile.mkdtemp(prefix="appliance-startup-"))
    config_args = ["--config", str(args.config.resolve())] if args.config else []
    cmd = [str(appliance), "serve"] + config_args
    rows, direct = [], None
    make_call, config, model = generate_call(args, appliance, work, config_args) if args.generate else (None,) * 3
    try:
        for i in range(args.starts):
            rows.append(start_once(cmd, work, work / "serve.log", generate=make_call, sessions=args.sessions))
            print(f"  start {i + 1}: Ready in {rows[-1]['ready_s']:.1f} s", flush=True)
        if args.generate:
            prev = os.getcwd()
            os.chdir(work)  # the built-in demo's state directory is relative
            try:
                direct = direct_generate(config, model, args.generate, args.repeats)
            finally:
                os.chdir(prev)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| start | serve to /readyz 200 (s) | PSS at Ready, all processes (MB) | RSS sum (MB) | processes "
          "| decode compiled at (s) | PSS then (MB) |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        label = "first (empty state directory)" if i == 0 else f"{'second' if i == 1 else i + 1} (same state)"
        compiled = (f"{r['compiled_s']:.1f} | {r['settled']['pss_mb']:.0f}" if r["compiled_s"] is not None
                    else "- | -")
        print(f"| {label} | {r['ready_s']:.1f} | {r['pss_mb']:.0f} | {r['rss_mb']:.0f} | {r['processes']} | "
              f"{compiled} |")
    if direct:
        for i, r in enumerate(rows):
            rate, count = r["ua_rate"]
            print(f"start {i + 1}: one OPC UA session right after Ready {rate:.1f} tokens/s ({count} tokens; the "
                  f"median of {args.repeats} sessions one after another); engine direct {direct:.1f} (median of "
                  f"{args.repeats}); ratio {rate / direct:.2f}")
            if r["busy"]:
                total, count = r["busy"]["rate"]
                print(f"start {i + 1}: then {args.sessions} sessions at once, {total:.1f} tokens/s together "
                      f"({count} tokens); PSS after them {r['busy']['pss_mb']:.0f} MB (RSS sum "
                      f"{r['busy']['rss_mb']:.0f} MB, {r['busy']['processes']} processes)")


if __name__ == "__main__":
    main()
