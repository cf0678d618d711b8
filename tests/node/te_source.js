// A plant's OPC UA server of another stack (node-opcua), shaped like an S7-1500's: SignAndEncrypt / Basic256Sha256
// only, user name + password identity only (no anonymous), 8 KiB transport buffers, and its own PKI that trusts the
// appliance's client certificate explicitly. It replays Tennessee Eastman rows (a JSON file of rows x 52, written by
// the test from bibmon's data) into Objects/Plant/<name> (`nsu=urn:te-plant-node;s=TE.<name>`), all values of a row
// with one SourceTimestamp.
// usage: node te_source.js PORT CERT.pem KEY.pem PKI_DIR ROWS.json USER PASSWORD INTERVAL_S
// Prints "listening", waits for "go" on stdin, prints "row N" per row and "done N" after the last.
"use strict";
const fs = require("fs");
const readline = require("readline");
const { OPCUAServer } = require("node-opcua-server");
const { OPCUACertificateManager } = require("node-opcua-certificate-manager");
const { MessageSecurityMode, SecurityPolicy } = require("node-opcua-client");
const { Variant, DataType } = require("node-opcua-variant");
const { StatusCodes } = require("node-opcua-status-code");

const NAMES = [];
for (let i = 1; i <= 41; i++) NAMES.push(`XMEAS${i}`);
for (let i = 1; i <= 11; i++) NAMES.push(`XMV${i}`);
const BUFFER = 8192;

async function main() {
  const [port, certFile, keyFile, pkiDir, rowsFile, user, password, interval] = process.argv.slice(2);
  const rows = JSON.parse(fs.readFileSync(rowsFile, "utf8"));
  const serverCertificateManager = new OPCUACertificateManager({
    rootFolder: pkiDir, automaticallyAcceptUnknownCertificate: false,
  });
  await serverCertificateManager.initialize();
  const server = new OPCUAServer({
    port: Number(port),
    hostname: "127.0.0.1",
    certificateFile: certFile,
    privateKeyFile: keyFile,
    serverCertificateManager,
    securityModes: [MessageSecurityMode.SignAndEncrypt],
    securityPolicies: [SecurityPolicy.Basic256Sha256],
    allowAnonymous: false,
    userManager: { isValidUser: (name, pass) => name === user && pass === password },
    serverInfo: { applicationUri: "urn:te-plant-node:server", productUri: "urn:te-plant-node",
                  applicationName: { text: "TE plant (node-opcua)" } },
    transportSettings: {
      adjustTransportLimits: (hello) => ({
        receiveBufferSize: Math.min(hello.receiveBufferSize || BUFFER, BUFFER),
        sendBufferSize: Math.min(hello.sendBufferSize || BUFFER, BUFFER),
        maxMessageSize: Math.min(hello.maxMessageSize || 16 * BUFFER, 16 * BUFFER),
        maxChunkCount: Math.min(hello.maxChunkCount || 16, 16),
      }),
    },
  });
  await server.initialize();
  const addressSpace = server.engine.addressSpace;
  const ns = addressSpace.registerNamespace("urn:te-plant-node");
  const plant = ns.addObject({ organizedBy: addressSpace.rootFolder.objects, browseName: "Plant",
                               nodeId: "s=TE.Plant" });
  const variables = NAMES.map((name, i) => ns.addVariable({
    componentOf: plant, browseName: name, nodeId: `s=TE.${name}`, dataType: "Double",
    value: new Variant({ dataType: DataType.Double, value: rows[0][i] }),
  }));
  await server.start();
  console.log("listening");
  const stdin = readline.createInterface({ input: process.stdin });
  for await (const line of stdin) {
    if (line.trim() === "go") break;
  }
  const step = Number(interval) * 1000;
  let next = Date.now();
  for (let r = 0; r < rows.length; r++) {
    const now = new Date();
    variables.forEach((v, i) => v.setValueFromSource(new Variant({ dataType: DataType.Double, value: rows[r][i] }),
                                                     StatusCodes.Good, now));
    console.log(`row ${r}`);
    next += step;
    await new Promise((resolve) => setTimeout(resolve, Math.max(0, next - Date.now())));
  }
  console.log(`done ${rows.length - 1}`);
}

main().catch((err) => { console.error(String(err && err.stack || err)); process.exit(1); });
