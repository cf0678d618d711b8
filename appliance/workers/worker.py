"""A model worker process: `python -m appliance.workers.worker --fd N --parent-pid P --group G`.

Hosts the engine services of its models (tensor: dynamic batcher + backend; generative: scheduler, slots, runner;
built by appliance/workers/engine_factory.py) on its own event loop and answers the serve process over the
inherited socket. It knows nothing of OPC UA: failures travel as engine reasons. It ends when the serve process
says Stop, when the socket closes, or when the serve process dies (PR_SET_PDEATHSIG), so no worker outlives its
parent; SIGTERM and SIGINT, which a stop of the systemd unit or Ctrl-C send to every process, it ignores: serve stops
it once the calls in flight are answered. A process it forks (the decode step's compiler) gets both signals back and
ends with the worker (appliance/workers/os_setup.py).

Liveness: each Ping is answered with since when the current engine operation has run (engine/liveness.py), from
the moment the process runs (the engines are imported in a thread); a worker stopped by SIGSTOP answers nothing.
The serve process judges both. The worker checks its own peak memory on each
Ping and exits with MEMORY_EXIT past `engine.worker_memory_mb`, since a short spike could escape the parent's
sampling.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import numpy as np

from appliance.engine.engine_metrics import EngineMetrics
from appliance.engine.liveness import Liveness
from core.errors import ApplianceError, InvalidArgument
from appliance.logs import configure_logging
from core.task_set import TaskSet
from appliance.workers import protocol as p
from appliance.workers.engine_factory import build_service
from appliance.workers.os_setup import (WORKER_NICE, die_with_parent, forked_children_end_with_the_worker,
                                        keep_triton_out, peak_rss_mb, prefer_as_oom_victim, release_free_heap)

log = logging.getLogger("appliance.worker")
_group = ""  # this process's worker group (--group), named on its log lines

MEMORY_EXIT = 75  # exit status: the worker exceeded its memory limit


def snapshot(svc) -> p.ModelSnapshot:
    snap = p.ModelSnapshot(name=svc.name, state=svc.state, version=svc.version or "",
                           backend=svc.backend_name or "", failure_reason=svc.failure_reason or "",
                           queue_depth=int(svc.queue_depth))
    if svc.kind == "tensor":
        snap.input_shape = [int(d) for d in svc.input_shape]
        snap.output_shape = [int(d) for d in svc.output_shape]
    else:
        snap.slots_total = int(svc.slots_total)
        snap.slots_in_use = int(svc.slots_in_use)
        snap.conversations_parked = int(svc.conversations_parked)
    return snap


class WorkerHost:
    def __init__(self, channel: p.Channel, start: p.Start):
        self.channel = channel
        self.memory_mb = start.memory_mb
        self.liveness = Liveness()
        self.metrics = EngineMetrics()
        self.services = {}  # filled once built (see run)
        self._start = start
        self._loop = asyncio.get_running_loop()
        self._calls: dict[int, asyncio.Task] = {}
        self._tasks = TaskSet(log, "worker")  # model starts and stops, kept until done
        self._finished: asyncio.Future | None = None  # set once Stop has been answered

    def _build_services(self) -> dict:
        """In a thread: importing the engines (torch takes seconds on a busy machine) must not keep the loop from
        answering liveness checks, or a slow start would look like a hang."""
        inline = all(spec.kind == "tensor" for spec in self._start.models)
        keep_triton_out(self._start.models)
        return {spec.name: build_service(spec, threads=self._start.threads, metrics=self.metrics,
                                         liveness=self.liveness, on_event=self._event_sender(spec.name),
                                         inline_batches=inline)
                for spec in self._start.models}

    def _event_sender(self, model: str):
        loop = self._loop

        def on_event(kind: str, message: str) -> None:  # may be called from an engine thread
            loop.call_soon_threadsafe(self._send, p.Event(model=model, kind=kind, message=message))
        return on_event

    def _send(self, message) -> None:
        try:
            self.channel.send(message)
        except ConnectionError:
            os._exit(0)  # the serve process is gone

    def _push_state(self) -> None:
        self._send(self._pong(0))

    def _pong(self, seq: int) -> p.Pong:
        return p.Pong(seq=seq, busy_since=self.liveness.busy_since(),
                      models=[snapshot(s) for s in self.services.values()], records=self.metrics.drain())

    def _check_memory(self) -> None:
        if self.memory_mb <= 0:
            return
        peak_mb = peak_rss_mb()
        if peak_mb > self.memory_mb:
            log.error("worker memory peaked at %.0f MB, above engine.worker_memory_mb = %d: exiting", peak_mb,
                      self.memory_mb)
            os._exit(MEMORY_EXIT)

    async def run(self) -> None:
        """Serve until Stop has been answered; messages arrive through _on_message as they are decoded."""
        self._finished = self._loop.create_future()
        self.channel.listen(self._on_message, self._connection_ended)
        self._tasks.start(self._load_models())
        await self._finished

    def _connection_ended(self, reason: str) -> None:
        log.warning("the serve process closed the connection (%s): exiting", reason)
        os._exit(0)

    def _on_message(self, message) -> None:
        if self._finished.done():
            return  # stopped: nothing more is served
        if isinstance(message, p.Ping):
            self._check_memory()
            self._send(self._pong(message.seq))
        elif isinstance(message, (p.Infer, p.Generate, p.Choose, p.Reset, p.Reload)):
            if not (isinstance(message, p.Infer) and self._answered_now(message)):
                self._calls[message.id] = asyncio.create_task(self._serve(message))
        elif isinstance(message, p.Cancel):
            task = self._calls.get(message.id)
            if task is not None:
                task.cancel()
        elif isinstance(message, p.ShedLoad):
            svc = self.services.get(message.model)
            if svc is not None and svc.kind == "tensor":
                svc.shed_load(message.on)
        elif isinstance(message, p.Release):
            svc = self.services.get(message.model)
            if svc is not None and svc.kind == "generative":
                svc.release(message.session)
        elif isinstance(message, p.Stop):
            self._tasks.start(self._stop(message.id))

    async def _load_models(self) -> None:
        try:
            self.services = await asyncio.to_thread(self._build_services)
        except Exception:  # noqa: BLE001 - nothing can be served: the supervisor sees the exit and restarts
            log.exception("the model services could not be built: exiting")
            os._exit(1)
        for spec in self._start.models:
            svc = self.services[spec.name]
            if spec.refused:
                svc.refuse(spec.refused)
                self._push_state()
            else:
                self._tasks.start(self._start_service(svc))

    async def _start_service(self, svc) -> None:
        await svc.start()  # ends Ready or Failed, never raises
        release_free_heap()
        # torch, ONNX Runtime and the model's objects live as long as the process (170,000 tracked objects with
        # torch and ONNX Runtime imported: a full collection took 35 ms here, a stall of every call in flight).
        gc.freeze()
        if svc.state == "Ready":
            log.info("model %s is Ready: version %s on %s", svc.name, svc.version, svc.backend_name)
        self._push_state()

    def _answered_now(self, message: p.Infer) -> bool:
        """Answer an Infer here, in the read callback that decoded it, when its tensor model runs it inline now (a
        fast model, nothing queued or running): no task and no loop turn to wait for. False: the request goes to
        _serve like any other."""
        svc = self.services.get(message.model)
        if svc is None or svc.kind != "tensor":
            return False
        try:
            answer = svc.infer_now(np.frombuffer(message.data, dtype=np.float32), message.deadline)
            if answer is None:
                return False
            reply = self._infer_done(message.id, *answer)
        except Exception as exc:  # noqa: BLE001 - every request is answered (see _failure)
            reply = self._failure(message, exc)
        self._send(reply)
        return True

    @staticmethod
    def _infer_done(request_id: int, out: np.ndarray, version: str) -> p.InferDone:
        return p.InferDone(id=request_id, data=np.ascontiguousarray(out, np.float32).tobytes(), version=version)

    @staticmethod
    def _failure(message, exc: Exception) -> p.Failed:
        """The answer to a request that raised: the engine's own refusal as it is, out of memory ends the process
        (the supervisor starts another), anything else is a bug of the engine: logged, a Failed reply."""
        if isinstance(exc, MemoryError):
            log.error("out of memory while serving a request: exiting")
            os._exit(MEMORY_EXIT)
        if isinstance(exc, ApplianceError):
            return p.Failed(id=message.id, reason=exc.reason, message=str(exc), index=getattr(exc, "index", 0),
                            kind=getattr(exc, "kind", "out_of_range"))
        log.error("request %d on model %s failed", message.id, message.model, exc_info=exc)
        return p.Failed(id=message.id, reason="failed", message="the engine failed on this request")

    async def _serve(self, message) -> None:
        try:
            svc = self.services.get(message.model)
            if svc is None:
                raise InvalidArgument("no model of that name in this worker", 0)
            if isinstance(message, p.Infer):
                flat = np.frombuffer(message.data, dtype=np.float32)
                reply = self._infer_done(message.id, *await svc.infer(flat, message.deadline))
            elif isinstance(message, p.Generate):
                progress = self._progress_sender(message.id) if message.progress else None
                r = await svc.generate(message.session, message.prompt, message.max_tokens, message.temperature,
                                       message.deadline, progress, message.finish_by or None,
                                       message.grammar or None)
                reply = p.GenerateDone(id=message.id, text=r.text, token_count=r.token_count,
                                       finish_reason=r.finish_reason, context_tokens=r.context_tokens,
                                       context_lost=bool(r.context_lost), version=r.model_version)
            elif isinstance(message, p.Choose):
                if svc.kind != "generative":
                    raise InvalidArgument("Choose needs a generative model", 0)
                c = await svc.choose(message.prompt, list(message.options), message.deadline)
                reply = p.ChooseDone(id=message.id, index=c.index, scores=list(c.scores), version=c.model_version)
            elif isinstance(message, p.Reset):
                await svc.reset(message.session)
                reply = p.Done(id=message.id)
            else:
                old = svc.path, svc.version_label
                svc.path, svc.version_label = Path(message.path), message.version_label
                try:
                    version = await svc.reload()
                except BaseException:
                    svc.path, svc.version_label = old  # the old weights keep serving, from where they came
                    raise
                finally:
                    self._push_state()
                reply = p.Done(id=message.id, value=version)
        except asyncio.CancelledError:
            return  # the serve process answered the caller already (deadline, cancel)
        except Exception as exc:  # noqa: BLE001 - every request is answered (see _failure)
            reply = self._failure(message, exc)
        finally:
            self._calls.pop(message.id, None)
        self._send(reply)

    def _progress_sender(self, request_id: int):
        """Jobs show partial text: the reply so far goes to the serve process as it grows."""
        def send(text: str, tokens: int) -> None:
            self._send(p.GenerateProgress(id=request_id, text=text, token_count=tokens))
        return send

    async def _stop(self, stop_id: int) -> None:
        for svc in self.services.values():
            try:
                await svc.stop()
            except Exception:
                log.exception("stopping model %s failed", svc.name)
        self._send(p.Done(id=stop_id))
        try:
            await asyncio.wait_for(self.channel.drain(), 5)
        except (TimeoutError, ConnectionError):
            pass  # serve is gone or not reading: it kills this process either way
        if not self._finished.done():
            self._finished.set_result(None)


async def _main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    channel = await p.Channel.open(sock, p.ToWorker)
    start = await channel.receive()
    if not isinstance(start, p.Start):
        raise SystemExit("the first message must be Start")
    configure_logging(start.log_level, start.log_format, worker=_group)
    host = WorkerHost(channel, start)
    await host.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="appliance-worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--nice", type=int, default=WORKER_NICE)  # its CPU share's level (workers/cpu_share.py)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # `systemctl stop` (and a reboot) signals every process of the unit, Ctrl-C in a terminal the whole group: the
    # serve process decides when its workers stop, after the calls in flight are answered. SIGTERM arrives blocked
    # (see supervisor._spawn) so that one sent while this process started is dropped here, not fatal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    forked_children_end_with_the_worker()
    # The loop shares the GIL with the engine thread; 5 ms switches would add to every call (see daemon.serve).
    sys.setswitchinterval(0.0005)
    global _group
    _group = args.group
    configure_logging("INFO", "text", worker=args.group)  # until Start says what the YAML asks for
    # Below the serve process in CPU priority: where CPUs are short, the OPC UA server, its audit and monitoring go
    # first, and requests wait for the model a little longer, in larger batches (bench/ua_overhead.py, 16 clients on
    # 2 vCPUs: 0.52-0.54 of bare asyncua at the serve process's own priority, 0.59-0.61 at +5); a model with a
    # smaller CPU share than another's further below.
    try:
        os.nice(args.nice)
    except OSError as exc:  # a seccomp filter without setpriority: the worker serves at serve's priority
        log.warning("the worker could not lower its CPU priority: %s", exc)
    prefer_as_oom_victim()
    try:
        asyncio.run(_main(args.fd))
    except EOFError:
        pass


if __name__ == "__main__":
    main()
    os._exit(0)  # engine threads are daemons; do not wait for an OpenMP team to wind down
