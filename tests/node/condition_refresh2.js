// An independent OPC UA client (node-opcua) as a SCADA system after reconnecting: SignAndEncrypt / Basic256Sha256, the
// client certificate as application certificate and X509 user identity; one subscription with two event monitored
// items on the Server object; ConditionRefresh2 (i=12912) for the first item only; then Acknowledge (i=9111) of the
// condition with the EventId that refresh showed. Prints one JSON line: the refresh's status, the events each item
// got (type, ConditionName, ActiveState/Id, AckedState/Id), the acknowledgement's status.
// usage: node condition_refresh2.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR CONDITION_NAME CONDITION_NODEID
"use strict";
const {
  AttributeIds, ClientSubscription, ClientMonitoredItem, TimestampsToReturn, constructEventFilter, DataType,
  resolveNodeId,
} = require("node-opcua-client");
const { withSession, printResult } = require("./common");

const FIELDS = ["EventId", "EventType", "ConditionName", "ActiveState.Id", "AckedState.Id"];
const TYPES = { "ns=0;i=2787": "RefreshStart", "ns=0;i=2788": "RefreshEnd", "ns=0;i=10637": "OffNormalAlarm" };
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function eventItem(subscription, filter, seen) {
  const item = ClientMonitoredItem.create(subscription, { nodeId: resolveNodeId("Server"),
    attributeId: AttributeIds.EventNotifier }, { samplingInterval: 0, queueSize: 100, filter, discardOldest: true },
  TimestampsToReturn.Neither);
  item.on("changed", (fields) => {
    const type = fields[1].value ? fields[1].value.toString() : "";
    seen.push({ eventId: fields[0].value ? fields[0].value.toString("hex") : "", type: TYPES[type] || type,
      conditionName: fields[2].value, active: fields[3].value, acked: fields[4].value });
  });
  await new Promise((resolve, reject) => { item.once("initialized", resolve); item.once("err", reject); });
  return item;
}

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, conditionName, conditionNodeId] = process.argv.slice(2);
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua test client" };
  return withSession(settings, async (session) => {
    const out = { first: [], second: [] };
    const subscription = ClientSubscription.create(session, { requestedPublishingInterval: 50,
      requestedLifetimeCount: 1000, requestedMaxKeepAliveCount: 10, publishingEnabled: true });
    await new Promise((resolve) => subscription.once("started", resolve));
    const filter = constructEventFilter(FIELDS);
    const first = await eventItem(subscription, filter, out.first);
    await eventItem(subscription, filter, out.second);
    await sleep(500);
    out.first.length = 0;
    out.second.length = 0;
    const refresh = await session.call({ objectId: resolveNodeId("ConditionType"), methodId: "ns=0;i=12912",
      inputArguments: [{ dataType: DataType.UInt32, value: subscription.subscriptionId },
        { dataType: DataType.UInt32, value: first.monitoredItemId }] });
    out.refresh2 = refresh.statusCode.name;
    await sleep(1500);
    out.first = out.first.slice();  // what the refresh sent; the acknowledgement's own event comes after
    out.second = out.second.slice();
    const shown = out.first.find((e) => e.conditionName === conditionName);
    if (shown) {
      const ack = await session.call({ objectId: conditionNodeId, methodId: "ns=0;i=9111",
        inputArguments: [{ dataType: DataType.ByteString, value: Buffer.from(shown.eventId, "hex") },
          { dataType: DataType.LocalizedText, value: { text: "seen after ConditionRefresh2" } }] });
      out.ack = ack.statusCode.name;
    }
    await subscription.terminate();
    return out;
  });
}

printResult(main);
