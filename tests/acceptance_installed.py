"""The installed product, run as a plant runs it (`bash scripts/acceptance.sh [DEB]`; not part of the pytest suite:
it needs root, mmdebstrap, systemd-nspawn and a built package, and takes several minutes).

A minimal Debian 12 root (mmdebstrap) is booted with systemd as PID 1 (`systemd-nspawn -b`, in a network namespace
of its own: only loopback), and the package is installed into the running system with dpkg, as on a plant's box.
Then, in order: the user, the directories and their modes come from the package's sysusers/tmpfiles entries; the
service reaches READY under its own unit with every sandbox setting in force; a client calls Infer and Generate over
SignAndEncrypt with a certificate from `appliance certs issue`; each model's Backend equals what the same installed
files give in a plain shell on the same CPU, and the weights format in it is the one that CPU gets; the package's
prebuilt kernels are the only ones loaded; Prometheus scrapes /metrics; `systemctl reload` applies a new rate
limit; kill -9 of the main process and a SIGSTOP past WatchdogSec each end in a restart by systemd; the journal holds
the structured log lines; `dpkg --purge` leaves nothing behind. Every command in the box runs through nsenter.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
UNIT = HERE.parent / "systemd" / "appliance.service"
CONFIG = "/etc/appliance/appliance.yaml"
PY = "/opt/appliance/venv/bin/python"
ENDPOINT = "opc.tcp://127.0.0.1:4840"
CLIENT = ("/var/lib/appliance/clients/plc-acceptance.der", "/var/lib/appliance/clients/plc-acceptance.key.pem")
# A plant's minimal Debian with systemd, plus the package's dependencies (the box has no network to fetch them)
BASE_PACKAGES = ["systemd", "systemd-sysv", "dbus", "python3.11", "libgomp1", "passwd", "util-linux", "procps"]
# What the system itself changes while it runs or while dpkg works, package or not (the purge check ignores it)
CHURN = re.compile(r"^/(root|var/log/journal|var/lib/dpkg|var/lib/systemd|var/cache/debconf|var/cache/ldconfig)(/|$)"
                   r"|^/var/log/(dpkg\.log|apt|alternatives\.log)|^/etc/(passwd|group|shadow|gshadow)-$"
                   r"|^/etc/ld\.so\.cache$|^/var/lib/dbus/machine-id$"
                   r"|^/var/tmp/systemd-private-\w+-(?!appliance\.service)")
TIMINGS: dict[str, float] = {}


class Box:
    """A Debian root booted with systemd as PID 1; `run` executes a command inside it (all its namespaces)."""

    def __init__(self, root: Path, console: Path):
        self.root = root
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "-D", str(root), "-b", "-M", f"appliance-acceptance-{os.getpid()}", "--register=no",
             "--keep-unit", "--private-network", "--console=pipe",
             "--bind-ro=/usr/bin/prometheus:/usr/local/bin/prometheus"],
            stdin=subprocess.DEVNULL, stdout=console.open("wb"), stderr=subprocess.STDOUT)
        self.leader = self._leader()
        self.run("systemctl", "is-system-running", "--wait", check=False, timeout=180)

    def _leader(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        for _ in range(600):
            assert self.proc.poll() is None, "systemd-nspawn exited"
            pids = children.read_text().split()
            if pids:
                return int(pids[0])
            time.sleep(0.1)
        raise AssertionError("systemd-nspawn started no init")

    def run(self, *cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", "env", "-i",
                              "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
                              *cmd], capture_output=True, text=True, timeout=timeout)
        if check:
            assert out.returncode == 0, f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    def show(self, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", "appliance.service", *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def client(self, *args: str, timeout: float = 180) -> dict:
        out = self.run(PY, "/root/acceptance_client.py", *args, timeout=timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def query(self, expr: str) -> list:
        reply = self.client("query", "http://127.0.0.1:9090", expr)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def files(self) -> set[str]:
        out = self.run("find", "/", "-xdev", timeout=300).stdout
        return {p for p in out.splitlines() if not CHURN.search(p)}

    def wait_running(self, timeout: float, unlike_pid: str = "") -> dict[str, str]:
        """The unit active and running (Type=notify: only after READY=1), with a main process other than unlike_pid."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            state = self.show("ActiveState", "SubState", "MainPID", "NRestarts", "StatusText")
            if state["ActiveState"] == "active" and state["SubState"] == "running" and \
                    state["MainPID"] not in ("0", unlike_pid):
                return state
            time.sleep(0.5)
        raise AssertionError(f"appliance.service not running after {timeout} s: {state}\n"
                             + self.run("journalctl", "-u", "appliance", "-n", "60", "--no-pager", check=False).stdout)

    def stop(self) -> None:
        self.proc.terminate()  # systemd-nspawn asks the box's systemd to power off
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    deb = os.environ.get("APPLIANCE_DEB", "")
    if not deb or not Path(deb).is_file():
        pytest.fail("APPLIANCE_DEB must name the built package (bash scripts/acceptance.sh builds it)")
    work = tmp_path_factory.mktemp("acceptance")
    root = work / "root"
    start = time.monotonic()
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES), "bookworm",
                    str(root)], check=True, timeout=900)
    TIMINGS["mmdebstrap root"] = time.monotonic() - start
    shutil.copy(deb, root / "root" / "appliance.deb")
    for name in ("acceptance_client.py", "cpu_view.py"):
        shutil.copy(HERE / name, root / "root" / name)
    start = time.monotonic()
    b = Box(root, work / "console.log")
    TIMINGS["boot"] = time.monotonic() - start
    try:
        yield b
    finally:
        b.stop()
        shutil.rmtree(root, ignore_errors=True)
        print("\nacceptance timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in TIMINGS.items()))


def test_install_as_a_plant_does(box):
    box.before_install = box.files()
    assert box.run("sh", "-c", "command -v cc gcc", check=False).returncode != 0  # no compiler on the box
    start = time.monotonic()
    box.run("dpkg", "-i", "/root/appliance.deb", timeout=900)
    TIMINGS["dpkg -i"] = time.monotonic() - start
    box.installed_at = time.monotonic()
    uid = box.run("getent", "passwd", "appliance").stdout.split(":")[2]
    assert 0 < int(uid) < 1000  # a system user, the uid sysusers allocated on this box
    modes = box.run("stat", "-c", "%n %a %U %G", "/etc/appliance", "/etc/appliance/appliance.yaml",
                    "/var/lib/appliance", "/var/lib/appliance/pki").stdout.splitlines()
    assert modes == ["/etc/appliance 750 root appliance", "/etc/appliance/appliance.yaml 640 root appliance",
                     "/var/lib/appliance 750 appliance appliance", "/var/lib/appliance/pki 750 appliance appliance"]
    box.run("test", "-f", "/var/lib/appliance/pki/own/cert.der")
    # postinst prepared the generative model for this CPU as the service user: the measured path record is there
    # before the first start, and the first start reads it
    record = box.run("sh", "-c", "stat -c '%U %n' /var/lib/appliance/cache/weights/assistant/choice-*.json").stdout
    assert record.startswith("appliance /var/lib/appliance/cache/weights/assistant/choice-"), record
    assert box.run("systemctl", "is-enabled", "appliance").stdout.strip() == "enabled"
    assert (box.root / "lib/systemd/system/appliance.service").read_text() == UNIT.read_text()


def test_ready_under_its_unit_with_every_sandbox_setting(box):
    state = box.wait_running(600)
    TIMINGS["install to READY"] = time.monotonic() - box.installed_at
    assert state["NRestarts"] == "0" and state["StatusText"].startswith("Ready"), state
    main = state["MainPID"]
    status = dict(line.split(":", 1) for line in box.run("cat", f"/proc/{main}/status").stdout.splitlines())
    uid = box.run("id", "-u", "appliance").stdout.strip()
    assert status["Uid"].split()[0] == uid and status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2" and int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
    mounts = {line.split()[4]: line for line in box.run("cat", f"/proc/{main}/mountinfo").stdout.splitlines()}
    assert "hidepid=invisible" in mounts["/proc"] and "subset=pid" not in mounts["/proc"]
    assert " ro," in mounts["/"] or " ro " in mounts["/"], mounts["/"]  # ProtectSystem=strict
    assert "/tmp" in mounts  # PrivateTmp
    score = box.run("systemd-analyze", "security", "appliance.service").stdout
    assert float(re.search(r"Overall exposure level for appliance.service: ([0-9.]+)", score).group(1)) <= 2.0
    # each model's worker runs 5 steps of niceness below serve, under the unit's system call filter too
    nice = {}
    for pid in box.run("cat", f"/proc/{main}/task/{main}/children").stdout.split():
        if "appliance.workers.worker" in box.run("cat", f"/proc/{pid}/cmdline").stdout:
            nice[pid] = int(box.run("cat", f"/proc/{pid}/stat").stdout.rsplit(")", 1)[1].split()[16])
    serve_nice = int(box.run("cat", f"/proc/{main}/stat").stdout.rsplit(")", 1)[1].split()[16])
    assert len(nice) == 2 and set(nice.values()) == {serve_nice + 5}, (serve_nice, nice)


def test_a_client_calls_infer_and_generate_over_sign_and_encrypt(box):
    box.run("setpriv", "--reuid", "appliance", "--regid", "appliance", "--init-groups", "appliance", "certs",
            "issue", "plc-acceptance", "--role", "operator", "--config", CONFIG, "--out", "/var/lib/appliance/clients")
    start = time.monotonic()
    result = box.client("calls", ENDPOINT, *CLIENT)
    TIMINGS["connect + Infer + Generate"] = time.monotonic() - start
    box.calls = result  # the Backend values, for the checks that follow, whatever this call answered
    assert result["mode"] == "SignAndEncrypt" and result["policy"] == "Basic256Sha256", result
    assert result["infer"]["status"] == "Good" and result["infer"]["outputs"] > 0, result
    assert result["generate"]["status"] == "Good" and result["generate"]["tokens"] > 0, result
    assert result["generate"]["text"].strip(), result
    assert result["te-classifier/State"] == result["assistant/State"] == "Ready"


def test_backend_and_weights_are_what_the_same_cpu_gives_outside(box):
    # The same installed files in a plain root shell on the box: no unit, no sandbox, other ports and state
    outside = {"server": {"endpoint": "opc.tcp://127.0.0.1:4841", "state_dir": "/root/outside"},
               "metrics": {"listen": "127.0.0.1:9465"}, "engine": {"compile": "off"}}
    box.run(PY, "-c", "import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); "
            "[d.setdefault(k, {}).update(v) for k, v in yaml.safe_load(sys.argv[2]).items()]; "
            "yaml.safe_dump(d, open('/root/outside.yaml', 'w'))", CONFIG, json.dumps(outside))
    pid = box.run("sh", "-c", "cd /root && nohup appliance serve --config /root/outside.yaml "
                  ">/root/outside.log 2>&1 & echo $!").stdout.strip()
    try:
        deadline = time.monotonic() + 300
        while True:
            ready = box.run(PY, "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9465/readyz')",
                            check=False)
            if ready.returncode == 0:
                break
            assert time.monotonic() < deadline, box.run("cat", "/root/outside.log").stdout
            time.sleep(1)
        box.run("appliance", "certs", "issue", "plc", "--role", "operator", "--config", "/root/outside.yaml",
                "--out", "/root/outside/clients", timeout=300)
        there = box.client("calls", "opc.tcp://127.0.0.1:4841", "/root/outside/clients/plc.der",
                           "/root/outside/clients/plc.key.pem")
    finally:
        box.run("kill", pid, check=False)
    assert box.calls["te-classifier/Backend"] == there["te-classifier/Backend"], (box.calls, there)
    # The language model's Backend holds figures measured at each load ("... (auto, measured 3.6 / 7.1 ms ...)"),
    # and two paths within a few percent may swap: the weight format and the paths this CPU could run must agree
    inside, outside = box.calls["assistant/Backend"], there["assistant/Backend"]
    assert inside.split(":")[0] == outside.split(":")[0], (inside, outside)
    records = [json.loads(box.run("sh", "-c", f"cat {d}/cache/weights/assistant/choice-*.json").stdout)
               for d in ("/var/lib/appliance", "/root/outside")]
    assert sorted(records[0]["timings_ms"]) == sorted(records[1]["timings_ms"]), records
    assert records[0]["unavailable"] == records[1]["unavailable"] and records[0]["cpu_key"] == records[1]["cpu_key"]
    # the weights format the CPU gets (tests/cpu_view.py: the loader's own choice, in the plain shell)
    view = json.loads(box.run(PY, "/root/cpu_view.py", "/root/cpu-view").stdout.strip().splitlines()[-1])
    backend = box.calls["assistant/Backend"]
    # the path serving is one of those the loader chose among on this CPU (cpu_view: weight_plan.cpu_paths)
    assert any(path in backend for path in view["weights"]), (view, backend)
    # The kernels the service maps are the package's prebuilt ones (the box has no compiler to build others)
    mapped = box.client("kernels", box.show("MainPID")["MainPID"])
    assert all(lib.startswith("/opt/appliance/venv/") for lib in mapped["libs"]), mapped
    assert not box.run("sh", "-c", "ls /var/lib/appliance/cache/kernels/*.so 2>/dev/null", check=False).stdout
    if view["cpu_kernels"]:
        assert mapped["libs"], (view, mapped)
    box.kernels, box.view = mapped, view


def test_prometheus_scrapes_metrics(box):
    box.run("sh", "-c", "mkdir -p /root/prom && printf '%s\\n' 'global: {scrape_interval: 1s}' 'scrape_configs:' "
            "'  - job_name: appliance' '    static_configs: [{targets: [\"127.0.0.1:9464\"]}]' "
            "> /root/prom/prometheus.yml && cd /root/prom && nohup prometheus --config.file=prometheus.yml "
            "--storage.tsdb.path=data --web.listen-address=127.0.0.1:9090 >prometheus.log 2>&1 &")
    deadline = time.monotonic() + 120
    while True:
        try:
            if box.query('up{job="appliance"} == 1') and box.query("appliance_model_info"):
                break
        except AssertionError:
            pass  # Prometheus not answering yet
        assert time.monotonic() < deadline, "Prometheus never scraped the appliance"
        time.sleep(1)
    info = {r["metric"]["model"]: r["metric"]["backend"] for r in box.query("appliance_model_info")}
    assert info["assistant"] == box.calls["assistant/Backend"], info
    age = float(box.query("time() - appliance_heartbeat_timestamp_seconds")[0]["value"][1])
    assert -2 < age < 10, age
    good = box.query('sum(appliance_requests_total{model="te-classifier",status="Good"})')
    assert float(good[0]["value"][1]) >= 1


def test_systemctl_reload_applies_a_new_rate_limit(box):
    main = box.show("MainPID")["MainPID"]
    original = box.run("cat", CONFIG).stdout
    box.run(PY, "-c", "import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); "
            "d.setdefault('security', {})['rate_limits'] = {'per_client': {'calls_per_s': 0.01, 'burst': 1}}; "
            "yaml.safe_dump(d, open(sys.argv[1], 'w'))", CONFIG)
    box.run("systemctl", "reload", "appliance")
    assert box.client("burst", ENDPOINT, *CLIENT)["statuses"] == ["Good", "BadTooManyOperations"]
    (box.root / CONFIG.lstrip("/")).write_text(original)
    box.run("systemctl", "reload", "appliance")
    assert box.client("burst", ENDPOINT, *CLIENT)["statuses"] == ["Good", "Good"]
    assert box.show("MainPID")["MainPID"] == main  # reloaded, not restarted


def test_kill_9_of_the_main_process_ends_in_a_restart(box):
    before = box.show("MainPID", "NRestarts")
    start = time.monotonic()
    box.run("kill", "-9", before["MainPID"])
    after = box.wait_running(600, unlike_pid=before["MainPID"])
    TIMINGS["kill -9 to READY"] = time.monotonic() - start
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    assert box.client("burst", ENDPOINT, *CLIENT)["statuses"] == ["Good", "Good"]


def test_sigstop_past_the_watchdog_ends_in_a_restart(box):
    before = box.show("MainPID", "NRestarts", "WatchdogUSec")
    start = time.monotonic()
    box.run("kill", "-STOP", before["MainPID"])
    after = box.wait_running(600, unlike_pid=before["MainPID"])
    elapsed = time.monotonic() - start
    TIMINGS["SIGSTOP to READY"] = elapsed
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    assert elapsed >= 25, elapsed  # systemd waited for the watchdog (WatchdogSec=30), nothing else restarted it
    journal = box.run("journalctl", "-u", "appliance", "--no-pager", "-o", "cat").stdout
    assert "Watchdog timeout" in journal


def journal(box) -> list[dict]:
    return [json.loads(line) for line in
            box.run("journalctl", "-u", "appliance", "--no-pager", "-o", "json").stdout.splitlines()]


def structured(records: list[dict], pids: set[str]) -> list[dict]:
    """The appliance's log lines (logging.format: json, as the package's YAML sets) from the given processes."""
    return [json.loads(r["MESSAGE"]) for r in records
            if r.get("_PID") in pids and isinstance(r.get("MESSAGE"), str) and r["MESSAGE"].startswith("{")]


def test_the_journal_holds_the_structured_log_lines(box):
    records = journal(box)
    serve = {r["_PID"] for r in records if "serve" in r.get("_CMDLINE", "") and r.get("_COMM") != "systemd"}
    lines = structured(records, serve)
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    messages = [line["message"] for line in lines]
    for model in ("te-classifier", "assistant"):
        assert any(m.startswith(f"worker {model} started") for m in messages), model
    # each start says once how the models' CPU shares are enforced (cgroup cpu.weight under the unit's Delegate=yes
    # where the box's cgroup v2 has the cpu controller, else nice levels), the same on every start
    mechanisms = {m.split(" (")[0].split(":")[0] for m in messages if m.startswith("CPU shares by ")}
    assert len(mechanisms) == 1, messages
    assert any(m.startswith("configuration re-read from /etc/appliance/appliance.yaml") for m in messages)
    systemd_lines = "\n".join(r["MESSAGE"] for r in records if r.get("_COMM") == "systemd"
                              and isinstance(r.get("MESSAGE"), str))
    assert "status=9/KILL" in systemd_lines and "Watchdog timeout" in systemd_lines


def test_the_workers_log_lines_are_structured_too(box):
    """The model workers' lines (each model's load and version among them) in the same format as the serve
    process's: a log shipper parses every line of the unit the same way."""
    records = journal(box)
    workers = {r["_PID"] for r in records if "appliance.workers.worker" in r.get("_CMDLINE", "")}
    text = [r["MESSAGE"] for r in records if r.get("_PID") in workers and isinstance(r.get("MESSAGE"), str)
            and not r["MESSAGE"].startswith("{") and " INFO " in r["MESSAGE"]]
    assert workers and not text, text[:5]
    messages = [line["message"] for line in structured(records, workers)]
    for model in ("te-classifier", "assistant"):
        assert any(m.startswith(f"model {model} is Ready: version") for m in messages), model


def test_purge_leaves_nothing(box):
    start = time.monotonic()
    box.run("dpkg", "--purge", "opcua-inference-appliance", timeout=300)
    TIMINGS["dpkg --purge"] = time.monotonic() - start
    assert box.show("LoadState")["LoadState"] == "not-found"
    after = box.files()
    added, removed = after - box.before_install, box.before_install - after
    # dpkg removes a directory that the last package listing it leaves empty: /opt, which no package of a minimal
    # Debian lists, goes with the appliance (it was empty before)
    assert not any(p.startswith("/opt/") for p in box.before_install)
    assert not added and not removed - {"/opt"}, (sorted(added)[:20], sorted(removed)[:20])
    for table in ("passwd", "group", "shadow", "gshadow"):
        assert "appliance" not in box.run("cat", f"/etc/{table}").stdout, table
