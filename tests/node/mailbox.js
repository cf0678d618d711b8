// An independent OPC UA client (node-opcua) that only writes and subscribes: runs N requests through a mailbox
// (one Write of Input and Request, then waits for the publish with Response == Request) and checks each result it
// sees: Output, Done and Busy of the same publish. Prints one JSON line with the outcome.
// usage: node mailbox.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR MAILBOX N
"use strict";
const {
  AttributeIds, TimestampsToReturn, ClientSubscription, ClientMonitoredItem, DataType, VariantArrayType, makeBrowsePath,
} = require("node-opcua-client");
const { withSession, printResult } = require("./common");

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, box, n] = process.argv.slice(2);
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua mailbox client" };
  const out = { requests: 0, whole: 0, bad: [] };
  await withSession(settings, async (session) => {
    const ns = (await session.readNamespaceArray()).indexOf("urn:opcua-inference-appliance");
    const ids = {};
    for (const key of ["Input", "Request", "Response", "Done", "Busy", "Error", "Output"]) {
      const r = await session.translateBrowsePath(
        makeBrowsePath("ObjectsFolder", `/${ns}:Appliance/${ns}:Mailboxes/${ns}:${box}/${ns}:${key}`));
      ids[key] = r.targets[0].targetId;
    }
    const sub = ClientSubscription.create(session, {
      requestedPublishingInterval: 10, requestedMaxKeepAliveCount: 100, requestedLifetimeCount: 1000,
      maxNotificationsPerPublish: 0, publishingEnabled: true, priority: 1,
    });
    const state = {};
    let waiter = null;
    for (const key of ["Response", "Done", "Busy", "Error", "Output"]) {
      const item = ClientMonitoredItem.create(sub, { nodeId: ids[key], attributeId: AttributeIds.Value },
        { samplingInterval: 0, queueSize: 1, discardOldest: true }, TimestampsToReturn.Both);
      item.on("changed", (dv) => {
        state[key] = dv.value.value;
        if (waiter) waiter();
      });
    }
    const until = (pred) => new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error("timeout")), 10000);
      const check = () => {
        // notifications of one publish are handled in one go: look once they all are in
        setImmediate(() => { if (pred()) { clearTimeout(timer); waiter = null; resolve(); } });
      };
      waiter = check;
      check();
    });
    await until(() => state.Response !== undefined && state.Busy !== undefined);
    let request = state.Response;
    for (let i = 0; i < Number(n); i++) {
      request += 1;
      const x = [i % 7, i % 5, 0.5, i % 3];
      const statuses = await session.write([
        { nodeId: ids.Input, attributeId: AttributeIds.Value,
          value: { value: { dataType: DataType.Float, arrayType: VariantArrayType.Array, value: new Float32Array(x) } } },
        { nodeId: ids.Request, attributeId: AttributeIds.Value,
          value: { value: { dataType: DataType.UInt32, value: request } } },
      ]);
      if (statuses.some((s) => s.name !== "Good")) throw new Error("write: " + statuses.map((s) => s.name));
      await until(() => state.Response === request && state.Busy === false);
      out.requests += 1;
      const output = Array.from(state.Output || []);
      const ok = state.Done === true && state.Error === false && output.length === 4
        && output.every((v, k) => Math.abs(v - (2 * x[k] + 1)) < 1e-5);
      if (ok) out.whole += 1; else out.bad.push({ request, output, done: state.Done });
    }
    await sub.terminate();
  });
  return out;
}

printResult(main);
