"""A hang caught in time: a hang in the engine thread of a generative worker (a forward pass that never returns) and
in a batched tensor worker (an ONNX model whose forward pass loops for ever). Within `engine.worker_timeout_s` of the
hang the model's Heartbeat stops and /readyz (scraped over HTTP) answers 503; until then both go on, since a forward
pass may take a while; the worker is killed within one more second, the hung call answered BadInternalError, and the
replacement serves.

Real worker processes, a real OPC UA client over SignAndEncrypt. The generative hang comes from tests/hooks (a
start-up hook of the test's worker processes only) and says to the microsecond when it began; the tensor model's hang
is a real model file, and its start is taken as the moment its call was sent (the call reaches the engine thread
within SLACK_S, the one tolerance these assertions allow)."""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import hang_model
from uaclient import call, floats, read, run, session, status_name
from worker_probes import DataChanges, HttpSampler, hook_environment, process_gone, wait_for

SLACK_S = 0.3  # a call's trip from the client to the engine thread, and a published value's 0.25 s tick
RESTART_BACKOFF_S = 1.0  # the replacement comes a second after the kill: time to watch the stopped Heartbeat
V = ua.VariantType


def generate_args(prompt: str, max_tokens: int = 4) -> list:
    return [ua.Variant(prompt, V.String), ua.Variant(max_tokens, V.UInt32), ua.Variant(0.0, V.Float)]


async def read_heartbeats(client, model: str, reads: list, stop: asyncio.Event) -> None:
    """(sent, value) of Models/<model>/Heartbeat every 0.2 s, on time.monotonic()."""
    while not stop.is_set():
        sent = time.monotonic()
        reads.append((sent, await read(client, "Models", model, "Heartbeat")))
        await asyncio.sleep(0.2)


def check_caught_in_time(hang: float, answered: float, timeout: float, slack: float, sampler: HttpSampler,
                         beats: list, answer_status: str) -> None:
    """The hang began at `hang` (time.monotonic(); `slack` for how late it may really have begun)."""
    assert answer_status == "BadInternalError", answer_status
    # killed one timeout after the hang began (its last progress), within one more second
    assert timeout - 0.3 <= answered - hang <= timeout + slack + 1.0, answered - hang
    # while the stall is shorter than the timeout the model is ready ...
    before = sampler.between(hang + 0.3, hang + timeout - 0.5, monotonic=True)
    assert before and all(s.ready == 200 for s in before), [(round(s.sent_mono - hang, 2), s.ready) for s in before]
    # ... from the timeout on it is not: every /readyz request sent since answers 503, until the replacement is Ready
    back = min((s.sent_mono for s in sampler.samples if s.sent_mono > answered and s.ready == 200), default=math.inf)
    after = sampler.between(hang + timeout + slack, back - 0.01, monotonic=True)
    assert len(after) >= 3 and all(s.ready == 503 for s in after), \
        [(round(s.sent_mono - hang, 2), s.ready) for s in after]
    # the Heartbeat moved while the stall was shorter than the timeout, and not once after it (until Ready again)
    during = [v for sent, v in beats if hang + 0.2 <= sent <= hang + timeout - 0.3]
    assert during and during[-1] > during[0], during
    later = [v for sent, v in beats if hang + timeout + slack + 0.25 <= sent <= back]
    assert len(later) >= 3 and len(set(later)) == 1 and later[0] >= during[-1], (during, later)


