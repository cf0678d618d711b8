"""Typed tasks and Choose over a real server, as users meet them: a PLC-profile client (user name, Basic256Sha256
SignAndEncrypt, 8 KiB buffers, a session per call) calls a task and reads typed outputs that validate; the type's
method with the task as ObjectId; node-opcua by the type's method; jobs (StartTask / GetTaskResult); an HMI driving the
task's mailbox; bad input answered with the contract's codes; an answer that cannot be completed within the task's
max_tokens answered BadNoDataAvailable; Choose's limits and a Choose whose Index, Option and Scores agree."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from asyncua import ua

from harness import RunningAppliance
from plc_client import s7_call
from uaclient import arg_statuses, call, run, session, status_name

pytest.importorskip("transformers")
from tiny_llm import make_model_dir  # noqa: E402

V = ua.VariantType
ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "line3-secret-pw"
TRIAGE = {
    "prompt": "Alarm {AlarmText} on line {Line}; critical {Critical}",
    "inputs": {"AlarmText": {"type": "String", "max_length": 40}, "Line": {"type": "Int32", "minimum": 1,
                                                                          "maximum": 9},
               "Critical": {"type": "Boolean"}},
    "output": {"Severity": {"type": "enum", "values": ["low", "medium", "high"]}, "StopLine": {"type": "Boolean"},
               "Code": {"type": "Int32", "minimum": 0, "maximum": 99},
               "Note": {"type": "String", "max_length": 4, "required": False}},
    "max_tokens": 96,
}
# two free choices at least (two Booleans), one token allowed: never complete
TIGHT = {"prompt": "Check {AlarmText}", "inputs": {"AlarmText": {"type": "String", "max_length": 40}},
         "output": {"First": {"type": "Boolean"}, "Second": {"type": "Boolean"},
                    "Level": {"type": "enum", "values": ["low", "high"]}},
         "max_tokens": 1}
RUN_OBJECT = "Appliance/Models/chat/Tasks/triage"
TYPE_RUN = "Types/chat.triage.TaskType/Run"


def triage_args(text="pressure high", line=3, critical=True):
    return [ua.Variant(text, V.String), ua.Variant(line, V.Int32), ua.Variant(critical, V.Boolean)]


def check_answer(r):
    """The contract: a Good answer has every required field, typed and within its bounds."""
    assert status_name(r) == "Good", (status_name(r), getattr(r, "status_text", ""))
    names = ["Severity", "StopLine", "Code", "Note", "FinishReason", "ModelVersion"]
    out = dict(zip(names, r.OutputArguments))
    assert len(r.OutputArguments) == 6
    assert [v.VariantType for v in r.OutputArguments] == [V.String, V.Boolean, V.Int32, V.String, V.String, V.String]
    assert out["Severity"].Value in ("low", "medium", "high")
    assert isinstance(out["StopLine"].Value, bool)
    assert 0 <= out["Code"].Value <= 99
    assert len(out["Note"].Value) <= 4
    assert out["FinishReason"].Value == "stop"
    assert out["ModelVersion"].Value
    return {k: v.Value for k, v in out.items()}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("ua_tasks")
    make_model_dir(d / "model", seed=3)
    from core.password_hash import hash_password
    models = {"chat": {"kind": "generative", "path": str(d / "model"), "max_text_chars": 400,
                       "tasks": {"triage": TRIAGE, "tight": TIGHT}}}
    extra = {"engine": {"kv_slots": 4, "max_seq_len": 256, "max_new_tokens": 96, "prefill_chunk": 32},
             "mailboxes": {"triage-hmi": {"model": "chat", "task": "triage"}},
             "users": [{"name": "line3", "role": "operator", "password_hash": hash_password(PASSWORD)}]}
    a = RunningAppliance(d / "state", models, extra)
    a.operator = a.issue("plc1", "operator")
    a.monitor = a.issue("viewer", "monitor")
    yield a
    a.stop()


def test_plc_profile_client_gets_typed_fields_that_validate(app):
    """A session per call, user name, 8 KiB buffers: tens of calls, every answer valid; the same call by the task
    type's method NodeId with the task object as ObjectId."""
    cert, key = app.operator

    async def go():
        answers = []
        for i in range(12):
            method = TYPE_RUN if i % 2 else f"{RUN_OBJECT}/Run"
            r = await s7_call(app.endpoint, cert, key, "line3", PASSWORD, RUN_OBJECT, method,
                              triage_args(f"alarm {i}: level low", 1 + i % 9, i % 3 == 0))
            answers.append(check_answer(r))
        return answers
    answers = run(go(), timeout=600)
    # greedy and one-shot: the same inputs give the same answer, whichever NodeId was called
    again = run(s7_call(app.endpoint, cert, key, "line3", PASSWORD, RUN_OBJECT, TYPE_RUN,
                        triage_args("alarm 0: level low", 1, True)))
    assert check_answer(again) == answers[0]


