"""Mailboxes over a real server: a client that only writes and subscribes runs 100 requests and every result it
sees is whole (Output, Response, Done and Busy in one publish; Response always the Request whose result it is);
a Request while Busy is refused with BadTooManyOperations; a monitor cannot write; the class fields of a classifier;
a generative mailbox; bad inputs answer the call's code in ErrorCode; every request is audited."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
from asyncua import ua

from core.config import MailboxConfig
from core.password_hash import hash_password
from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import run, session

V = ua.VariantType
NS = "urn:opcua-inference-appliance"
LABELS = ["a", "b", "c", "d"]
REPLY = list(range(40, 60))
PASSWORD = "correct horse battery"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    d = tmp_path_factory.mktemp("mailboxes")
    make_model_dir(d / "chat", scripted=REPLY)
    models = {"cls": {"kind": "tensor", "path": str(affine_model(d / "cls.onnx")), "labels": LABELS,
                      "alarm_classes": ["d"], "alarm_confidence": 0.5},
              "chat": {"kind": "generative", "path": str(d / "chat")}}
    mailboxes = {"line3": {"model": "cls"}, "engineers": {"model": "cls", "writers": ["engineer"]},
                 "chat": {"model": "chat", "max_tokens": 8}, "by-name": {"model": "cls", "writers": ["user:line3"]}}
    users = [{"name": "line3", "role": "operator", "password_hash": hash_password(PASSWORD)},
             {"name": "line4", "role": "operator", "password_hash": hash_password(PASSWORD)}]
    a = RunningAppliance(d / "state", models, {"mailboxes": mailboxes, "users": users,
                                               "engine": {"max_seq_len": 256, "max_new_tokens": 64}})
    a.operator, a.monitor = a.issue("plc1", "operator"), a.issue("hmi1", "monitor")
    a.engineer = a.issue("eng1", "engineer")
    yield a
    a.stop()


async def box_nodes(client, box: str) -> dict:
    ns = await client.get_namespace_index(NS)
    obj = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Mailboxes", f"{ns}:{box}"])
    nodes = {}
    for child in await obj.get_children():
        nodes[(await child.read_browse_name()).Name] = child
    return nodes


async def write(client, *items) -> list[str]:
    """One Write service call with several values: [(node, Variant), ...] -> the status names."""
    params = ua.WriteParameters()
    for node, variant in items:
        wv = ua.WriteValue()
        wv.NodeId = node.nodeid
        wv.AttributeId = ua.AttributeIds.Value
        wv.Value = ua.DataValue(variant)
        params.NodesToWrite.append(wv)
    return [s.name for s in await client.uaclient.write(params)]


class Recorder:
    """Groups the data changes by publish (one DataChangeNotification per NotificationMessage)."""

    def __init__(self, names: dict):
        self.names = names  # client handle -> BrowseName
        self.groups: list[dict] = []
        self.seen: list[tuple[str, object]] = []  # every value, also those a later one in the same publish replaced
        self.state: dict = {}
        self.changed = asyncio.Event()

    def install(self, sub) -> None:
        original = sub._explode_datachange

        def explode(datachange):
            handles = {h: data.node.nodeid for h, data in sub._monitored_items.items()}
            items = [(self.names[handles[item.ClientHandle]], item.Value.Value.Value)
                     for item in datachange.MonitoredItems if item.ClientHandle in handles]
            group = dict(items)
            self.seen.extend(items)
            self.groups.append(group)
            self.state.update(group)
            self.changed.set()
            return original(datachange)
        sub._explode_datachange = explode

    async def until(self, predicate, timeout: float = 10.0):
        async def wait():
            while not predicate(self.state):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout)
        return dict(self.state)


class Quiet:
    def datachange_notification(self, node, val, data):
        pass


async def subscribe(client, nodes: dict, interval_ms: float = 10) -> Recorder:
    sub = await client.create_subscription(interval_ms, Quiet())
    watched = [n for k, n in nodes.items() if k not in ("Input", "Prompt")]
    rec = Recorder({n.nodeid: k for k, n in nodes.items()})
    rec.install(sub)
    await sub.subscribe_data_change(watched, queuesize=10)  # every transition, not only the latest value
    await rec.until(lambda s: "Busy" in s and "Response" in s)  # the initial values
    return rec


def test_a_write_and_subscribe_client_runs_100_requests_and_sees_whole_results(app):
    async def go():
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "line3")
            rec = await subscribe(c, nodes)
            expected = {}
            first = rec.state["Response"] + 1
            for i in range(first, first + 100):
                x = [float(i % 7), float(i % 5), 0.5, float(i % 3)]
                expected[i] = [2 * v + 1 for v in x]
                assert await write(c, (nodes["Input"], ua.Variant(x, V.Float))) == ["Good"]
                assert await write(c, (nodes["Request"], ua.Variant(i, V.UInt32))) == ["Good"]
                s = await rec.until(lambda s, i=i: s.get("Response") == i and s.get("Busy") is False)
                assert s["Done"] is True and s["Error"] is False and s["ErrorCode"] == 0
                assert np.allclose(s["Output"], expected[i]) and s["ModelVersion"]
                k = int(np.argmax(expected[i]))
                assert s["ClassIndex"] == k and s["Label"] == LABELS[k]
                assert s["Confidence"] == pytest.approx(max(expected[i]))
            # every publish showed a whole result: never a Done with another request's Output or Response
            state: dict = {}
            for group in rec.groups:
                if "Response" in group or "Output" in group or "Done" in group:
                    assert {"Response", "Output"} <= set(group) or group.get("Done") is False, group
                state.update(group)
                if state.get("Done") and state.get("Response") in expected:
                    assert np.allclose(state["Output"], expected[state["Response"]])
    run(go())


def test_a_request_while_busy_is_refused_and_the_running_job_goes_on(app):
    async def go():
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "line3")
            rec = await subscribe(c, nodes)
            n = rec.state["Response"] + 1
            # Request n starts a job; Request n+1 arrives in the same Write, while n is Busy
            statuses = await write(c, (nodes["Input"], ua.Variant([1.0, 2.0, 3.0, 4.0], V.Float)),
                                   (nodes["Request"], ua.Variant(n, V.UInt32)),
                                   (nodes["Request"], ua.Variant(n + 1, V.UInt32)))
            assert statuses == ["Good", "Good", "BadTooManyOperations"]
            s = await rec.until(lambda s: s.get("Response") == n and s.get("Busy") is False)
            # the refusal showed (Error true, ErrorCode BadTooManyOperations) while n ran
            assert ("Error", True) in rec.seen
            assert ("ErrorCode", ua.StatusCodes.BadTooManyOperations) in rec.seen
            assert s["Done"] is True and np.allclose(s["Output"], [3, 5, 7, 9])  # the running job finished
            assert await nodes["Request"].read_value() == n  # the refused value was not taken
            # n + 1 now runs
            assert await write(c, (nodes["Request"], ua.Variant(n + 1, V.UInt32))) == ["Good"]
            s = await rec.until(lambda s: s.get("Response") == n + 1 and s.get("Busy") is False)
            assert s["Done"] is True and s["Error"] is False
    run(go())


def test_a_plc_that_rebooted_restarts_its_counter_and_never_reads_an_older_result(app):
    """Every Write of Request starts a job, the value held too: a PLC writes 1, 2, 3, reboots (a new session, its
    counter from 1 again) and writes 1, 2, 3 with new inputs. Each write turns Done false before it is answered, and
    whenever the PLC then reads Done true with its number in Response, Output is the result of its new input."""
    def x_of(i: int, boot: int) -> list[float]:
        return [float(i), float(boot), 0.25 * i, float(10 * boot + i)]

    async def handshake(c, nodes, rec, i: int, boot: int) -> None:
        mark, was_done = len(rec.seen), rec.state.get("Done")
        statuses = await write(c, (nodes["Input"], ua.Variant(x_of(i, boot), V.Float)),
                               (nodes["Request"], ua.Variant(i, V.UInt32)))
        assert statuses == ["Good", "Good"]
        expected = [2 * v + 1 for v in x_of(i, boot)]
        # as a PLC polls after its write: Done true with its Response must be its own result, from the first read
        for _ in range(500):
            done, response, output = [await nodes[k].read_value() for k in ("Done", "Response", "Output")]
            if done and response == i:
                assert np.allclose(output, expected), (
                    f"boot {boot}, request {i}: Done with Response {i} showed {output}, not the result of {expected}")
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"boot {boot}, request {i} was never answered")
        # the subscriber saw the write take Done back (and Busy up) before the result came; waited for after the write
        # (a PLC that writes the number it held sees the same final state before and after: Response i, Done, idle)
        try:
            await rec.until(lambda s: ("Busy", True) in rec.seen[mark:] and s.get("Response") == i
                            and s.get("Done") is True and s.get("Busy") is False)
        except asyncio.TimeoutError:
            pass  # said by the assertions, with what was seen
        assert ("Busy", True) in rec.seen[mark:], rec.seen[mark:]
        assert not was_done or ("Done", False) in rec.seen[mark:], rec.seen[mark:]

    async def go():
        for boot in (1, 2):  # boot 2: the same PLC after a restart, a new session, its counter from 1 again
            async with session(app, *app.operator) as c:
                nodes = await box_nodes(c, "line3")
                rec = await subscribe(c, nodes)
                for i in (1, 2, 3):
                    await handshake(c, nodes, rec, i, boot)
        async with session(app, *app.operator) as c:  # a third boot that sends only 3, the number held
            nodes = await box_nodes(c, "line3")
            rec = await subscribe(c, nodes)
            await handshake(c, nodes, rec, 3, 3)
    run(go())


def test_who_may_write(app):
    async def go():
        async with session(app, *app.monitor) as c:
            nodes = await box_nodes(c, "line3")
            assert await write(c, (nodes["Input"], ua.Variant([1.0] * 4, V.Float)),
                               (nodes["Request"], ua.Variant(999, V.UInt32))) == ["BadUserAccessDenied"] * 2
            assert await write(c, (nodes["Done"], ua.Variant(True, V.Boolean))) == ["BadNotWritable"]
            assert await nodes["Busy"].read_value() is False  # but a monitor reads
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "engineers")  # writers: [engineer]
            assert await write(c, (nodes["Request"], ua.Variant(1, V.UInt32))) == ["BadUserAccessDenied"]
            line3 = await box_nodes(c, "line3")
            assert await write(c, (line3["Input"], ua.Variant("text", V.String)),
                               (line3["Request"], ua.Variant(-1, V.Int32))) == ["BadTypeMismatch"] * 2
            ns = await c.get_namespace_index(NS)
            state = await c.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:State"])
            assert await write(c, (state, ua.Variant("Fault", V.String))) == ["BadUserAccessDenied"]
        async with session(app, *app.engineer) as c:
            nodes = await box_nodes(c, "engineers")
            rec = await subscribe(c, nodes)
            assert await write(c, (nodes["Input"], ua.Variant([0.0, 0.0, 1.0, 0.0], V.Float)),
                               (nodes["Request"], ua.Variant(7, V.UInt32))) == ["Good", "Good"]
            s = await rec.until(lambda s: s.get("Response") == 7 and s.get("Busy") is False)
            assert s["Done"] is True and s["Label"] == "c"
    run(go())


def test_writers_by_identity(app):
    async def go():
        for user, expected in (("line3", "Good"), ("line4", "BadUserAccessDenied")):
            async with session(app, *app.operator, username=user, password=PASSWORD) as c:
                nodes = await box_nodes(c, "by-name")
                assert await write(c, (nodes["Input"], ua.Variant([1.0] * 4, V.Float))) == [expected]
        async with session(app, *app.operator) as c:  # the same PLC certificate, but as X509 user: not named
            nodes = await box_nodes(c, "by-name")
            assert await write(c, (nodes["Request"], ua.Variant(1, V.UInt32))) == ["BadUserAccessDenied"]
    run(go())


def test_a_bad_input_answers_the_calls_code_in_error_code_and_is_audited(app):
    async def go():
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "line3")
            rec = await subscribe(c, nodes)
            n = rec.state["Response"] + 1
            assert await write(c, (nodes["Input"], ua.Variant([1.0, 2.0, 3.0], V.Float)),  # 3 of 4 floats
                               (nodes["Request"], ua.Variant(n, V.UInt32))) == ["Good", "Good"]
            s = await rec.until(lambda s: s.get("Response") == n and s.get("Busy") is False)
            assert s["Error"] is True and s["Done"] is False
            assert s["ErrorCode"] == ua.StatusCodes.BadInvalidArgument
    run(go())
    app.run(asyncio.sleep(0.3))
    app.app.audit.flush() if hasattr(app.app.audit, "flush") else None
    records = [json.loads(line) for line in (app.state_dir / "audit" / "audit.jsonl").read_text().splitlines()]
    mailbox = [r for r in records if r.get("action") == "Mailbox"]
    assert any(r["status"] == "BadInvalidArgument" and "mailbox line3" in r.get("detail", "") for r in mailbox)
    assert any(r["status"] == "BadTooManyOperations" for r in mailbox)
    assert any(r["status"] == "BadUserAccessDenied" for r in mailbox)
    assert sum(r["status"] == "Good" for r in mailbox) >= 100


def test_a_generative_mailbox(app):
    async def go():
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "chat")
            assert "Text" in nodes and "Prompt" in nodes and "Output" not in nodes and "ClassIndex" not in nodes
            rec = await subscribe(c, nodes)
            texts = []
            for n in (1, 2):
                assert await write(c, (nodes["Prompt"], ua.Variant("Hello", V.String)),
                                   (nodes["Request"], ua.Variant(n, V.UInt32))) == ["Good", "Good"]
                s = await rec.until(lambda s, n=n: s.get("Response") == n and s.get("Busy") is False, 60)
                assert s["Done"] is True and s["Error"] is False and s["Text"] and s["ModelVersion"]
                texts.append(s["Text"])
            assert texts[0] == texts[1]  # one turn per request: the second does not continue the first
    run(go())


def test_writers_rule():
    box = MailboxConfig(model="m", writers=["operator", "x509:" + "ab" * 20], name="b")
    assert box.may_write("operator", "user:x") and box.may_write("engineer", "user:x")
    assert not box.may_write("monitor", "x509:" + "ab" * 20)  # a monitor never writes, even when named
    only = MailboxConfig(model="m", writers=["engineer", "user:line3"], name="b")
    assert only.may_write("operator", "user:line3") and only.may_write("engineer", "user:y")
    assert not only.may_write("operator", "user:other")


def test_a_zero_publishing_interval_is_revised_so_results_stay_in_one_publish(app):
    """asyncua would publish every data change at once at interval 0, splitting a result over publishes."""
    async def go():
        async with session(app, *app.monitor) as c:
            for requested, revised in ((0.0, 1.0), (-5.0, 1.0), (0.5, 1.0), (20.0, 20.0)):
                params = ua.CreateSubscriptionParameters()
                params.RequestedPublishingInterval = requested
                params.RequestedLifetimeCount, params.RequestedMaxKeepAliveCount = 3000, 100
                params.PublishingEnabled = True
                result = await c.uaclient.create_subscription(params, lambda *a: None)
                assert result.RevisedPublishingInterval == revised
                await c.uaclient.delete_subscriptions([result.SubscriptionId])
    run(go())


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_node_opcua_peer_runs_100_requests_through_a_mailbox(app):
    root = Path(__file__).resolve().parent
    assert (root / "node" / "node_modules" / "node-opcua-client").exists(), "run `bash scripts/setup.sh --test`"
    cert_der, key = app.operator
    uri = f"urn:{socket.gethostname()}:appliance:client:plc1"
    proc = subprocess.run(["node", str(root / "node" / "mailbox.js"), app.endpoint, str(cert_der.with_suffix(".pem")),
                           str(key), uri, str(app.state_dir / "node-pki"), "line3", "100"],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(lines[-1])
    assert result["requests"] == 100 and result["whole"] == 100, result


def test_a_failed_request_empties_the_older_result_in_the_same_publish(app):
    """After a good result, a failed Request shows no field of the older result: Output, ModelVersion and the class
    fields are emptied in the publish that shows its Response (Text for a generative mailbox)."""
    async def go():
        async with session(app, *app.operator) as c:
            nodes = await box_nodes(c, "line3")
            rec = await subscribe(c, nodes)
            n = rec.state["Response"] + 1
            assert await write(c, (nodes["Input"], ua.Variant([0.1, 0.2, 0.3, 0.4], V.Float)),
                               (nodes["Request"], ua.Variant(n, V.UInt32))) == ["Good", "Good"]
            s = await rec.until(lambda s: s.get("Response") == n and s.get("Busy") is False)
            assert s["Done"] is True and len(s["Output"]) == 4 and s["ClassIndex"] >= 0 and s["Label"]
            assert await write(c, (nodes["Input"], ua.Variant([1.0, 2.0, 3.0], V.Float)),  # 3 of 4 floats
                               (nodes["Request"], ua.Variant(n + 1, V.UInt32))) == ["Good", "Good"]
            await rec.until(lambda s: s.get("Response") == n + 1 and s.get("Busy") is False)
            failed = next(g for g in rec.groups if g.get("Response") == n + 1)  # the publish that shows it
            assert failed["Error"] is True and failed["ErrorCode"] == ua.StatusCodes.BadInvalidArgument
            assert failed["Output"] == [] and failed["ModelVersion"] == ""
            assert (failed["ClassIndex"], failed["Label"], failed["Confidence"]) == (-1, "", 0.0)

            chat = await box_nodes(c, "chat")
            rec = await subscribe(c, chat)
            m = rec.state["Response"] + 1
            assert await write(c, (chat["Prompt"], ua.Variant("Hello", V.String)),
                               (chat["Request"], ua.Variant(m, V.UInt32))) == ["Good", "Good"]
            s = await rec.until(lambda s: s.get("Response") == m and s.get("Busy") is False, 60)
            assert s["Text"]
            assert await write(c, (chat["Prompt"], ua.Variant("bell \x07", V.String)),  # a control character
                               (chat["Request"], ua.Variant(m + 1, V.UInt32))) == ["Good", "Good"]
            await rec.until(lambda s: s.get("Response") == m + 1 and s.get("Busy") is False, 60)
            failed = next(g for g in rec.groups if g.get("Response") == m + 1)
            assert failed["Error"] is True and failed["Text"] == "" and failed["ModelVersion"] == ""
    run(go())
