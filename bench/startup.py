"""The demo appliance's start and memory: `appliance serve` (the built-in demo configuration, or --config) to
`/readyz` 200, first start (empty state directory: PKI made, weights quantized and cached) and second start (the
same state directory), and the memory of the appliance and all its processes at Ready (PSS: shared pages split
between the processes that map them, so the sum is what the appliance costs the machine; RSS for comparison). With
`engine.compile: auto` the decode step compiles in the background after Ready: the benchmark then also waits for the
log's "decode step compiled" and gives the time and the memory at that point.

    python bench/startup.py [--config FILE] [--starts 2]
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


def start_once(cmd: list[str], cwd: Path, log: Path, timeout: float = 600) -> dict:
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
        time.sleep(2.0)  # let the first liveness rounds and lazy imports settle
        row = {"ready_s": ready_s, **memory(proc.pid)}
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
        return {**row, "compiled_s": compiled_s, "settled": settled}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None, help="default: the built-in demo configuration")
    ap.add_argument("--starts", type=int, default=2)
    args = ap.parse_args()
    appliance = Path(sys.executable).with_name("appliance")
    work = Path(tempfile.mkdtemp(prefix="appliance-startup-"))
    cmd = [str(appliance), "serve"] + (["--config", str(args.config.resolve())] if args.config else [])
    rows = []
    try:
        for i in range(args.starts):
            rows.append(start_once(cmd, work, work / "serve.log"))
            print(f"  start {i + 1}: Ready in {rows[-1]['ready_s']:.1f} s", flush=True)
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


if __name__ == "__main__":
    main()