def test_declared_argument_types(app):
    """Run's arguments carry the real data types (what UaExpert, node-opcua and an S7's OPC_UA_MethodCall read)."""
    async def go():
        async with session(app, *app.monitor) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            out = {}
            for path in (f"{RUN_OBJECT}/Run", TYPE_RUN):
                for side in ("InputArguments", "OutputArguments"):
                    node = c.get_node(ua.NodeId(f"{path}/{side}", ns))
                    out[(path, side)] = [(a.Name, a.DataType.Identifier, a.ValueRank, list(a.ArrayDimensions or []))
                                         for a in await node.read_value()]
            choose = [(a.Name, a.DataType.Identifier, a.ValueRank, list(a.ArrayDimensions or []))
                      for a in await c.get_node(ua.NodeId("Types/GenerativeModelType/Choose/InputArguments", ns))
                      .read_value()]
            type_def = await c.get_node(ua.NodeId(RUN_OBJECT, ns)).read_type_definition()
            return out, choose, type_def, ns
    out, choose, type_def, ns = run(go())
    s, b, i32 = ua.ObjectIds.String, ua.ObjectIds.Boolean, ua.ObjectIds.Int32
    assert out[(f"{RUN_OBJECT}/Run", "InputArguments")] == [("AlarmText", s, -1, []), ("Line", i32, -1, []),
                                                            ("Critical", b, -1, [])]
    assert out[(f"{RUN_OBJECT}/Run", "OutputArguments")] == [
        ("Severity", s, -1, []), ("StopLine", b, -1, []), ("Code", i32, -1, []), ("Note", s, -1, []),
        ("FinishReason", s, -1, []), ("ModelVersion", s, -1, [])]
    assert out[(TYPE_RUN, "InputArguments")] == out[(f"{RUN_OBJECT}/Run", "InputArguments")]
    assert out[(TYPE_RUN, "OutputArguments")] == out[(f"{RUN_OBJECT}/Run", "OutputArguments")]
    assert choose == [("Prompt", s, -1, []), ("Options", s, 1, [0])]
    assert type_def == ua.NodeId("Types/chat.triage.TaskType", ns)


def test_bad_input_gets_the_contracts_codes(app):
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            parent = c.get_node(ua.NodeId(RUN_OBJECT, ns))
            method = c.get_node(ua.NodeId(f"{RUN_OBJECT}/Run", ns))
            from appliance.client import call_method
            results = {
                "too long": await call_method(c, parent, method, triage_args("x" * 41)),
                "out of range": await call_method(c, parent, method, triage_args(line=10)),
                "missing": await call_method(c, parent, method, triage_args()[:2]),
                "too many": await call_method(c, parent, method, triage_args() + [ua.Variant(1, V.Int32)]),
                "control character": await call_method(c, parent, method, triage_args("bell \x07 rings")),
                "wrong type": await call_method(c, parent, method, [ua.Variant("a", V.String),
                                                                    ua.Variant(3.0, V.Double),
                                                                    ua.Variant(True, V.Boolean)]),
                "model object": await call_method(c, c.get_node(ua.NodeId("Appliance/Models/chat", ns)),
                                                  c.get_node(ua.NodeId(TYPE_RUN, ns)), triage_args()),
            }
        async with session(app, *app.monitor) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            results["monitor"] = await call_method(c, c.get_node(ua.NodeId(RUN_OBJECT, ns)),
                                                   c.get_node(ua.NodeId(f"{RUN_OBJECT}/Run", ns)), triage_args())
        return results
    r = run(go())
    assert status_name(r["too long"]) == "BadInvalidArgument"
    assert arg_statuses(r["too long"]) == ["BadOutOfRange", "Good", "Good"]
    assert status_name(r["out of range"]) == "BadInvalidArgument"
    assert arg_statuses(r["out of range"]) == ["Good", "BadOutOfRange", "Good"]
    assert status_name(r["missing"]) == "BadArgumentsMissing"
    assert status_name(r["too many"]) == "BadTooManyArguments"
    assert status_name(r["control character"]) == "BadInvalidArgument"
    assert arg_statuses(r["control character"]) == ["BadInvalidArgument", "Good", "Good"]
    assert status_name(r["wrong type"]) == "BadInvalidArgument"
    assert arg_statuses(r["wrong type"]) == ["Good", "BadTypeMismatch", "Good"]
    assert status_name(r["model object"]) == "BadMethodInvalid"
    assert status_name(r["monitor"]) == "BadUserAccessDenied"
    for result in r.values():
        assert result.OutputArguments == []


