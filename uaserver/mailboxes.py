"""Mailboxes: the request / busy / done handshake for PLCs, drivers and SCADA tags that cannot call methods
(CONTRACT `Mailboxes/<name>`; the PLCopen / vision-sensor pattern).

    Objects/Appliance/Mailboxes/<name>
      Input Float[] (tensor) | Prompt String (generative)    written by the client first
      Request UInt32                                         written next: every write starts one job on Input
      Busy  Done  Error Boolean   ErrorCode UInt32   Response UInt32 (the Request whose result is shown)
      Output Float[] | Text String   ModelVersion String   [ClassIndex Int32  Label String  Confidence Float]

A task's mailbox (YAML `task:`) holds the task's inputs instead of Input / Prompt (each writable, of its own type)
and its output fields and FinishReason instead of Output / Text; a Request runs the task as its method Run would.

A new Request while Busy is refused: the write answers BadTooManyOperations, Error is true and ErrorCode says
BadTooManyOperations, the running job goes on. A failed request empties Output / Text, ModelVersion and the class
fields (ClassIndex -1, Label "", Confidence 0): nothing shown belongs to an older Request than Response. A result's fields (Output/Text, ModelVersion, the class fields,
Error, ErrorCode, Response, Done, Busy) are written in one server-side update, so a subscriber gets them in one
publish and never sees a half result.

The requests run through the same handler path as the UA methods (`request` below is a MethodHandlers-wrapped body:
role, rate limit, argument checks, the typed model interface, status codes, audit and metrics); this module knows
only the address space and the handshake.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncua import Node, Server, ua

from typing import TYPE_CHECKING

from core.audit_digest import DigestOf
from core.config import MailboxConfig
from core.task_answers import ZERO as TASK_ZERO

from .asyncua_internals import ApplianceSession, write_together
from .methods import CallContext, require_ready
from .session import current_session

from core.method_arguments import TASK_TYPES

if TYPE_CHECKING:
    from .inference import Inference
    from .methods import MethodHandlers
    from .tasks import TaskMethods

log = logging.getLogger(__name__)
V = ua.VariantType
FLOATS = (V.Float, V.Double)


@dataclass
class MailboxAnswer:
    """What a mailbox request's body answers on success."""
    model_version: str
    output: list[float] | None = None  # tensor
    text: str | None = None  # generative
    classified: Any = None  # core.services.Classified for models with labels
    fields: dict[str, Any] | None = None  # a task's: its output fields (typed values)
    finish_reason: str = ""


# request(box, session, input variant, request number) -> MailboxAnswer, or the ua.CallMethodResult of a failure
Request = Callable[[MailboxConfig, ApplianceSession, ua.Variant, int], Awaitable[Any]]
# refused(box, session, status name, request number): audit a request refused before it ran
Refused = Callable[[MailboxConfig, ApplianceSession, str, int], None]


@dataclass
class Mailbox:
    config: MailboxConfig
    kind: str  # tensor | generative
    labels: list[str] | None
    nodes: dict[str, Node] = field(default_factory=dict)
    request: int = 0  # the Request value held (the last accepted one)
    input: ua.Variant | None = None  # the Input / Prompt held (what the next request runs on)
    busy: bool = False
    running: asyncio.Task | None = None
    task: Any = None  # the TaskConfig of a task's mailbox
    inputs: dict[str, ua.Variant] = field(default_factory=dict)  # a task's inputs held
    types: dict[str, ua.VariantType] = field(default_factory=dict)  # a task's inputs' and fields' types

    @property
    def input_name(self) -> str:
        return "Input" if self.kind == "tensor" else "Prompt"

    @property
    def writable(self) -> tuple[str, ...]:
        return (*(self.task.inputs if self.task is not None else (self.input_name,)), "Request")


