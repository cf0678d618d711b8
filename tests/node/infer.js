// An independent OPC UA client (node-opcua): SignAndEncrypt / Basic256Sha256, the client certificate issued by the
// appliance as application certificate AND as X509 user identity; browses to the model by BrowseNames (namespace
// index looked up in the NamespaceArray) and calls Infer. Prints one JSON line with the outcome.
// usage: node infer.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR MODEL '[floats]'
"use strict";
const { MessageSecurityMode, DataType, VariantArrayType, makeBrowsePath } = require("node-opcua-client");
const { withSession, printResult } = require("./common");

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, model, input] = process.argv.slice(2);
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua test client" };
  return withSession(settings, async (session, client) => {
    const out = {};
    const nsArray = await session.readNamespaceArray();
    const ns = nsArray.indexOf("urn:opcua-inference-appliance");
    const path = `/${ns}:Appliance/${ns}:Models/${ns}:${model}`;
    const objRes = await session.translateBrowsePath(makeBrowsePath("ObjectsFolder", path));
    const methRes = await session.translateBrowsePath(makeBrowsePath("ObjectsFolder", `${path}/${ns}:Infer`));
    const objectId = objRes.targets[0].targetId;
    const methodId = methRes.targets[0].targetId;
    const values = JSON.parse(input);
    const res = await session.call({
      objectId, methodId,
      inputArguments: [{ dataType: DataType.Float, arrayType: VariantArrayType.Array, value: new Float32Array(values) }],
    });
    out.status = res.statusCode.name;
    out.output = res.outputArguments.length ? Array.from(res.outputArguments[0].value) : null;
    out.version = res.outputArguments.length > 1 ? res.outputArguments[1].value : null;
    out.securityMode = MessageSecurityMode[client.securityMode];
    return out;
  });
}

printResult(main);