def test_a_hung_generative_forward_pass_is_caught_within_the_timeout(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    timeout = 3.0
    trigger = tmp_path / "hang-now"
    hook_environment(monkeypatch, trigger)
    make_model_dir(tmp_path / "chat")
    app = RunningAppliance(tmp_path / "state", {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}},
                           {"engine": {"worker_timeout_s": timeout, "worker_restart_backoff_s": RESTART_BACKOFF_S}})
    try:
        plc = app.issue("plc", "operator")
        pid = app.app.services["chat"].supervisor.process.pid

        async def go():
            async with session(app, *plc) as c, session(app, *plc) as monitor:
                assert status_name(await call(c, "chat", "Generate", generate_args("Hello"))) == "Good"
                beats, stop = [], asyncio.Event()
                reader = asyncio.create_task(read_heartbeats(monitor, "chat", beats, stop))
                await asyncio.sleep(1.5)
                trigger.write_text("")
                r = await call(c, "chat", "Generate", generate_args("The pump"))  # its forward pass hangs
                answered = time.monotonic()
                await asyncio.sleep(RESTART_BACKOFF_S + 1.5)
                stop.set()
                await reader
                hang = float(Path(f"{trigger}.hung").read_text())
                return hang, answered, status_name(r), beats
        with HttpSampler(app.metrics_url) as sampler:
            hang, answered, status, beats = run(go())
        print(f"hang at 0, killed and answered at {answered - hang:.2f} s (worker_timeout_s {timeout:g})")
        check_caught_in_time(hang, answered, timeout, 0.0, sampler, beats, status)
        first = next(s for s in sampler.samples if s.ready == 503)
        assert any("does not answer liveness checks" in r or "restarting" in r for r in first.reasons), first
        assert wait_for(lambda: process_gone(pid), 2, "the hung worker gone")

        async def after():  # the replacement serves (the hang was the old worker's only)
            async with session(app, *plc) as c:
                await asyncio.to_thread(wait_for, lambda: app.app.services["chat"].status().state == "Ready", 60,
                                        "chat Ready again")
                assert status_name(await call(c, "chat", "Generate", generate_args("Hello"))) == "Good"
                assert await read(c, "Models", "chat", "WorkerRestarts") == 1
        run(after())
    finally:
        app.stop()


def test_a_hung_tokenizer_is_caught_and_the_kill_shows_in_worker_restarting_and_worker_up(tmp_path, monkeypatch):
    """The prompt's tokenization (a chat template or pre-tokenizer in a loop) hangs instead of a forward pass: the
    call is answered all the same, one timeout later; from the kill until the replacement is Ready the control room
    sees Alarms/WorkerRestarting true (a SCADA subscription) and appliance_worker_up 0 (/metrics), and neither
    before the kill nor after."""
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    timeout = 3.0
    trigger = tmp_path / "hang-now"
    hook_environment(monkeypatch, trigger, at="tokenizer")
    make_model_dir(tmp_path / "chat")
    app = RunningAppliance(tmp_path / "state", {"chat": {"kind": "generative", "path": str(tmp_path / "chat")}},
                           {"engine": {"worker_timeout_s": timeout, "worker_restart_backoff_s": RESTART_BACKOFF_S}})
    try:
        plc, scada = app.issue("plc", "operator"), app.issue("scada", "monitor")
        wall_minus_mono = time.time() - time.monotonic()

        async def go():
            async with session(app, *plc) as c, session(app, *scada) as s:
                assert status_name(await call(c, "chat", "Generate", generate_args("Hello"))) == "Good"
                ns = await s.get_namespace_index("urn:opcua-inference-appliance")
                alarm = await s.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Alarms", f"{ns}:WorkerRestarting"])
                changes = DataChanges()
                changes.names = {alarm: "WorkerRestarting"}
                sub = await s.create_subscription(20, changes)
                await sub.subscribe_data_change([alarm])
                beats, stop = [], asyncio.Event()
                reader = asyncio.create_task(read_heartbeats(s, "chat", beats, stop))
                await asyncio.sleep(1.5)
                trigger.write_text("")
                r = await call(c, "chat", "Generate", generate_args("The pump"))  # its tokenization hangs
                answered = time.monotonic()
                await asyncio.to_thread(wait_for, lambda: app.app.services["chat"].status().state == "Ready", 60,
                                        "chat Ready again")
                await asyncio.sleep(1.5)
                stop.set()
                await reader
                assert status_name(await call(c, "chat", "Generate", generate_args("Hello"))) == "Good"
                return answered, status_name(r), beats, changes
        with HttpSampler(app.metrics_url) as sampler:
            answered, status, beats, changes = run(go(), timeout=180)
        hang = float(Path(f"{trigger}.hung").read_text())
        print(f"tokenizer hung at 0, killed and answered at {answered - hang:.2f} s (worker_timeout_s {timeout:g})")
        check_caught_in_time(hang, answered, timeout, 0.0, sampler, beats, status)
        # WorkerRestarting: false through the hang, true from the kill, false again once the model is Ready
        flips = [(t - wall_minus_mono, v) for t, v in changes.of("WorkerRestarting")]
        assert flips[0][1] is False and [v for t, v in flips if t > hang] == [True, False], flips
        (raised, _), (cleared, _) = [(t, v) for t, v in flips if t > hang]
        assert hang + timeout - 0.3 <= raised <= answered + 0.5, (raised - hang, answered - hang)
        back = min(s.sent_mono for s in sampler.samples if s.sent_mono > answered and s.ready == 200)
        assert abs(cleared - back) <= 0.6, (cleared - hang, back - hang)
        # appliance_worker_up: 1 while the stall is shorter than the timeout, 0 from the kill until Ready, then 1
        before = sampler.between(hang + 0.3, hang + timeout - 0.5, monotonic=True)
        during = sampler.between(raised + 0.3, cleared - 0.3, monotonic=True)
        after = sampler.between(back + 0.3, math.inf, monotonic=True)
        assert before and all(x.worker_up.get("chat") == 1.0 for x in before), [x.worker_up for x in before]
        assert len(during) >= 3 and all(x.worker_up.get("chat") == 0.0 for x in during), [x.worker_up for x in during]
        assert after and all(x.worker_up.get("chat") == 1.0 for x in after), [x.worker_up for x in after]
    finally:
        app.stop()


