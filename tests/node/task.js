// node-opcua calls a typed task by its TYPE's method: it reads the input arguments declared on
// Types/<model>.<task>.TaskType/Run (names and data types, as an engineering tool would), builds the call from them and
// calls that method NodeId with the task object Appliance/Models/<model>/Tasks/<task> as ObjectId. SignAndEncrypt /
// Basic256Sha256, the client certificate as X509 user identity. Prints one JSON line: the status, the declared
// argument types and each output's name, data type and value.
// usage: node task.js ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR MODEL TASK '{"Input": value, ...}'
"use strict";
const { MessageSecurityMode, DataType } = require("node-opcua-client");
const { withSession, printResult } = require("./common");

const URI = "urn:opcua-inference-appliance";

async function main() {
  const [endpoint, certFile, keyFile, applicationUri, pkiDir, model, task, input] = process.argv.slice(2);
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua task client" };
  return withSession(settings, async (session, client) => {
    const out = {};
    const ns = (await session.readNamespaceArray()).indexOf(URI);
    const typeMethod = `ns=${ns};s=Types/${model}.${task}.TaskType/Run`;
    const objectId = `ns=${ns};s=Appliance/Models/${model}/Tasks/${task}`;
    const declared = await session.getArgumentDefinition(typeMethod);
    out.inputArguments = declared.inputArguments.map((a) => ({ name: a.name, dataType: DataType[a.dataType.value],
      valueRank: a.valueRank }));
    out.outputArguments = declared.outputArguments.map((a) => ({ name: a.name, dataType: DataType[a.dataType.value],
      valueRank: a.valueRank }));
    const values = JSON.parse(input);
    const inputArguments = declared.inputArguments.map((a) => ({ dataType: a.dataType.value, value: values[a.name] }));
    const res = await session.call({ objectId, methodId: typeMethod, inputArguments });
    out.status = res.statusCode.name;
    out.outputs = (res.outputArguments || []).map((v, i) => ({
      name: declared.outputArguments[i].name, dataType: DataType[v.dataType], value: v.value,
    }));
    out.securityMode = MessageSecurityMode[client.securityMode];
    return out;
  });
}

printResult(main);
