// What every node-opcua test script shares: a client on the appliance's endpoint (SignAndEncrypt, Basic256Sha256,
// its certificate from PKI_DIR's certificate manager), a session with that certificate as X509 user identity, the
// teardown in order (session, then client), and the one JSON line a script prints ({error} and exit 1 on failure).
"use strict";
const fs = require("fs");
const { OPCUAClient, MessageSecurityMode, SecurityPolicy, UserTokenType } = require("node-opcua-client");
const { OPCUACertificateManager } = require("node-opcua-certificate-manager");

// A PEM certificate's DER bytes (what an X509 identity token carries).
function pemToDer(certFile) {
  const pem = fs.readFileSync(certFile, "utf8");
  return Buffer.from(pem.replace(/-----[^-]+-----/g, "").replace(/\s+/g, ""), "base64");
}

// Connects, opens a session as the certificate's user, runs body(session, client) and closes both whatever happens;
// resolves to body's result. trustUnknownServer: false checks the server's certificate against PKI_DIR's trust list.
async function withSession({ endpoint, certFile, keyFile, applicationUri, pkiDir, applicationName,
  trustUnknownServer = true }, body) {
  const certificateManager = new OPCUACertificateManager({
    rootFolder: pkiDir, automaticallyAcceptUnknownCertificate: trustUnknownServer });
  await certificateManager.initialize();
  const client = OPCUAClient.create({
    applicationName, applicationUri,
    securityMode: MessageSecurityMode.SignAndEncrypt, securityPolicy: SecurityPolicy.Basic256Sha256,
    certificateFile: certFile, privateKeyFile: keyFile, clientCertificateManager: certificateManager,
    endpointMustExist: false, connectionStrategy: { maxRetry: 0, initialDelay: 100 },
  });
  await client.connect(endpoint);
  try {
    const session = await client.createSession({
      type: UserTokenType.Certificate, certificateData: pemToDer(certFile),
      privateKey: fs.readFileSync(keyFile, "utf8"),
    });
    try {
      return await body(session, client);
    } finally {
      await session.close();
    }
  } finally {
    await client.disconnect();
  }
}

// Runs main() and prints its result as one JSON line; a failure prints {"error": message} and exits 1.
function printResult(main) {
  main().then((out) => console.log(JSON.stringify(out))).catch((err) => {
    console.log(JSON.stringify({ error: String(err && err.message || err) }));
    process.exit(1);
  });
}

module.exports = { pemToDer, withSession, printResult };
