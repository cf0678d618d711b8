// An independent OPC UA client (node-opcua) reading an alarm condition as a SCADA system would: SignAndEncrypt /
// Basic256Sha256, the client certificate as application certificate and X509 user identity; browses the Server
// object for the condition by its BrowseName, checks its type definition, and reads its Part 9 state variables
// (ActiveState/Id, AckedState/Id, EnabledState/Id, Retain, Severity, SourceName, Message). Prints one JSON line.
// usage: node condition.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR CONDITION_BROWSE_NAME
"use strict";
const { AttributeIds, BrowseDirection, NodeClassMask, makeBrowsePath, resolveNodeId } = require("node-opcua-client");
const { withSession, printResult } = require("./common");

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, conditionName] = process.argv.slice(2);
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua test client" };
  return withSession(settings, async (session) => {
    const out = {};
    const nsArray = await session.readNamespaceArray();
    const ns = nsArray.indexOf("urn:opcua-inference-appliance");
    // Browse the Server object's components: objects only (a browse also returns HasTypeDefinition targets).
    const browsed = await session.browse({
      nodeId: resolveNodeId("Server"), browseDirection: BrowseDirection.Forward,
      referenceTypeId: "HasComponent", includeSubtypes: true, nodeClassMask: NodeClassMask.Object, resultMask: 63,
    });
    const ref = browsed.references.find((r) => r.browseName.name === conditionName && r.browseName.namespaceIndex === ns);
    out.conditions = browsed.references.filter((r) => r.browseName.namespaceIndex === ns).map((r) => r.browseName.name);
    if (!ref) throw new Error(`no condition ${conditionName} under the Server object`);
    out.nodeId = ref.nodeId.toString();
    out.typeDefinition = ref.typeDefinition.toString();
    const paths = ["ActiveState/Id", "AckedState/Id", "EnabledState/Id", "Retain", "Severity", "SourceName",
                   "Message", "ActiveState"];
    for (const p of paths) {
      const relative = p.split("/").map((s) => `.${s}`).join("");  // children of the condition: standard names
      const res = await session.translateBrowsePath(makeBrowsePath(ref.nodeId, relative));
      if (!res.targets || !res.targets.length) { out[p] = "missing"; continue; }
      const dv = await session.read({ nodeId: res.targets[0].targetId, attributeIds: AttributeIds.Value });
      const v = dv.value.value;
      out[p] = v && typeof v === "object" && "text" in v ? v.text : v;
    }
    return out;
  });
}

printResult(main);
