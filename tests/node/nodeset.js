// node-opcua's side of the information model, given only the exported NodeSet2 file (and, to call, an endpoint).
//   node nodeset.js load FILE [STANDARD]
//       loads the standard nodeset (node-opcua's, or the file STANDARD: an older one, e.g. 1.04) and FILE into a
//       node-opcua address space; prints one JSON line describing every node of the appliance namespace (NodeId,
//       BrowseName, class, type definition, data type, method arguments)
//   node nodeset.js call FILE ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR
//       finds the model types and their methods in FILE, then connects (SignAndEncrypt, the certificate as X509
//       user), finds every model on the server by its type definition and calls Infer, Classify and Generate
//       through the TYPE's method NodeIds with the model as ObjectId; prints one JSON line with the outcomes
"use strict";
const { AddressSpace } = require("node-opcua-address-space");
const { NodeClass } = require("node-opcua-data-model");
const { generateAddressSpace } = require("node-opcua-address-space/nodeJS");
const { nodesets } = require("node-opcua-nodesets");

const URI = "urn:opcua-inference-appliance";
const ID = (nodeId) => nodeId.toString().replace(/^ns=\d+;/, "");  // namespace-free: indexes differ per stack

async function loadFile(file, standard) {
  const addressSpace = AddressSpace.create();
  await generateAddressSpace(addressSpace, [standard || nodesets.standard, file]);
  return addressSpace;
}

function args(list) {
  return list.map((a) => ({
    name: a.name, dataType: a.dataType.toString(), valueRank: a.valueRank,
    arrayDimensions: a.arrayDimensions ? Array.from(a.arrayDimensions) : [],
    description: a.description ? a.description.text || "" : "",
  }));
}

async function load(file, standard) {
  const addressSpace = await loadFile(file, standard);
  const namespace = addressSpace.getNamespace(URI);
  const nodes = [];
  for (const node of namespace.nodeIterator()) {
    const entry = { nodeId: ID(node.nodeId), browseName: node.browseName.name, nodeClass: NodeClass[node.nodeClass] };
    if (node.typeDefinition) entry.typeDefinition = node.typeDefinition.toString();
    if (node.nodeClass === NodeClass.Variable) entry.dataType = node.dataType.toString();
    if (node.nodeClass === NodeClass.ObjectType && node.subtypeOf) entry.subtypeOf = node.subtypeOf.toString();
    if (node.nodeClass === NodeClass.Method) {
      entry.inputArguments = args(node.getInputArguments());
      entry.outputArguments = args(node.getOutputArguments());
    }
    nodes.push(entry);
  }
  addressSpace.dispose();
  console.log(JSON.stringify({ nodes }));
}

async function call(file, endpoint, certFile, keyFile, applicationUri, pkiDir) {
  // From the file: the model types (every subtype of ModelType) and the NodeId of each method they declare.
  const addressSpace = await loadFile(file);
  const namespace = addressSpace.getNamespace(URI);
  const typeByName = {};
  for (const node of namespace.nodeIterator()) {
    if (node.nodeClass === NodeClass.ObjectType) typeByName[node.browseName.name] = node;
  }
  const modelType = typeByName.ModelType;
  const methodOfType = (type, name) => {  // declared on the type or inherited from a supertype
    for (let t = type; t; t = t.subtypeOfObj) {
      const m = t.getMethodByName(name);
      if (m) return ID(m.nodeId);
    }
    return null;
  };
  const types = {};  // type NodeId (namespace-free) -> {name, methods}
  for (const [name, type] of Object.entries(typeByName)) {
    if (type.isSubtypeOf(modelType) && type !== modelType) {
      types[ID(type.nodeId)] = { name, infer: methodOfType(type, "Infer"), classify: methodOfType(type, "Classify"),
        generate: methodOfType(type, "Generate") };
    }
  }
  const modelsFolder = [...namespace.nodeIterator()].find((n) => n.browseName.name === "Models" &&
    n.nodeClass === NodeClass.Object && n.typeDefinitionObj && n.typeDefinitionObj.browseName.name === "FolderType"
    && n.parent && n.parent.browseName.name === "Appliance" && !ID(n.nodeId).startsWith("s=Types/"));
  const foldersId = ID(modelsFolder.nodeId);
  addressSpace.dispose();

  const { DataType, VariantArrayType, BrowseDirection, NodeClassMask, makeBrowsePath } = require("node-opcua-client");
  const { withSession } = require("./common");
  const out = { types: Object.values(types).map((t) => t.name), modelsFolder: foldersId, browsed: [], models: [] };
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir,
    applicationName: "node-opcua nodeset test client" };
  await withSession(settings, async (session) => {
    const ns = (await session.readNamespaceArray()).indexOf(URI);
    const full = (id) => `ns=${ns};${id}`;
    const children = await session.browse({ nodeId: full(foldersId), browseDirection: BrowseDirection.Forward,
      referenceTypeId: "HierarchicalReferences", includeSubtypes: true, nodeClassMask: NodeClassMask.Object,
      resultMask: 63 });
    for (const ref of children.references) {
      out.browsed.push([ref.browseName.name, ref.typeDefinition.toString()]);
      const type = types[ID(ref.typeDefinition)];
      if (!type) continue;  // not a model
      const model = { name: ref.browseName.name, type: type.name, calls: {} };
      const objectId = ref.nodeId;
      if (type.infer) {
        const shape = await session.translateBrowsePath(makeBrowsePath(objectId, `/${ns}:InputShape`));
        const dims = (await session.read({ nodeId: shape.targets[0].targetId, attributeId: 13 })).value.value;
        const n = Array.from(dims).reduce((a, b) => a * b, 1);
        const input = [{ dataType: DataType.Float, arrayType: VariantArrayType.Array, value: new Float32Array(n) }];
        for (const [key, method] of [["Infer", type.infer], ["Classify", type.classify]]) {
          if (!method) continue;
          const res = await session.call({ objectId, methodId: full(method), inputArguments: input });
          model.calls[key] = { methodId: method, status: res.statusCode.name,
            outputs: res.outputArguments.map((v) => (v.arrayType ? Array.from(v.value).length : v.value)) };
        }
      }
      if (type.generate) {
        const res = await session.call({ objectId, methodId: full(type.generate), inputArguments: [
          { dataType: DataType.String, value: "Hello" }, { dataType: DataType.UInt32, value: 4 },
          { dataType: DataType.Float, value: 0 }] });
        model.calls.Generate = { methodId: type.generate, status: res.statusCode.name,
          outputs: res.outputArguments.map((v) => v.value) };
      }
      out.models.push(model);
    }
  });
  console.log(JSON.stringify(out));
}

const [mode, ...rest] = process.argv.slice(2);
(mode === "load" ? load(rest[0], rest[1]) : call(...rest)).catch((e) => { console.error(e); process.exit(1); });