def test_an_answer_that_cannot_be_completed_is_bad_no_data_available(app):
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            from appliance.client import call_method
            path = "Appliance/Models/chat/Tasks/tight"
            return await call_method(c, c.get_node(ua.NodeId(path, ns)), c.get_node(ua.NodeId(f"{path}/Run", ns)),
                                     [ua.Variant("pressure high", V.String)])
    r = run(go())
    assert status_name(r) == "BadNoDataAvailable"
    assert r.OutputArguments == []  # no partial value presented as Good
    assert "max_tokens" in r.status_text


def test_task_jobs(app):
    """StartTask answers a JobId at once; GetTaskResult gives Done with the typed fields; the job is the task's
    (GetGenerateResult does not know it) and the model's ReleaseJob lets it go."""
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            from appliance.client import call_method
            task = c.get_node(ua.NodeId(RUN_OBJECT, ns))
            start = await call_method(c, task, c.get_node(ua.NodeId(f"{RUN_OBJECT}/StartTask", ns)),
                                      triage_args("valve stuck", 2, False))
            assert status_name(start) == "Good"
            job = start.OutputArguments[0]
            get = c.get_node(ua.NodeId(f"{RUN_OBJECT}/GetTaskResult", ns))
            end = time.monotonic() + 120
            while True:
                r = await call_method(c, task, get, [job, ua.Variant(2000, V.UInt32)])
                assert status_name(r) == "Good"
                if r.OutputArguments[0].Value or time.monotonic() > end:
                    break
            bad = await call_method(c, task, c.get_node(ua.NodeId(f"{RUN_OBJECT}/StartTask", ns)),
                                    triage_args("x" * 41))
            generate_result = await call(c, "chat", "GetGenerateResult", [job, ua.Variant(0, V.UInt32)])
            released = await call(c, "chat", "ReleaseJob", [job])
            gone = await call_method(c, task, get, [job, ua.Variant(0, V.UInt32)])
            sync = await call_method(c, task, c.get_node(ua.NodeId(f"{RUN_OBJECT}/Run", ns)),
                                     triage_args("valve stuck", 2, False))
            return r, bad, generate_result, released, gone, sync
    r, bad, generate_result, released, gone, sync = run(go(), timeout=300)
    assert r.OutputArguments[0].Value is True
    result = ua.CallMethodResult(StatusCode=r.StatusCode, OutputArguments=r.OutputArguments[1:])
    assert check_answer(result) == check_answer(sync)  # the job answers what the call answers
    assert status_name(bad) == "BadInvalidArgument" and arg_statuses(bad) == ["BadOutOfRange", "Good", "Good"]
    assert status_name(generate_result) == "BadNotFound"
    assert status_name(released) == "Good"
    assert status_name(gone) == "BadNotFound"


