"""What a Global Discovery Server does to the appliance in the tests: its own CA (not the appliance's), signing a
server's certificate request, the Part 12 calls by NodeId from an asyncua client, the TrustList read and written as
a file."""
from __future__ import annotations

import contextlib
from datetime import datetime, timedelta, timezone
from pathlib import Path

from asyncua import Client, ua
from asyncua.crypto import security_policies
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary
from asyncua.common.utils import Buffer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs.builder import APPLICATION_KEY_USAGE
from certificates import MadeCertificate, make_test_certificate

O = ua.ObjectIds
SERVER_CONFIGURATION = ua.NodeId(O.ServerConfiguration)
TRUST_LIST = ua.NodeId(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
GROUP = ua.NodeId(O.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERT_TYPE = ua.NodeId(O.RsaSha256ApplicationCertificateType)
TL = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_"


def method(name: str) -> ua.NodeId:
    """A method of ServerConfiguration or its TrustList, by its instance NodeId."""
    if hasattr(O, f"ServerConfiguration_{name}"):
        return ua.NodeId(getattr(O, f"ServerConfiguration_{name}"))
    return ua.NodeId(getattr(O, TL + name))


def plant_ca(name: str = "Plant CA") -> MadeCertificate:
    return make_test_certificate(name, is_ca=True, application_uri=None, key_bits=2048)


def sign_request(ca: MadeCertificate, csr_der: bytes, *, days: float = 365, not_before: datetime | None = None,
                 san: x509.SubjectAlternativeName | None = None) -> bytes:
    """The GDS signs a server's PKCS#10 request with its CA: the subject and SubjectAltName asked for."""
    csr = x509.load_der_x509_csr(csr_der)
    assert csr.is_signature_valid
    requested = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    now = datetime.now(timezone.utc)
    start = not_before or now - timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca.cert.subject)
            .public_key(csr.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(APPLICATION_KEY_USAGE, critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(san or requested, critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(csr.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


async def call(client: Client, obj: ua.NodeId, method_id: ua.NodeId, *args: ua.Variant) -> ua.CallMethodResult:
    request = ua.CallMethodRequest()
    request.ObjectId, request.MethodId, request.InputArguments = obj, method_id, list(args)
    return (await client.uaclient.call([request]))[0]


def outputs(res: ua.CallMethodResult) -> list:
    return [v.Value for v in res.OutputArguments]


def nodeid(value: ua.NodeId) -> ua.Variant:
    return ua.Variant(value, ua.VariantType.NodeId)


def byte_string(value: bytes) -> ua.Variant:
    return ua.Variant(value, ua.VariantType.ByteString)


def u32(value: int) -> ua.Variant:
    return ua.Variant(value, ua.VariantType.UInt32)


async def create_signing_request(client, subject: str = "", new_key: bool = False, nonce: bytes = b"") -> bytes:
    res = await call(client, SERVER_CONFIGURATION, method("CreateSigningRequest"), nodeid(GROUP), nodeid(CERT_TYPE),
                     ua.Variant(subject, ua.VariantType.String), ua.Variant(new_key, ua.VariantType.Boolean),
                     byte_string(nonce))
    assert res.StatusCode.is_good(), res.StatusCode
    return outputs(res)[0]


async def update_certificate(client, cert: bytes, issuers: list[bytes], key_format: str = "",
                             key: bytes = b"") -> ua.CallMethodResult:
    return await call(client, SERVER_CONFIGURATION, method("UpdateCertificate"), nodeid(GROUP), nodeid(CERT_TYPE),
                      byte_string(cert), ua.Variant(issuers, ua.VariantType.ByteString, is_array=True),
                      ua.Variant(key_format, ua.VariantType.String), byte_string(key))


async def read_trust_list(client, masks: int | None = None) -> ua.TrustListDataType:
    """Open (or OpenWithMasks), Read in 1 KiB pieces to the end, Close; the file decoded."""
    if masks is None:
        res = await call(client, TRUST_LIST, method("Open"), ua.Variant(1, ua.VariantType.Byte))
    else:
        res = await call(client, TRUST_LIST, method("OpenWithMasks"), u32(masks))
    assert res.StatusCode.is_good(), res.StatusCode
    handle = outputs(res)[0]
    data = b""
    while True:
        res = await call(client, TRUST_LIST, method("Read"), u32(handle), ua.Variant(1024, ua.VariantType.Int32))
        assert res.StatusCode.is_good(), res.StatusCode
        if not outputs(res)[0]:
            break
        data += outputs(res)[0]
    assert (await call(client, TRUST_LIST, method("Close"), u32(handle))).StatusCode.is_good()
    buffer = Buffer(data)
    value = struct_from_binary(ua.TrustListDataType, buffer)
    assert len(buffer) == 0
    return value


async def write_trust_list(client, data: bytes | ua.TrustListDataType, piece: int = 700) -> ua.CallMethodResult:
    """Open for Write + EraseExisting, Write in pieces, CloseAndUpdate: its result."""
    if isinstance(data, ua.TrustListDataType):
        data = struct_to_binary(data)
    res = await call(client, TRUST_LIST, method("Open"), ua.Variant(6, ua.VariantType.Byte))
    assert res.StatusCode.is_good(), res.StatusCode
    handle = outputs(res)[0]
    for start in range(0, len(data), piece):
        res = await call(client, TRUST_LIST, method("Write"), u32(handle), byte_string(data[start:start + piece]))
        assert res.StatusCode.is_good(), res.StatusCode
    return await call(client, TRUST_LIST, method("CloseAndUpdate"), u32(handle))


@contextlib.asynccontextmanager
async def plc_session(endpoint: str, app_cert: Path, app_key: Path, user_cert: Path, user_key: Path,
                      application_uri: str, trust_only: x509.Certificate | None = None):
    """A client with its own application certificate and a user certificate as identity; trust_only: it accepts
    the server only if this CA signed the server's certificate (a PLC that trusts one CA)."""
    client = Client(endpoint, timeout=10, watchdog_intervall=5.0)
    client.application_uri = application_uri
    await client.set_security(security_policies.SecurityPolicyBasic256Sha256, str(app_cert), str(app_key),
                              mode=ua.MessageSecurityMode.SignAndEncrypt)
    await client.load_client_certificate(str(user_cert))
    await client.load_private_key(str(user_key))
    if trust_only is not None:
        async def validate(cert: x509.Certificate, _description) -> None:
            try:
                cert.verify_directly_issued_by(trust_only)
            except Exception:  # noqa: BLE001 - any failure: not signed by the CA this client trusts
                raise ua.UaStatusCodeError(ua.StatusCodes.BadCertificateUntrusted) from None
        client.certificate_validator = validate
    await client.connect()
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.disconnect()
