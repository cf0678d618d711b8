"""Class alarms a control room can live with, on real plant data: the demo's Tennessee Eastman classifier fed by two
lines through two mailboxes (each an alarm source), as PLCs that write and subscribe do.

Both lines send the held-out normal run (d00_te, 941 windows) and then a held-out fault run (IDV2, d02_te: normal
for 160 rows, then the fault), 20 windows per Request, their requests interleaved. A SCADA client subscribes to the
Part 9 conditions and counts raises: the normal run raises none (the classifier's isolated false alarms stay under
the debounce), the fault run raises IDV2 exactly once per line, and neither line's results clear the other's."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from asyncua import ua

from harness import RunningAppliance
from uaclient import Events, field, read, run, session

te = pytest.importorskip("models.te_classifier")
V = ua.VariantType
NS = "urn:opcua-inference-appliance"
FAULT = 2
LABEL = "IDV2 B composition step"
PER_REQUEST = 20
# as the demo configures the classifier: every fault but the three it cannot tell from normal operation
ALARM_CLASSES = [c for c in range(1, 22) if c not in (3, 9, 15)]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    require_te_data()
    d = tmp_path_factory.mktemp("te-alarms")
    models = {"te": {"kind": "tensor", "path": "builtin:te-classifier", "labels": _labels(),
                     "alarm_classes": ALARM_CLASSES,
                     "alarm_sources": {"line1": "box1", "line2": "box2"}}}
    mailboxes = {"box1": {"model": "te"}, "box2": {"model": "te"}}
    a = RunningAppliance(d / "state", models, {"mailboxes": mailboxes})
    a.plc, a.scada = a.issue("plc1", "operator"), a.issue("scada", "monitor")
    yield a
    a.stop()


def require_te_data() -> None:
    """The Tennessee Eastman data these tests replay: a failure naming it where it is missing, never a skip."""
    try:
        te.te_data_dir()
    except (FileNotFoundError, OSError) as e:
        pytest.fail(f"the Tennessee Eastman data (bibmon) is not installed: {e}")


def _labels() -> list[str]:
    path = te.MODEL_DIR / "labels.txt"
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def windows(fault: int) -> np.ndarray:
    return te.sliding_windows(te.load_te_rows(fault, test=True)).astype(np.float32)


class Raises(Events):
    """The recorded condition events as the ConditionNames that were raised (active) and cleared."""

    def _names(self, active: bool) -> list[str]:
        return [field(e, "ConditionName") for e in self.events
                if field(e, "ConditionName") is not None and bool(field(e, "ActiveState/Id")) is active]

    @property
    def raised(self) -> list[str]:
        return self._names(True)

    @property
    def cleared(self) -> list[str]:
        return self._names(False)


async def box_nodes(client, box: str) -> dict:
    ns = await client.get_namespace_index(NS)
    obj = await client.nodes.objects.get_child([f"{ns}:Appliance", f"{ns}:Mailboxes", f"{ns}:{box}"])
    return {(await n.read_browse_name()).Name: n for n in await obj.get_children()}


async def request(client, nodes: dict, samples: np.ndarray, number: int) -> None:
    """Input, then a new Request (one Write), then wait until Response shows it, as a PLC's handshake does."""
    params = ua.WriteParameters()
    for node, variant in ((nodes["Input"], ua.Variant(samples.reshape(-1).tolist(), V.Float)),
                          (nodes["Request"], ua.Variant(number, V.UInt32))):
        wv = ua.WriteValue()
        wv.NodeId, wv.AttributeId, wv.Value = node.nodeid, ua.AttributeIds.Value, ua.DataValue(variant)
        params.NodesToWrite.append(wv)
    assert [s.name for s in await client.uaclient.write(params)] == ["Good", "Good"]
    for _ in range(600):
        if await nodes["Response"].read_value() == number and not await nodes["Busy"].read_value():
            assert await nodes["Error"].read_value() is False
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"request {number} was not answered")


async def feed(client, boxes: dict, run_windows: np.ndarray, numbers: dict) -> None:
    """Both lines send the run, their requests interleaved (line1, line2, line1, ...)."""
    for start in range(0, len(run_windows), PER_REQUEST):
        chunk = run_windows[start:start + PER_REQUEST]
        for box, nodes in boxes.items():
            numbers[box] += 1
            await request(client, nodes, chunk, numbers[box])


def test_the_normal_run_raises_nothing_and_the_fault_run_raises_its_class_once_per_line(app):
    async def go():
        async with session(app, *app.plc) as plc, session(app, *app.scada) as scada:
            seen = Raises()
            sub = await scada.create_subscription(20, seen)
            await sub.subscribe_events(scada.nodes.server, ua.ObjectIds.OffNormalAlarmType)
            boxes = {box: await box_nodes(plc, box) for box in ("box1", "box2")}
            numbers = {box: 0 for box in boxes}

            await feed(plc, boxes, windows(0), numbers)
            await asyncio.sleep(0.5)
            assert seen.raised == [], f"the held-out normal run raised {seen.raised}"

            await feed(plc, boxes, windows(FAULT), numbers)
            await asyncio.sleep(0.5)
            expected = sorted(f"te.line{n}.{LABEL}" for n in (1, 2))
            assert sorted(seen.raised) == expected, seen.raised  # its class, once per line, nothing else
            assert seen.cleared == [], seen.cleared  # still active: the fault goes on
            for source in ("line1", "line2"):
                assert await read(scada, "Alarms", source, LABEL) is True
                assert await read(scada, "Models", "te", "Last", source, "Label") == LABEL
            assert await read(scada, "Alarms", LABEL) is True
            assert await read(scada, "Alarms", "default", LABEL) is False  # no other caller sent anything
    run(go(), timeout=600)