def test_hmi_drives_the_task_mailbox(app):
    """Typed inputs written, then Request; the typed fields, FinishReason, Response and Done answer together; a
    wrong type is refused at the write, a value out of bounds at the Request (Error, ErrorCode), emptying the fields."""
    async def go():
        async with session(app, *app.operator) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            box = "Appliance/Mailboxes/triage-hmi"
            node = lambda k: c.get_node(ua.NodeId(f"{box}/{k}", ns))  # noqa: E731
            type_def = await c.get_node(ua.NodeId(box, ns)).read_type_definition()
            await node("AlarmText").write_value(ua.Variant("pump trip", V.String))
            await node("Line").write_value(ua.Variant(4, V.Int32))
            await node("Critical").write_value(ua.Variant(True, V.Boolean))
            with pytest.raises(ua.UaStatusCodeError) as wrong:
                await node("Line").write_value(ua.Variant(4.0, V.Double))
            await node("Request").write_value(ua.Variant(7, V.UInt32))

            async def done(number):
                end = time.monotonic() + 120
                while time.monotonic() < end:
                    if await node("Response").read_value() == number and not await node("Busy").read_value():
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError("no answer")
            await done(7)
            good = {k: await node(k).read_data_value() for k in
                    ("Severity", "StopLine", "Code", "Note", "FinishReason", "ModelVersion", "Done", "Error")}
            await node("AlarmText").write_value(ua.Variant("x" * 41, V.String))
            await node("Request").write_value(ua.Variant(8, V.UInt32))
            await done(8)
            bad = {k: await node(k).read_value() for k in ("Severity", "Done", "Error", "ErrorCode", "FinishReason")}
            return type_def, wrong.value, good, bad, ns
    type_def, wrong, good, bad, ns = run(go(), timeout=300)
    assert type_def == ua.NodeId("Types/chat.triage.MailboxType", ns)
    assert wrong.code == ua.StatusCodes.BadTypeMismatch
    assert good["Done"].Value.Value is True and good["Error"].Value.Value is False
    r = ua.CallMethodResult(StatusCode=ua.StatusCode(), OutputArguments=[
        good[k].Value for k in ("Severity", "StopLine", "Code", "Note", "FinishReason", "ModelVersion")])
    fields = check_answer(r)
    sync = run(s7_call(app.endpoint, *app.operator, "line3", PASSWORD, RUN_OBJECT, f"{RUN_OBJECT}/Run",
                       triage_args("pump trip", 4, True)))
    assert check_answer(sync) == fields  # the mailbox answers what the method answers
    assert bad == {"Severity": "", "Done": False, "Error": True, "ErrorCode": ua.StatusCodes.BadInvalidArgument,
                   "FinishReason": ""}


def test_choose(app):
    async def go():
        async with session(app, *app.operator) as c:
            def choose(options, prompt="Is the pump running?"):
                return call(c, "chat", "Choose", [ua.Variant(prompt, V.String), ua.Variant(options, V.String)])
            out = {"none": await choose([]), "too many": await choose([f"o{i}" for i in range(17)]),
                   "empty": await choose(["yes", ""]), "no prompt": await choose(["yes"], ""),
                   "scalar": await call(c, "chat", "Choose", [ua.Variant("Is it?", V.String),
                                                             ua.Variant("yes", V.String)]),
                   "good": await choose(["yes", "no", "the pump is stopped"]),
                   "again": await choose(["yes", "no", "the pump is stopped"]),
                   "sixteen": await choose([f"option {i}" for i in range(16)])}
        async with session(app, *app.monitor) as c:
            out["monitor"] = await call(c, "chat", "Choose", [ua.Variant("Is it?", V.String),
                                                              ua.Variant(["a"], V.String)])
        return out
    r = run(go(), timeout=300)
    for case, arg in (("none", 1), ("too many", 1), ("empty", 1), ("no prompt", 0)):
        assert status_name(r[case]) == "BadInvalidArgument", case
        assert arg_statuses(r[case])[arg] in ("BadOutOfRange", "BadInvalidArgument"), case
    assert status_name(r["scalar"]) == "BadInvalidArgument" and arg_statuses(r["scalar"]) == ["Good",
                                                                                              "BadTypeMismatch"]
    assert status_name(r["monitor"]) == "BadUserAccessDenied"
    for case, options in (("good", ["yes", "no", "the pump is stopped"]),
                          ("sixteen", [f"option {i}" for i in range(16)])):
        assert status_name(r[case]) == "Good", case
        index, option, scores, version = (v.Value for v in r[case].OutputArguments)
        assert [v.VariantType for v in r[case].OutputArguments] == [V.Int32, V.String, V.Float, V.String]
        assert len(scores) == len(options) and all(s <= 0 for s in scores)
        assert index == max(range(len(scores)), key=lambda i: (scores[i], -i))
        assert option == options[index] and version
    assert [v.Value for v in r["again"].OutputArguments] == [v.Value for v in r["good"].OutputArguments]


