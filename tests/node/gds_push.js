// Part 12 push certificate management from an independent stack (node-opcua), the way a GDS's push view does it:
// the standard methods called by their namespace-0 NodeIds, the TrustList read and written as a file
// (TrustListDataType, UA Binary). SignAndEncrypt / Basic256Sha256; the client certificate is the application
// certificate and the X509 user identity (a security_admin). Prints one JSON line with the outcome.
// usage: node gds_push.js STEP ENDPOINT CERT.pem KEY.pem APPLICATION_URI PKI_DIR [ARGS...]
//   csr OUT.der                       CreateSigningRequest for the server's key -> OUT.der
//   update CERT.der ISSUER.der        UpdateCertificate, then ApplyChanges
//   remove-trusted THUMBPRINT         read the TrustList, drop that certificate, write it back, CloseAndUpdate
//   connect                           connect with PKI_DIR as the only trust (no unknown certificate accepted)
//   get-certificates                  GetCertificates (Part 12 1.05) for the DefaultApplicationGroup: the
//                                     certificate types and the SHA-1 thumbprints of the certificates (called by
//                                     NodeId through session.call: node-opcua-server-configuration's push client,
//                                     2.157.0 the only one on the registry, has no getCertificates)
"use strict";
const fs = require("fs");
const crypto = require("crypto");
const { DataType, VariantArrayType, resolveNodeId } = require("node-opcua-client");
const { TrustListDataType } = require("node-opcua-types");
const { BinaryStream } = require("node-opcua-binary-stream");
const { split_der } = require("node-opcua-crypto");
const { withSession, printResult } = require("./common");

const SERVER_CONFIGURATION = "ns=0;i=12637";
const TRUST_LIST = "ns=0;i=12642";
const M = {
  CreateSigningRequest: "ns=0;i=12737", UpdateCertificate: "ns=0;i=13737", ApplyChanges: "ns=0;i=12740",
  Open: "ns=0;i=12647", Close: "ns=0;i=12650", Read: "ns=0;i=12652", Write: "ns=0;i=12655",
  CloseAndUpdate: "ns=0;i=12666", GetCertificates: "ns=0;i=32333",
};
const GROUP = resolveNodeId("ns=0;i=14156");
const CERT_TYPE = resolveNodeId("ns=0;i=12560");

async function call(session, objectId, methodId, inputArguments) {
  const res = await session.call({ objectId, methodId, inputArguments });
  return { status: res.statusCode.name, outputs: (res.outputArguments || []).map((v) => v.value) };
}

async function readTrustList(session) {
  const open = await call(session, TRUST_LIST, M.Open, [{ dataType: DataType.Byte, value: 1 }]);
  if (open.status !== "Good") throw new Error(`Open: ${open.status}`);
  const handle = open.outputs[0];
  const parts = [];
  for (;;) {
    const r = await call(session, TRUST_LIST, M.Read, [
      { dataType: DataType.UInt32, value: handle }, { dataType: DataType.Int32, value: 4096 }]);
    if (r.status !== "Good") throw new Error(`Read: ${r.status}`);
    if (!r.outputs[0] || r.outputs[0].length === 0) break;
    parts.push(r.outputs[0]);
  }
  await call(session, TRUST_LIST, M.Close, [{ dataType: DataType.UInt32, value: handle }]);
  const trustList = new TrustListDataType();
  trustList.decode(new BinaryStream(Buffer.concat(parts)));
  return trustList;
}

async function writeTrustList(session, trustList) {
  const stream = new BinaryStream(trustList.binaryStoreSize());
  trustList.encode(stream);
  const data = stream.buffer;
  const open = await call(session, TRUST_LIST, M.Open, [{ dataType: DataType.Byte, value: 6 }]);
  if (open.status !== "Good") return { open: open.status };
  const handle = open.outputs[0];
  for (let start = 0; start < data.length; start += 1000) {
    const w = await call(session, TRUST_LIST, M.Write, [
      { dataType: DataType.UInt32, value: handle }, { dataType: DataType.ByteString, value: data.subarray(start, start + 1000) }]);
    if (w.status !== "Good") return { write: w.status };
  }
  return call(session, TRUST_LIST, M.CloseAndUpdate, [{ dataType: DataType.UInt32, value: handle }]);
}

const thumb = (buf) => crypto.createHash("sha1").update(buf).digest("hex");

async function main() {
  const [step, endpoint, certFile, keyFile, applicationUri, pkiDir, ...rest] = process.argv.slice(2);
  // connect: PKI_DIR is the only trust, no unknown server certificate accepted
  const settings = { endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName: "node-opcua GDS push",
    trustUnknownServer: step !== "connect" };
  return withSession(settings, async (session, client) => {
    const out = { step };
    if (step === "csr") {
      const r = await call(session, SERVER_CONFIGURATION, M.CreateSigningRequest, [
        { dataType: DataType.NodeId, value: GROUP }, { dataType: DataType.NodeId, value: CERT_TYPE },
        { dataType: DataType.String, value: "" }, { dataType: DataType.Boolean, value: false },
        { dataType: DataType.ByteString, value: crypto.randomBytes(32) }]);
      out.status = r.status;
      if (r.status === "Good") fs.writeFileSync(rest[0], r.outputs[0]);
    } else if (step === "update") {
      const [certDer, issuerDer] = rest;
      const r = await call(session, SERVER_CONFIGURATION, M.UpdateCertificate, [
        { dataType: DataType.NodeId, value: GROUP }, { dataType: DataType.NodeId, value: CERT_TYPE },
        { dataType: DataType.ByteString, value: fs.readFileSync(certDer) },
        { dataType: DataType.ByteString, arrayType: VariantArrayType.Array, value: [fs.readFileSync(issuerDer)] },
        { dataType: DataType.String, value: "" }, { dataType: DataType.ByteString, value: null }]);
      out.update = r.status;
      out.applyChangesRequired = r.outputs[0];
      out.apply = (await call(session, SERVER_CONFIGURATION, M.ApplyChanges, [])).status;
    } else if (step === "remove-trusted") {
      const trustList = await readTrustList(session);
      out.before = trustList.trustedCertificates.map(thumb);
      trustList.trustedCertificates = trustList.trustedCertificates.filter((c) => thumb(c) !== rest[0]);
      const r = await writeTrustList(session, trustList);
      out.status = r.status || JSON.stringify(r);
      out.applyChangesRequired = r.outputs ? r.outputs[0] : null;
      out.after = (await readTrustList(session)).trustedCertificates.map(thumb);
    } else if (step === "get-certificates") {
      const r = await call(session, SERVER_CONFIGURATION, M.GetCertificates, [
        { dataType: DataType.NodeId, value: GROUP }]);
      out.status = r.status;
      if (r.status === "Good") {
        out.certificateTypes = r.outputs[0].map((n) => n.toString());
        out.certificates = r.outputs[1].map(thumb);
      }
    } else if (step === "connect") {
      out.status = "Good";
    }
    // the server certificate of this connection's endpoint (the leaf of the chain it presented)
    out.serverCertificate = client.serverCertificate ? thumb(split_der(client.serverCertificate)[0]) : null;
    return out;
  });
}

printResult(main);
