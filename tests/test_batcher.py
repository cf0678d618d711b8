"""The dynamic batcher, driven by real numpy "models" running in a real thread pool."""
from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

import numpy as np
import pytest

from appliance.engine.tensor.batcher import BatchPolicy, DynamicBatcher
from core.errors import DeadlineExceeded, EngineFailure, NotReady, ResourceUnavailable
from appliance.metrics import Metrics

RNG = np.random.default_rng(7)
W = RNG.standard_normal((6, 3)).astype(np.float32)


def mlp(x: np.ndarray) -> np.ndarray:
    """A per-sample nonlinear model: batching must not change any sample's result."""
    return np.tanh(x @ W) * 2.0 + 0.5


class Recorder:
    """An execute callable that records every batch it ran, optionally held at a gate."""

    def __init__(self, fn=mlp, tag="v1", gate: threading.Event | None = None, sleep_s: float = 0.0):
        self.fn, self.tag, self.gate, self.sleep_s = fn, tag, gate, sleep_s
        self.batches: list[np.ndarray] = []
        self.started = threading.Event()

    def __call__(self, batch: np.ndarray):
        self.batches.append(batch.copy())
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.fn(batch), self.tag


@pytest.fixture
def executor():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def later(seconds: float) -> float:
    return time.monotonic() + seconds


def hist(metrics: Metrics, name: str, model: str = "m") -> float:
    return metrics.registry.get_sample_value(name, {"model": model}) or 0.0