def test_calls_are_audited_under_the_tasks_name(app):
    def records():
        path = app.state_dir / "audit" / "audit.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run(s7_call(app.endpoint, *app.operator, "line3", PASSWORD, RUN_OBJECT, f"{RUN_OBJECT}/Run", triage_args()))
    end = time.monotonic() + 10
    while time.monotonic() < end and not any(r.get("action") == "Tasks/triage/Run" and r.get("user") == "user:line3"
                                             for r in records()):
        time.sleep(0.2)
    runs = [r for r in records() if r.get("action") == "Tasks/triage/Run" and r.get("user") == "user:line3"]
    assert runs and runs[-1]["status"] == "Good" and runs[-1]["model"] == "chat" and runs[-1]["version"]
    assert any(r.get("action") == "Choose" for r in records())


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_opcua_calls_the_task_by_its_types_method(app):
    cert_der, key = app.operator
    uri = f"urn:{socket.gethostname()}:appliance:client:plc1"
    proc = subprocess.run(["node", str(ROOT / "tests" / "node" / "task.js"), app.endpoint,
                           str(cert_der.with_suffix(".pem")), str(key), uri, str(app.state_dir / "node-pki"), "chat",
                           "triage", json.dumps({"AlarmText": "fan vibration", "Line": 5, "Critical": False})],
                          capture_output=True, text=True, timeout=180)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    result = json.loads(lines[-1])
    assert result["status"] == "Good", result
    assert [(a["name"], a["dataType"]) for a in result["inputArguments"]] == [
        ("AlarmText", "String"), ("Line", "Int32"), ("Critical", "Boolean")]
    assert [(o["name"], o["dataType"]) for o in result["outputs"]] == [
        ("Severity", "String"), ("StopLine", "Boolean"), ("Code", "Int32"), ("Note", "String"),
        ("FinishReason", "String"), ("ModelVersion", "String")]
    values = {o["name"]: o["value"] for o in result["outputs"]}
    assert values["Severity"] in ("low", "medium", "high") and 0 <= values["Code"] <= 99
    assert values["FinishReason"] == "stop"
    sync = run(s7_call(app.endpoint, cert_der, key, "line3", PASSWORD, RUN_OBJECT, f"{RUN_OBJECT}/Run",
                       triage_args("fan vibration", 5, False)))
    fields = check_answer(sync)
    assert {k: values[k] for k in ("Severity", "StopLine", "Code", "Note")} == \
        {k: fields[k] for k in ("Severity", "StopLine", "Code", "Note")}