class Mailboxes:
    def __init__(self, server: Server, ns: int, configs: dict[str, MailboxConfig], kinds: dict[str, str],
                 labels: dict[str, list[str]], request: Request, refused: Refused, tasks: dict | None = None):
        """tasks: mailbox name -> the TaskConfig it runs (a task's mailbox)."""
        self.server = server
        self.ns = ns
        tasks = tasks or {}
        self.boxes = {name: Mailbox(cfg, kinds[cfg.model], labels.get(cfg.model), task=tasks.get(name))
                      for name, cfg in configs.items()}
        for box in self.boxes.values():
            if box.task is not None:
                box.types = {**{n: TASK_TYPES[c.type] for n, c in box.task.inputs.items()},
                             **{n: TASK_TYPES[f.type] for n, f in box.task.output.items()}}
                box.inputs = {n: ua.Variant(TASK_ZERO[c.type], TASK_TYPES[c.type])
                              for n, c in box.task.inputs.items()}
        self._request = request
        self._refused = refused
        self._by_node: dict[ua.NodeId, tuple[Mailbox, str]] = {}

    @classmethod
    def serving(cls, server: Server, ns: int, configs: dict[str, MailboxConfig], inference: "Inference",
                handlers: "MethodHandlers", task_methods: "TaskMethods | None" = None) -> "Mailboxes":
        """Mailboxes whose requests run through the method handlers like a call (role, rate limit, argument checks,
        fallback, status codes, audit and metrics as method `Mailbox`): the answer is a MailboxAnswer, or the
        CallMethodResult carrying the status code the call would have answered."""
        services = inference.services
        callbacks = {}
        tasks = {}
        for name, box in configs.items():
            svc = services[box.model]
            if box.task is not None:
                tasks[name] = task = task_methods.tasks[box.model][box.task]
                callbacks[name] = handlers.wrap("Mailbox", box.model, "operator", len(task.inputs) + 2,
                                                _task_body(task_methods, svc, task, box))
                continue
            body = _infer_body(inference, svc, box) if svc.kind == "tensor" else _generate_body(inference, svc, box)
            callbacks[name] = handlers.wrap("Mailbox", box.model, "operator", 3, body)

        async def request(box: MailboxConfig, session, value, number: int):
            values = value if isinstance(value, list) else [value]  # a task's mailbox: its inputs, in order
            return await callbacks[box.name](ua.NodeId(f"Appliance/Mailboxes/{box.name}", ns), *values,
                                             ua.Variant(box.name, V.String), ua.Variant(number, V.UInt32))

        def refused(box: MailboxConfig, session, status: str, number: int) -> None:
            handlers.account(CallContext(session=session, method="Mailbox", model=box.model,
                                         detail=f"mailbox {box.name} Request {number}"), status)
        return cls(server, ns, configs, {name: svc.kind for name, svc in services.items()},
                   {name: c.labels for name, c in inference.alarms.classifiers.items()}, request, refused, tasks)

    async def build(self, root: Node) -> None:
        """Objects/Appliance/Mailboxes/<name> and its variables (only when the YAML names mailboxes)."""
        if not self.boxes:
            return
        ns = self.ns
        folder = await root.add_object(ua.NodeId("Appliance/Mailboxes", ns), ua.QualifiedName("Mailboxes", ns))
        for name, box in self.boxes.items():
            path = f"Appliance/Mailboxes/{name}"
            obj = await folder.add_object(ua.NodeId(path, ns), ua.QualifiedName(name, ns))
            if box.task is not None:
                await self._build_task_box(box, obj, path)
                continue
            fields = [(box.input_name, [] if box.kind == "tensor" else "", V.Float if box.kind == "tensor"
                       else V.String), ("Request", 0, V.UInt32), ("Busy", False, V.Boolean),
                      ("Done", False, V.Boolean), ("Error", False, V.Boolean), ("ErrorCode", 0, V.UInt32),
                      ("Response", 0, V.UInt32),
                      ("Output", [], V.Float) if box.kind == "tensor" else ("Text", "", V.String),
                      ("ModelVersion", "", V.String)]
            if box.labels:
                fields += [("ClassIndex", -1, V.Int32), ("Label", "", V.String), ("Confidence", 0.0, V.Float)]
            for key, value, vtype in fields:
                node = await obj.add_variable(ua.NodeId(f"{path}/{key}", ns), ua.QualifiedName(key, ns),
                                              ua.Variant(value, vtype))
                if key in (box.input_name, "Request"):
                    await node.set_writable()  # who may write is checked per write (on_write)
                    if vtype == V.Float:  # a Float[] input: say so, so clients write the right type
                        await node.write_value_rank(1)
                        await node.write_array_dimensions([0])
                box.nodes[key] = node
                self._by_node[node.nodeid] = (box, key)

    async def _build_task_box(self, box: Mailbox, obj: Node, path: str) -> None:
        ns, task = self.ns, box.task
        fields = [*((n, TASK_ZERO[c.type], TASK_TYPES[c.type]) for n, c in task.inputs.items()),
                  ("Request", 0, V.UInt32), ("Busy", False, V.Boolean), ("Done", False, V.Boolean),
                  ("Error", False, V.Boolean), ("ErrorCode", 0, V.UInt32), ("Response", 0, V.UInt32),
                  *((n, TASK_ZERO[f.type], TASK_TYPES[f.type]) for n, f in task.output.items()),
                  ("FinishReason", "", V.String), ("ModelVersion", "", V.String)]
        for key, value, vtype in fields:
            node = await obj.add_variable(ua.NodeId(f"{path}/{key}", ns), ua.QualifiedName(key, ns),
                                          ua.Variant(value, vtype), datatype=ua.NodeId(vtype.value))
            if key in box.writable:
                await node.set_writable()  # who may write is checked per write (on_write)
            box.nodes[key] = node
            self._by_node[node.nodeid] = (box, key)

    # ---- writes from clients ----

    async def on_write(self, session: ApplianceSession, value: ua.WriteValue) -> ua.StatusCode | None:
        """The status of a client's write to a mailbox node; None when the node is no mailbox's."""
        hit = self._by_node.get(value.NodeId)
        if hit is None:
            return None
        box, key = hit
        if key not in box.writable or value.AttributeId != ua.AttributeIds.Value:
            return _status("BadNotWritable")
        variant = value.Value.Value if value.Value is not None else None
        writer_ok = box.config.may_write(session.role, session.identity)
        if key == "Request":
            number = variant.Value if isinstance(variant, ua.Variant) and variant.VariantType == V.UInt32 and \
                not variant.is_array else None
            if not writer_ok:
                self._refused(box.config, session, "BadUserAccessDenied", number or 0)
                return _status("BadUserAccessDenied")
            if number is None:
                return _status("BadTypeMismatch")
            return await self._new_request(box, session, int(number))
        if not writer_ok:
            return _status("BadUserAccessDenied")
        if box.task is not None:  # one of a task's inputs: of its declared type (its bounds: at the Request)
            wanted = box.types[key]
            if not (isinstance(variant, ua.Variant) and variant.VariantType == wanted and not variant.is_array
                    and not isinstance(variant.Value, list)):
                return _status("BadTypeMismatch")
            box.inputs[key] = variant
            await write_together(self.server, [(box.nodes[key].nodeid, variant)])
            return _status("Good")
        if box.kind == "tensor":
            if not (isinstance(variant, ua.Variant) and variant.VariantType in FLOATS
                    and isinstance(variant.Value, list)):
                return _status("BadTypeMismatch")
            variant = ua.Variant([float(v) for v in variant.Value], V.Float)
        elif not (isinstance(variant, ua.Variant) and variant.VariantType == V.String and not variant.is_array):
            return _status("BadTypeMismatch")
        box.input = variant
        await write_together(self.server, [(box.nodes[key].nodeid, variant)])
        return _status("Good")

    async def _new_request(self, box: Mailbox, session: ApplianceSession, number: int) -> ua.StatusCode:
        # Every write starts a job, the value held too: a PLC that rebooted restarts its counter and meets its old
        # numbers again. Done turns false (Busy true) before the write is answered, so the PLC never takes the
        # held result for the answer to its new request.
        if box.busy:
            self._refused(box.config, session, "BadTooManyOperations", number)
            await self._set(box, Error=True, ErrorCode=ua.StatusCodes.BadTooManyOperations)
            return _status("BadTooManyOperations")
        box.request, box.busy = number, True
        if box.task is not None:
            held = [box.inputs[n] for n in box.task.inputs]
        else:
            held = box.input if box.input is not None else ua.Variant([] if box.kind == "tensor" else "",
                                                                         _TYPES[box.input_name])
        await self._set(box, Request=number, Busy=True, Done=False, Error=False, ErrorCode=0)
        box.running = asyncio.get_running_loop().create_task(self._run(box, session, held, number))
        return _status("Good")

    async def _run(self, box: Mailbox, session: ApplianceSession, value: ua.Variant, number: int) -> None:
        token = current_session.set(session)
        try:
            answer = await self._request(box.config, session, value, number)
        except Exception:  # noqa: BLE001 - the wrapped body answers every failure; a last line, logged, Busy ends
            log.exception("mailbox %s request %d failed", box.config.name, number)
            answer = ua.CallMethodResult(StatusCode=ua.StatusCode(ua.StatusCodes.BadInternalError))
        finally:
            current_session.reset(token)
        try:
            if box.task is not None:
                fields = self._task_fields(box, answer if isinstance(answer, MailboxAnswer) else None)
                if isinstance(answer, MailboxAnswer):
                    fields.update(Error=False, ErrorCode=0, Response=number, Done=True, Busy=False)
                else:
                    fields.update(Error=True, ErrorCode=answer.StatusCode.value, Response=number, Done=False,
                                  Busy=False)
            elif isinstance(answer, MailboxAnswer):
                fields: dict[str, Any] = {"ModelVersion": answer.model_version}
                if box.kind == "tensor":
                    fields["Output"] = answer.output
                else:
                    fields["Text"] = answer.text
                if box.labels and answer.classified is not None:
                    c = answer.classified
                    fields.update(ClassIndex=c.class_index[-1], Label=c.label[-1], Confidence=c.confidence[-1])
                fields.update(Error=False, ErrorCode=0, Response=number, Done=True, Busy=False)
            else:  # nothing shown may belong to an older Request than Response: the last result is emptied
                fields = {"ModelVersion": "", ("Output" if box.kind == "tensor" else "Text"): _EMPTY[box.kind]}
                if box.labels:
                    fields.update(ClassIndex=-1, Label="", Confidence=0.0)
                fields.update(Error=True, ErrorCode=answer.StatusCode.value, Response=number, Done=False, Busy=False)
            box.busy = False
            await self._set(box, **fields)
        except Exception:  # noqa: BLE001 - the request task's last line: logged, not lost with the task; Busy ends
            box.busy = False
            log.exception("publishing mailbox %s's result failed", box.config.name)

    @staticmethod
    def _task_fields(box: Mailbox, answer: MailboxAnswer | None) -> dict[str, Any]:
        """A task's output variables: the answer's, or every field emptied (a failed request shows nothing)."""
        out = {n: (answer.fields[n] if answer is not None else TASK_ZERO[f.type]) for n, f in box.task.output.items()}
        out.update(FinishReason=answer.finish_reason if answer is not None else "",
                   ModelVersion=answer.model_version if answer is not None else "")
        return out

    async def _set(self, box: Mailbox, **values: Any) -> None:
        """Write the fields in one server-side update (one publish for every subscriber)."""
        items = []
        for key, value in values.items():
            node = box.nodes[key]
            items.append((node.nodeid, ua.Variant(value, box.types.get(key) or _TYPES[key])))
        await write_together(self.server, items)

    async def stop(self) -> None:
        tasks = [b.running for b in self.boxes.values() if b.running is not None and not b.running.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


_TYPES = {"FinishReason": V.String, "Input": V.Float, "Prompt": V.String, "Request": V.UInt32, "Busy": V.Boolean,
          "Done": V.Boolean,
          "Error": V.Boolean, "ErrorCode": V.UInt32, "Response": V.UInt32, "Output": V.Float, "Text": V.String,
          "ModelVersion": V.String, "ClassIndex": V.Int32, "Label": V.String, "Confidence": V.Float}


_EMPTY = {"tensor": [], "generative": ""}  # Output / Text of a failed request


def _infer_body(inference: "Inference", svc, box: MailboxConfig):
    classifier = inference.alarms.classifiers.get(svc.name)
    source = classifier.source_of(mailbox=box.name) if classifier is not None else ""

    async def body(ctx: CallContext, args):
        ctx.detail = f"mailbox {box.name} Request {args[2].Value}"
        r = await inference.infer(svc, ctx, args[0])
        classified = await inference.alarms.classified(svc.name, r.output, source) if classifier else None
        return MailboxAnswer(r.model_version, output=r.output.tolist(), classified=classified)
    return body


def _generate_body(inference: "Inference", svc, box: MailboxConfig):
    key = f"mailbox:{box.name}"  # one turn per request: the slot is given back after each

    async def body(ctx: CallContext, args):
        ctx.detail = f"mailbox {box.name} Request {args[2].Value}"
        prompt = inference.handlers.text(args[0], 0)
        ctx.input_digest = DigestOf(prompt)
        model = inference.governance.answering(svc, ctx)
        require_ready(model)
        try:
            r = await model.generate(key, prompt, box.effective_max_tokens, box.effective_temperature,
                                     inference.handlers.deadline())
        finally:
            model.release(key)
        ctx.version = r.model_version
        ctx.output_digest = DigestOf(r.text)
        return MailboxAnswer(r.model_version, text=r.text)
    return body


def _task_body(task_methods: "TaskMethods", svc, task, box: MailboxConfig):
    n = len(task.inputs)

    async def body(ctx: CallContext, args):
        ctx.detail = f"mailbox {box.name} Request {args[n + 1].Value}"
        model, prompt = task_methods.prepare(svc, task, ctx, args[:n])
        fields, r = await task_methods.answer(svc.name, model, task, prompt, ctx,
                                              task_methods.inference.handlers.deadline())
        return MailboxAnswer(r.model_version, fields=fields, finish_reason=r.finish_reason)
    return body


def _status(name: str) -> ua.StatusCode:
    return ua.StatusCode(getattr(ua.StatusCodes, name))
