// An independent OPC UA client (node-opcua) reading an alarm condition as a SCADA system would: SignAndEncrypt /
// Basic256Sha256, the client certificate as application certificate and X509 user identity; browses the Server
// object for the condition by its BrowseName, checks its type definition, and reads its Part 9 state variables
// (ActiveState/Id, AckedState/Id, EnabledState/Id, Retain, Severity, SourceName, Message). Prints one JSON line.
// usage: node condition.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR CONDITION_BROWSE_NAME
"use strict";
const fs = require("fs");
const {
  OPCUAClient, MessageSecurityMode, SecurityPolicy, UserTokenType, AttributeIds, BrowseDirection, NodeClassMask,
  makeBrowsePath, resolveNodeId,
} = require("node-opcua-client");
const { OPCUACertificateManager } = require("node-opcua-certificate-manager");

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, conditionName] = process.argv.slice(2);
  const certificateManager = new OPCUACertificateManager({ rootFolder: pkiDir, automaticallyAcceptUnknownCertificate: true });
  await certificateManager.initialize();
  const client = OPCUAClient.create({
    applicationName: "node-opcua test client",
    applicationUri,
    securityMode: MessageSecurityMode.SignAndEncrypt,
    securityPolicy: SecurityPolicy.Basic256Sha256,
    certificateFile: certFile,
    privateKeyFile: keyFile,
    clientCertificateManager: certificateManager,
    endpointMustExist: false,
    connectionStrategy: { maxRetry: 0, initialDelay: 100 },
  });
  const out = {};
  await client.connect(endpoint);
  try {
    const pem = fs.readFileSync(certFile, "utf8");
    const der = Buffer.from(pem.replace(/-----[^-]+-----/g, "").replace(/\s+/g, ""), "base64");
    const session = await client.createSession({
      type: UserTokenType.Certificate, certificateData: der, privateKey: fs.readFileSync(keyFile, "utf8"),
    });
    try {
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
    } finally {
      await session.close();
    }
  } finally {
    await client.disconnect();
  }
  console.log(JSON.stringify(out));
}

main().catch((err) => { console.log(JSON.stringify({ error: String(err && err.message || err) })); process.exit(1); });
