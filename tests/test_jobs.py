"""The job store's tasks (appliance/jobs.py): kept until they end, whatever happens to their job, and their failures
logged. The jobs' contract through OPC UA is in test_ua_jobs.py."""
from __future__ import annotations

import asyncio
import logging

from appliance.jobs import JobStore


def store(**kw) -> JobStore:
    return JobStore(max_per_client=4, result_ttl_s=60.0, max_wait_s=1.0, **kw)


def test_a_released_job_is_cancelled_and_shutdown_waits_for_its_end():
    async def main():
        async def run(progress):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(10)  # letting go takes a while (a worker to tell): only shutdown cuts it short
                raise

        jobs = store()
        job = jobs.start("plc1", "m", "infer", run)
        await asyncio.sleep(0)  # running
        jobs.release("plc1", "m", job.id)  # gone from the store, its task cancelled but not ended yet
        assert not job.task.done()
        await asyncio.sleep(0.05)
        assert not job.task.done()  # still letting go
        await asyncio.wait_for(jobs.cancel_all(), 5)  # a store that forgot the task would return before its end
        return job

    job = asyncio.run(main())
    assert job.task.done() and str(job.error) == "the job was released"


def test_a_job_whose_ready_hook_fails_is_logged(caplog):
    def broken(job):
        raise RuntimeError("the event could not be raised")

    async def main():
        async def run(progress):
            return 42

        jobs = store(on_ready=broken)
        job = jobs.start("plc1", "m", "infer", run)
        done = await jobs.wait("plc1", "m", job.id, 1.0)
        await asyncio.sleep(0)  # the task's done-callback
        await jobs.cancel_all()
        return done.result

    with caplog.at_level(logging.ERROR, logger="appliance.jobs"):
        assert asyncio.run(main()) == 42
    failed = [r for r in caplog.records if r.getMessage().startswith("job task job-")]
    assert len(failed) == 1 and str(failed[0].exc_info[1]) == "the event could not be raised"
