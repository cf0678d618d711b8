"""Test-only: a hang in a generative model's engine thread, for the worker processes one test starts.

Python imports `sitecustomize` at start-up from its path; tests/worker_probes.hook_environment puts this folder first
on the PYTHONPATH of the appliance's workers and names a trigger file in APPLIANCE_TEST_HANG_FILE. Nothing in the
appliance knows of it, and without that variable it does nothing.

Armed, the first engine step (appliance.engine.llm.runner.ModelRunner.run: a forward pass) that begins while the trigger
file exists never ends, as a forward pass stuck in a kernel would. With APPLIANCE_TEST_HANG_AT=tokenizer it is the
first prompt tokenization instead (models.tokenizer.ChatTokenizer.turn_tokens_and_head: a chat template or a
pre-tokenizer stuck in a loop). It claims the file first (renamed to `<file>.hung`, holding the time.monotonic() the
hang began), so the replacement worker serves normally.
"""
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

TRIGGER = os.environ.get("APPLIANCE_TEST_HANG_FILE")
AT = os.environ.get("APPLIANCE_TEST_HANG_AT", "runner")
TARGET, CLASS, METHOD = {"runner": ("appliance.engine.llm.runner", "ModelRunner", "run"),
                         "tokenizer": ("models.tokenizer", "ChatTokenizer", "turn_tokens_and_head")}[AT]


def _hang_here() -> bool:
    claimed = f"{TRIGGER}.claimed.{os.getpid()}"
    try:
        os.rename(TRIGGER, claimed)
    except FileNotFoundError:
        return False
    with open(claimed, "w") as f:
        f.write(repr(time.monotonic()))
    os.rename(claimed, f"{TRIGGER}.hung")
    return True


def _patch(module) -> None:
    cls = getattr(module, CLASS)
    original = getattr(cls, METHOD)

    def run_or_hang(self, *args, **kwargs):
        if _hang_here():
            threading.Event().wait()  # forever, like a stuck kernel or a template in a loop
        return original(self, *args, **kwargs)
    setattr(cls, METHOD, run_or_hang)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


if TRIGGER:
    sys.meta_path.insert(0, _AfterImport())


# Checking the soak's leak check (tests/test_workers_load.py, APPLIANCE_SOAK_LEAK_MB_S): a process that loads this
# leaks that many MB a second, its pages touched, as a leak in the engine would.
LEAK_MB_S = float(os.environ.get("APPLIANCE_TEST_LEAK_MB_S", "0") or 0)


def _leak_forever() -> None:
    kept, size = [], int(LEAK_MB_S * 2**20 / 10)
    while True:
        kept.append(b"\x01" * size)
        time.sleep(0.1)


if LEAK_MB_S > 0:
    threading.Thread(target=_leak_forever, name="test-leak", daemon=True).start()


# A worker that outgrows its memory cap (tests/test_cgroup_memory.py): once APPLIANCE_TEST_BLOAT_FILE exists, the first
# worker process to see it claims it and allocates until the cgroup's OOM killer ends it (its replacement is clean).
BLOAT = os.environ.get("APPLIANCE_TEST_BLOAT_FILE")


def _is_worker() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"appliance.workers.worker" in f.read()
    except OSError:
        return False


def _bloat_when_told() -> None:
    while True:
        try:
            os.rename(BLOAT, f"{BLOAT}.claimed")
            break
        except FileNotFoundError:
            time.sleep(0.05)
    kept = []
    while True:
        kept.append(b"\x01" * (16 << 20))
        time.sleep(0.01)


if BLOAT and _is_worker():
    threading.Thread(target=_bloat_when_told, name="test-bloat", daemon=True).start()