def test_concurrent_plcs_all_get_valid_answers(app):
    """Four PLCs at once (a session per call each): their answers are decoded in one batch, every one valid, each
    the answer the same inputs get alone."""
    cert, key = app.operator

    async def one(i):
        return await s7_call(app.endpoint, cert, key, "line3", PASSWORD, RUN_OBJECT, f"{RUN_OBJECT}/Run",
                             triage_args(f"motor {i} hot", 1 + i, i % 2 == 0))

    async def go():
        return await asyncio.gather(*(one(i) for i in range(4)))
    together = [check_answer(r) for r in run(go(), timeout=300)]
    alone = [check_answer(run(one(i), timeout=120)) for i in range(4)]
    assert together == alone


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_nodeset_export_carries_the_task_types_and_their_arguments(app, tmp_path):
    """`appliance nodeset` writes the task's ObjectType with Run's typed arguments and the task object; node-opcua
    loads the file and reads them back."""
    from appliance.cli import main
    out = tmp_path / "appliance.xml"
    assert main(["nodeset", "--config", str(app.config_path), "--out", str(out)]) == 0
    proc = subprocess.run(["node", str(ROOT / "tests" / "node" / "nodeset.js"), "load", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    nodes = {n["nodeId"]: n for n in json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
             ["nodes"]}
    run_ = nodes["s=Types/chat.triage.TaskType/Run"]
    assert [a["name"] for a in run_["inputArguments"]] == ["AlarmText", "Line", "Critical"]
    assert [a["name"] for a in run_["outputArguments"]] == ["Severity", "StopLine", "Code", "Note", "FinishReason",
                                                            "ModelVersion"]
    assert [a["dataType"] for a in run_["outputArguments"]] == ["ns=0;i=12", "ns=0;i=1", "ns=0;i=6", "ns=0;i=12",
                                                                "ns=0;i=12", "ns=0;i=12"]
    assert nodes["s=Types/chat.triage.TaskType"]["subtypeOf"].endswith("s=Types/TaskType")
    assert nodes["s=Appliance/Models/chat/Tasks/triage"]["typeDefinition"].endswith("s=Types/chat.triage.TaskType")
    assert "s=Appliance/Models/chat/Tasks/triage/Run" in nodes and "s=Types/GenerativeModelType/Choose" in nodes
    assert nodes["s=Appliance/Mailboxes/triage-hmi"]["typeDefinition"].endswith("s=Types/chat.triage.MailboxType")



def test_tasks_and_choose_count_against_the_rate_limits(tmp_path):
    """The same rate limits as Generate: over the caller's budget a task's Run and Choose answer
    BadTooManyOperations at once."""
    make_model_dir(tmp_path / "model", seed=3)
    a = RunningAppliance(tmp_path / "state", {"chat": {"kind": "generative", "path": str(tmp_path / "model"),
                                                       "max_text_chars": 400, "tasks": {"tight": TIGHT}}},
                         {"engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 32},
                          "security": {"rate_limits": {"per_client": {"calls_per_s": 0.01, "burst": 2}}}})
    try:
        cert = a.issue("plc1", "operator")

        async def go():
            async with session(a, *cert) as c:
                ns = await c.get_namespace_index("urn:opcua-inference-appliance")
                from appliance.client import call_method
                path = "Appliance/Models/chat/Tasks/tight"
                obj, method = c.get_node(ua.NodeId(path, ns)), c.get_node(ua.NodeId(f"{path}/Run", ns))
                arg = [ua.Variant("pressure high", V.String)]
                first = [status_name(await call_method(c, obj, method, arg)) for _ in range(2)]
                over = status_name(await call_method(c, obj, method, arg))
                choose = status_name(await call(c, "chat", "Choose", [ua.Variant("Is it?", V.String),
                                                                      ua.Variant(["yes", "no"], V.String)]))
                return first, over, choose
        first, over, choose = run(go())
        assert first == ["BadNoDataAvailable"] * 2  # within the budget: the engine answered (max_tokens 1)
        assert over == "BadTooManyOperations" and choose == "BadTooManyOperations"
    finally:
        a.stop()


def test_a_task_is_answered_by_the_callers_variant(tmp_path):
    """Routed like Generate: with an A/B variant serving every caller, the task's answer (and Choose's) comes from
    the variant's weights, and ModelVersion says so."""
    make_model_dir(tmp_path / "main", seed=3)
    make_model_dir(tmp_path / "b", seed=4)
    a = RunningAppliance(tmp_path / "state", {"chat": {
        "kind": "generative", "path": str(tmp_path / "main"), "version": "main-1", "max_text_chars": 400,
        "tasks": {"tight": TIGHT, "triage": TRIAGE}, "variants": {"b": {"path": str(tmp_path / "b"), "weight": 100,
                                                                       "version": "b-1"}}}},
        {"engine": {"kv_slots": 2, "max_seq_len": 256, "max_new_tokens": 96}})
    try:
        cert = a.issue("plc1", "operator")

        async def go():
            async with session(a, *cert) as c:
                ns = await c.get_namespace_index("urn:opcua-inference-appliance")
                from appliance.client import call_method
                r = await call_method(c, c.get_node(ua.NodeId(RUN_OBJECT, ns)),
                                      c.get_node(ua.NodeId(f"{RUN_OBJECT}/Run", ns)), triage_args())
                chosen = await call(c, "chat", "Choose", [ua.Variant("Is it?", V.String),
                                                          ua.Variant(["yes", "no"], V.String)])
                return r, chosen
        r, chosen = run(go(), timeout=300)
        assert check_answer(r)["ModelVersion"] == "b-1"
        assert status_name(chosen) == "Good" and chosen.OutputArguments[3].Value == "b-1"
    finally:
        a.stop()