async def wait_until(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        await asyncio.sleep(0.002)


def test_concurrent_requests_are_merged_and_equal_unbatched_results(executor):
    metrics = Metrics()
    rec = Recorder()
    batcher = DynamicBatcher("m", BatchPolicy(64, 0.02, 100), rec, metrics, executor)
    inputs = [RNG.standard_normal((1 + i % 3, 6)).astype(np.float32) for i in range(16)]

    async def main():
        results = await asyncio.gather(*(batcher.submit(x, later(5)) for x in inputs))
        await batcher.close()
        return results

    results = asyncio.run(main())
    for x, (out, tag) in zip(inputs, results):
        assert tag == "v1"
        assert out.shape == (len(x), 3)
        np.testing.assert_allclose(out, mlp(x), rtol=1e-6)  # same as running the request alone
    sizes = [len(b) for b in rec.batches]
    assert sum(sizes) == sum(len(x) for x in inputs)
    assert max(sizes) > 1 and len(sizes) < len(inputs)
    assert hist(metrics, "appliance_batch_size_count") == len(sizes)
    assert hist(metrics, "appliance_batch_size_sum") == sum(sizes)
    assert hist(metrics, "appliance_queue_wait_seconds_count") == len(inputs)
    assert metrics.registry.get_sample_value("appliance_queue_depth", {"model": "m"}) == 0


def test_batches_hold_whole_requests_within_max_and_an_oversized_one_runs_alone(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(8, 0.05, 100), rec, None, executor)
    # Each request is 3 samples whose rows carry the request id, so a split request would show.
    reqs = [np.full((3, 6), i, np.float32) for i in range(6)] + [np.full((10, 6), 99, np.float32)]

    async def main():
        first = asyncio.ensure_future(batcher.submit(np.full((1, 6), -1, np.float32), later(5)))
        await asyncio.to_thread(rec.started.wait, 5)  # the first batch runs, the rest queue up behind it
        tasks = [asyncio.ensure_future(batcher.submit(x, later(5))) for x in reqs]
        await wait_until(lambda: batcher.queue_depth == len(reqs))
        gate.set()
        await asyncio.gather(first, *tasks)
        await batcher.close()

    asyncio.run(main())
    later_batches = rec.batches[1:]
    for batch in later_batches:
        ids = batch[:, 0]
        for rid in np.unique(ids):
            assert (ids == rid).sum() == (10 if rid == 99 else 3)  # never split
        assert len(batch) <= 8 or set(ids) == {99}
    assert [len(b) for b in later_batches] == [6, 6, 6, 10]


def test_full_queue_is_refused_at_once(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(1, 0.0, 2), rec, None, executor)
    x = np.ones((1, 6), np.float32)

    async def main():
        running = asyncio.ensure_future(batcher.submit(x, later(5)))
        await asyncio.to_thread(rec.started.wait, 5)
        queued = [asyncio.ensure_future(batcher.submit(x, later(5))) for _ in range(2)]
        await wait_until(lambda: batcher.queue_depth == 2)
        t0 = time.monotonic()
        with pytest.raises(ResourceUnavailable):
            await batcher.submit(x, later(5))
        assert time.monotonic() - t0 < 0.05
        gate.set()
        results = await asyncio.gather(running, *queued)
        await batcher.close()
        return results

    assert len(asyncio.run(main())) == 3


def test_deadlines_expire_in_the_queue_and_while_running(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(4, 0.0, 10), rec, None, executor)

    async def main():
        slow = asyncio.ensure_future(batcher.submit(np.full((1, 6), 1, np.float32), later(0.2)))
        await asyncio.to_thread(rec.started.wait, 5)
        queued = asyncio.ensure_future(batcher.submit(np.full((1, 6), 2, np.float32), later(0.1)))
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await slow  # its batch still runs: the caller stops waiting at its deadline anyway
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(DeadlineExceeded):
            await queued
        assert batcher.queue_depth == 0
        gate.set()
        with pytest.raises(DeadlineExceeded):  # already past: refused before queueing
            await batcher.submit(np.ones((1, 6), np.float32), time.monotonic() - 1)
        ok = await batcher.submit(np.full((1, 6), 3, np.float32), later(5))
        await batcher.close()
        return ok

    out, _ = asyncio.run(main())
    np.testing.assert_allclose(out, mlp(np.full((1, 6), 3, np.float32)), rtol=1e-6)
    ran = {float(b[0, 0]) for b in rec.batches}
    assert ran == {1.0, 3.0}  # the request that expired in the queue never ran


def test_a_lone_request_of_a_fast_model_runs_at_once_on_the_callers_thread(executor):
    """The inline fast path (a worker answers such a request in the read callback that decoded it): only once
    batches have shown the model is fast, only while no batch is queued or running, never with a queue delay."""
    gate = threading.Event()
    threads: list[int] = []

    def fn(x):
        threads.append(threading.get_ident())
        return mlp(x)
    rec = Recorder(fn=fn, gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(4, 0.0, 10), rec, None, executor, inline_fast_path=True)
    delayed = DynamicBatcher("d", BatchPolicy(4, 0.01, 10), Recorder(), None, executor, inline_fast_path=True)
    x = np.full((1, 6), 1, np.float32)

    async def main():
        running = asyncio.ensure_future(batcher.submit(np.full((1, 6), 2, np.float32), later(5)))
        await asyncio.to_thread(rec.started.wait, 5)  # its speed unknown: the first batch went to the executor
        assert batcher.submit_now(x, later(5)) is None and len(rec.batches) == 1  # a batch runs: wait behind it
        gate.set()
        await running
        assert threads == [threads[0]] and threads[0] != threading.get_ident()
        answer = None
        for _ in range(100):  # the held first batch looked slow: fast batches bring the average down
            answer = batcher.submit_now(x, later(5))
            if answer is not None:
                break
            await batcher.submit(x, later(5))
        assert answer is not None and threads[-1] == threading.get_ident()  # run here, at once
        np.testing.assert_allclose(answer[0], mlp(x), rtol=1e-6)
        assert answer[1] == "v1"
        with pytest.raises(DeadlineExceeded):
            batcher.submit_now(x, time.monotonic() - 1)
        await delayed.submit(x, later(5))
        assert delayed.submit_now(x, later(5)) is None  # a queue delay: every request waits for company
        await batcher.close()
        await delayed.close()
        with pytest.raises(NotReady):
            batcher.submit_now(x, later(5))

    asyncio.run(main())


def test_deadline_passed_while_the_batch_formed_is_not_run(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(8, 0.0, 10), rec, None, executor)

    async def main():
        blocker = asyncio.ensure_future(batcher.submit(np.full((1, 6), 1, np.float32), later(5)))
        await asyncio.to_thread(rec.started.wait, 5)
        short = asyncio.ensure_future(batcher.submit(np.full((1, 6), 2, np.float32), later(0.05)))
        long = asyncio.ensure_future(batcher.submit(np.full((1, 6), 3, np.float32), later(5)))
        await asyncio.sleep(0.1)
        gate.set()
        await blocker
        with pytest.raises(DeadlineExceeded):
            await short
        await long
        await batcher.close()

    asyncio.run(main())
    assert [sorted(set(b[:, 0].tolist())) for b in rec.batches] == [[1.0], [3.0]]


def test_non_finite_output_fails_only_that_request(executor):
    def nan_on_marker(x):
        out = mlp(x)
        out[x[:, 0] == 42] = np.nan
        out[x[:, 0] == 43] = np.inf
        return out

    rec = Recorder(fn=nan_on_marker)
    batcher = DynamicBatcher("m", BatchPolicy(16, 0.05, 10), rec, None, executor)
    good = np.zeros((2, 6), np.float32)
    nan = np.zeros((2, 6), np.float32)
    nan[1, 0] = 42
    inf = np.zeros((1, 6), np.float32)
    inf[0, 0] = 43

    async def main():
        results = await asyncio.gather(*(batcher.submit(x, later(5)) for x in (good, nan, inf)),
                                       return_exceptions=True)
        await batcher.close()
        return results

    r_good, r_nan, r_inf = asyncio.run(main())
    assert len(rec.batches) == 1  # all three shared one batch
    np.testing.assert_allclose(r_good[0], mlp(good), rtol=1e-6)
    assert isinstance(r_nan, EngineFailure) and isinstance(r_inf, EngineFailure)


def test_exception_in_execute_fails_the_batch_and_the_batcher_survives(executor):
    def explode_on_marker(x):
        if (x[:, 0] == 13).any():
            raise RuntimeError("/secret/path/model.onnx: kernel exploded")
        return mlp(x)

    rec = Recorder(fn=explode_on_marker)
    batcher = DynamicBatcher("m", BatchPolicy(16, 0.05, 10), rec, None, executor)
    bad = np.full((1, 6), 13, np.float32)
    ok = np.zeros((1, 6), np.float32)

    async def main():
        first = await asyncio.gather(batcher.submit(ok, later(5)), batcher.submit(bad, later(5)),
                                     return_exceptions=True)
        second = await batcher.submit(ok, later(5))
        await batcher.close()
        return first, second

    first, second = asyncio.run(main())
    assert all(isinstance(r, EngineFailure) for r in first)
    assert all("/secret" not in str(r) and "exploded" not in str(r) for r in first)
    np.testing.assert_allclose(second[0], mlp(ok), rtol=1e-6)


def test_wrong_row_count_from_execute_is_an_engine_failure(executor):
    batcher = DynamicBatcher("m", BatchPolicy(16, 0.0, 10), Recorder(fn=lambda x: mlp(x)[:1]), None, executor)

    async def main():
        with pytest.raises(EngineFailure):
            await batcher.submit(np.zeros((3, 6), np.float32), later(5))
        await batcher.close()

    asyncio.run(main())


def test_cancelled_submit_leaves_the_queue(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    metrics = Metrics()
    batcher = DynamicBatcher("m", BatchPolicy(1, 0.0, 10), rec, metrics, executor)

    async def main():
        running = asyncio.ensure_future(batcher.submit(np.full((1, 6), 0, np.float32), later(5)))
        await asyncio.to_thread(rec.started.wait, 5)
        queued = [asyncio.ensure_future(batcher.submit(np.full((1, 6), i, np.float32), later(5))) for i in (1, 2, 3)]
        await wait_until(lambda: batcher.queue_depth == 3)
        queued[1].cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert batcher.queue_depth == 2
        assert metrics.registry.get_sample_value("appliance_queue_depth", {"model": "m"}) == 2
        gate.set()
        await asyncio.gather(running, queued[0], queued[2])
        await batcher.close()

    asyncio.run(main())
    assert sorted(float(b[0, 0]) for b in rec.batches) == [0.0, 1.0, 3.0]


def test_close_fails_waiting_requests_and_lets_the_running_batch_finish(executor):
    gate = threading.Event()
    rec = Recorder(gate=gate)
    batcher = DynamicBatcher("m", BatchPolicy(1, 0.0, 10), rec, None, executor)

    async def main():
        running = asyncio.ensure_future(batcher.submit(np.zeros((1, 6), np.float32), later(5)))
        await asyncio.to_thread(rec.started.wait, 5)
        waiting = asyncio.ensure_future(batcher.submit(np.ones((1, 6), np.float32), later(5)))
        await wait_until(lambda: batcher.queue_depth == 1)
        closing = asyncio.ensure_future(batcher.close())
        await asyncio.sleep(0.02)
        assert not closing.done()  # waits for the running batch
        with pytest.raises(NotReady):
            await waiting
        gate.set()
        await closing
        out, _ = await running
        with pytest.raises(NotReady):
            await batcher.submit(np.zeros((1, 6), np.float32), later(5))
        return out

    np.testing.assert_allclose(asyncio.run(main()), mlp(np.zeros((1, 6), np.float32)), rtol=1e-6)
    assert len(rec.batches) == 1


def test_every_request_answered_exactly_once_under_random_load(executor):
    """A few hundred concurrent submits with random sizes, deadlines and cancellations."""
    rnd = random.Random(1234)
    executed: dict[int, int] = {}

    def execute(x):
        for rid in np.unique(x[:, 0]).astype(int):
            executed[int(rid)] = executed.get(int(rid), 0) + 1
        time.sleep(rnd.uniform(0, 0.003))
        return mlp(x), "v"

    metrics = Metrics()
    batcher = DynamicBatcher("m", BatchPolicy(16, 0.004, 80), execute, metrics, executor)
    n = 300
    answers: dict[int, list] = {i: [] for i in range(n)}
    in_submit: set[int] = set()

    async def one(rid: int):
        await asyncio.sleep(rnd.uniform(0, 0.3))
        x = RNG.standard_normal((rnd.randint(1, 6), 6)).astype(np.float32)
        x[:, 0] = rid
        in_submit.add(rid)
        try:
            out, tag = await batcher.submit(x, later(rnd.choice([0.005, 0.05, 5.0])))
        except asyncio.CancelledError:
            answers[rid].append("cancelled")
            raise
        except (DeadlineExceeded, ResourceUnavailable, EngineFailure) as exc:
            answers[rid].append(type(exc).__name__)
            return
        except Exception as exc:  # recorded, so the asserts below name it (gather would swallow it)
            answers[rid].append(repr(exc))
            return
        finally:
            in_submit.discard(rid)
        # atol too: an output near zero differs in its last bits between batch shapes of the BLAS kernel
        same = np.allclose(out, mlp(x), rtol=1e-5, atol=1e-6)
        answers[rid].append("ok" if same else f"wrong rows: {out} != {mlp(x)}")

    async def main():
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        for _ in range(60):  # cancel callers while they wait in the queue or on a running batch
            await asyncio.sleep(rnd.uniform(0, 0.005))
            if in_submit:
                tasks[rnd.choice(sorted(in_submit))].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert batcher.queue_depth == 0
        await batcher.close()

    asyncio.run(main())
    outcomes = [a for a in answers.values()]
    assert all(len(a) <= 1 for a in outcomes), [a for a in outcomes if len(a) > 1]
    assert all(len(a) == 1 for a in outcomes), [r for r, a in answers.items() if not a]  # each answered once
    assert {a[0] for a in outcomes} <= {"ok", "DeadlineExceeded", "ResourceUnavailable", "EngineFailure",
                                        "cancelled"}, outcomes
    kinds = {a[0] for a in outcomes if a}
    assert {"ok", "DeadlineExceeded", "cancelled"} <= kinds
    assert all(count == 1 for count in executed.values())  # nothing ran twice
    assert all(answers[rid] in (["ok"], ["cancelled"], ["DeadlineExceeded"]) for rid in executed)
    assert metrics.registry.get_sample_value("appliance_queue_depth", {"model": "m"}) == 0


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        BatchPolicy(0, 0.01, 10)
    with pytest.raises(ValueError):
        BatchPolicy(8, -1, 10)
    with pytest.raises(ValueError):
        BatchPolicy(8, 0.01, 0)