def test_a_hung_batched_tensor_model_is_caught_within_the_timeout(tmp_path):
    timeout = 2.0
    # max_queue_delay_ms > 0: every call goes through the batcher and its inference thread (never inline)
    app = RunningAppliance(tmp_path / "state", {"spin": {"kind": "tensor", "path": str(hang_model(tmp_path / "h.onnx")),
                                                         "max_queue_delay_ms": 5}},
                           {"engine": {"worker_timeout_s": timeout, "worker_restart_backoff_s": RESTART_BACKOFF_S}})
    try:
        plc = app.issue("plc", "operator")
        pid = app.app.services["spin"].supervisor.process.pid

        async def go():
            async with session(app, *plc) as c, session(app, *plc) as monitor:
                assert status_name(await call(c, "spin", "Infer", [floats([0, 0, 0, 0])])) == "Good"
                beats, stop = [], asyncio.Event()
                reader = asyncio.create_task(read_heartbeats(monitor, "spin", beats, stop))
                await asyncio.sleep(1.5)
                sent = time.monotonic()
                # one batch: a sample that loops for ever and two that would not
                calls = [asyncio.create_task(call(c, "spin", "Infer", [floats(x)]))
                         for x in ([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0])]
                done = await asyncio.gather(*calls)
                answered = time.monotonic()
                await asyncio.sleep(RESTART_BACKOFF_S + 1.5)
                stop.set()
                await reader
                return sent, answered, [status_name(r) for r in done], beats
        with HttpSampler(app.metrics_url) as sampler:
            sent, answered, statuses, beats = run(go())
        print(f"call sent at 0, killed and answered at {answered - sent:.2f} s (worker_timeout_s {timeout:g})")
        assert statuses[1:] == ["BadInternalError"] * 2, statuses  # in its batch, or queued behind it
        check_caught_in_time(sent, answered, timeout, SLACK_S, sampler, beats, statuses[0])
        assert wait_for(lambda: process_gone(pid), 2, "the hung worker gone")

        async def after():
            async with session(app, *plc) as c:
                await asyncio.to_thread(wait_for, lambda: app.app.services["spin"].status().state == "Ready", 30,
                                        "spin Ready again")
                assert status_name(await call(c, "spin", "Infer", [floats([0, 0, 0, 0])])) == "Good"
        run(after())
    finally:
        app.stop()
