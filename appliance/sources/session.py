"""One connection to a source server, as the client process and `appliance sources test | trust` make it:
the server's certificate checked against the one trusted explicitly, SignAndEncrypt (or what the YAML says) with the
appliance's client certificate for that source, an optional user name, the client's decode limits, and every node
resolved by namespace URI or browse path (again after every reconnect: a reloaded PLC may renumber namespaces).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncua import Client, ua
from asyncua.crypto import security_policies

from . import protocol as p
from .identity import leaf_of

POLICIES = {
    "Basic256Sha256": security_policies.SecurityPolicyBasic256Sha256,
    "Aes128_Sha256_RsaOaep": security_policies.SecurityPolicyAes128Sha256RsaOaep,
    "Aes256_Sha256_RsaPss": security_policies.SecurityPolicyAes256Sha256RsaPss,
}
POLICY_URIS = {**{name: cls.URI for name, cls in POLICIES.items()},
               "None": "http://opcfoundation.org/UA/SecurityPolicy#None"}
ID_TYPES = {"s": ua.NodeIdType.String, "i": ua.NodeIdType.Numeric, "g": ua.NodeIdType.Guid,
            "b": ua.NodeIdType.ByteString}


class SourceProblem(Exception):
    """Why a source cannot be used now; `state` is what Sources/<name>/State shows meanwhile."""

    def __init__(self, message: str, state: str = "Connecting"):
        super().__init__(message)
        self.state = state


async def server_certificate(spec: p.SourceSpec) -> bytes:
    """The certificate of the server's endpoint with the configured policy and mode (GetEndpoints, which needs no
    security), as DER (its leaf, when the server sends a chain)."""
    client = Client(spec.endpoint, timeout=spec.timeout_s)
    try:
        endpoints = await asyncio.wait_for(client.connect_and_get_server_endpoints(), spec.timeout_s * 2)
    except (OSError, asyncio.TimeoutError, ua.UaError) as e:
        raise SourceProblem(f"the server does not answer at {spec.endpoint}: {_why(e)}") from None
    mode = getattr(ua.MessageSecurityMode, spec.mode)
    for ep in endpoints:
        if ep.SecurityPolicyUri == POLICY_URIS[spec.policy] and ep.SecurityMode == mode:
            return leaf_of(ep.ServerCertificate) if ep.ServerCertificate else b""
    offered = ", ".join(sorted({f"{ep.SecurityPolicyUri.rsplit('#', 1)[-1]}/{ep.SecurityMode.name}"
                                for ep in endpoints}))
    raise SourceProblem(f"the server offers no endpoint with {spec.policy}/{spec.mode} (it offers {offered})")


def check_trusted(spec: p.SourceSpec, presented: bytes) -> None:
    """Refused unless the presented certificate is the one `appliance sources trust` stored."""
    from certs.x509io import thumbprint
    if spec.policy == "None":
        return
    try:  # read at every attempt: a certificate trusted while serve runs counts from the next attempt on
        with open(spec.trusted_cert, "rb") as f:
            trusted = leaf_of(f.read())
    except FileNotFoundError:
        raise SourceProblem(f"the server's certificate (thumbprint {thumbprint(presented)}) is not trusted: "
                            f"check it and run `appliance sources trust {spec.name}`", "Refused") from None
    except OSError:
        raise SourceProblem("the trusted certificate of this source cannot be read", "Refused") from None
    if presented != trusted:
        raise SourceProblem(f"the server presents another certificate (thumbprint {thumbprint(presented)}) than the "
                            f"one trusted ({thumbprint(trusted)}): refused; if the change is expected, check it and "
                            f"run `appliance sources trust {spec.name}` again", "Refused")


async def connect(spec: p.SourceSpec, on_violation: Callable[[str], None] = lambda reason: None,
                  check_certificate: bool = True) -> Client:
    """A connected, activated client (the caller disconnects it); SourceProblem when it cannot be had."""
    from .asyncua_internals import limit_client_receive
    if check_certificate:
        check_trusted(spec, await server_certificate(spec))
    client = Client(spec.endpoint, timeout=spec.timeout_s, watchdog_intervall=max(1.0, spec.timeout_s))
    client.max_messagesize, client.max_chunkcount = spec.max_message_size, spec.max_chunk_count
    client.session_timeout = 60_000
    client.name = client.description = "OPC UA Inference Appliance (sources)"
    if spec.policy != "None":
        from appliance.client import certificate_uri
        client.application_uri = certificate_uri(spec.client_cert)
        await client.set_security(POLICIES[spec.policy], spec.client_cert, spec.client_key,
                                  server_certificate=spec.trusted_cert, mode=getattr(ua.MessageSecurityMode, spec.mode))
    if spec.user:
        client.set_user(spec.user)
        client.set_password(spec.password)
    try:
        await asyncio.wait_for(client.connect(), spec.timeout_s * 3)
    except asyncio.TimeoutError:
        await _quiet_disconnect(client)
        raise SourceProblem(f"the server did not open a session within {spec.timeout_s * 3:g} s") from None
    except ua.UaStatusCodeError as e:
        await _quiet_disconnect(client)
        state = "Refused" if "Certificate" in type(e).__name__ or "Security" in type(e).__name__ else "Connecting"
        raise SourceProblem(f"the server refused the session: {_why(e)}", state) from None
    except (OSError, ua.UaError) as e:
        await _quiet_disconnect(client)
        raise SourceProblem(f"the connection failed: {_why(e)}") from None
    limit_client_receive(client, spec.max_message_size, spec.max_chunk_count, on_violation)
    return client


async def resolve(client: Client, spec: p.SourceSpec, nodes: list[p.NodeSpec] | None = None) -> list[ua.NodeId]:
    """Every node's NodeId now (namespace URIs looked up in the server's NamespaceArray); SourceProblem naming the
    first node that cannot be found. nodes: these instead of the source's nodes (its write-back NodeIds)."""
    nodes = spec.nodes if nodes is None else nodes
    try:
        namespaces = await client.get_namespace_array()
    except (OSError, asyncio.TimeoutError, ua.UaError) as e:
        raise SourceProblem(f"cannot read the server's NamespaceArray: {_why(e)}") from None

    def index(uri: str, node: p.NodeSpec) -> int:
        if uri not in namespaces:
            raise SourceProblem(f"node {node.name}: the server has no namespace {uri!r}")
        return namespaces.index(uri)

    resolved: list[ua.NodeId | None] = [None] * len(nodes)
    paths = []
    for i, node in enumerate(nodes):
        if node.path:
            rel = ua.RelativePath()
            for uri, name in node.path:
                el = ua.RelativePathElement()
                el.ReferenceTypeId = ua.NodeId(ua.ObjectIds.HierarchicalReferences)
                el.IncludeSubtypes, el.IsInverse = True, False
                el.TargetName = ua.QualifiedName(name, index(uri, node))
                rel.Elements.append(el)
            paths.append((i, rel))
        else:
            ident = int(node.identifier) if node.kind == "i" else node.identifier
            if node.kind == "g":
                import uuid
                ident = uuid.UUID(node.identifier)
            elif node.kind == "b":
                import base64
                ident = base64.b64decode(node.identifier)
            resolved[i] = ua.NodeId(ident, index(node.uri, node), ID_TYPES[node.kind])
    if paths:
        results = await client.translate_browsepaths(client.nodes.objects.nodeid, [rel for _, rel in paths])
        for (i, _), result in zip(paths, results):
            if not result.StatusCode.is_good() or not result.Targets:
                raise SourceProblem(f"node {nodes[i].name}: browse path "
                                    f"{'/'.join(n for _, n in nodes[i].path)} not found "
                                    f"({result.StatusCode.name})")
            target = result.Targets[0].TargetId  # an ExpandedNodeId of this server
            resolved[i] = ua.NodeId(target.Identifier, target.NamespaceIndex, target.NodeIdType)
    return resolved


async def read_once(client: Client, spec: p.SourceSpec, nodeids: list[ua.NodeId]) -> list[ua.DataValue]:
    """The Value of every node, read once; SourceProblem naming a node the server does not know."""
    params = ua.ReadParameters()
    for nodeid in nodeids:
        rv = ua.ReadValueId()
        rv.NodeId, rv.AttributeId = nodeid, ua.AttributeIds.Value
        params.NodesToRead.append(rv)
    values = await client.uaclient.read(params)
    for node, dv in zip(spec.nodes, values):
        if dv.StatusCode is not None and dv.StatusCode.value in (ua.StatusCodes.BadNodeIdUnknown,
                                                                  ua.StatusCodes.BadNodeIdInvalid,
                                                                  ua.StatusCodes.BadAttributeIdInvalid):
            raise SourceProblem(f"node {node.name} ({_ref(node)}) not found: {dv.StatusCode.name}")
        check_size(spec, node.name, dv.Value.Value if dv.Value is not None else None)
    return values


def check_size(spec: p.SourceSpec, node: str, value) -> None:
    """The client's own decode limits on a value (beside the transport's message size and chunk count)."""
    if isinstance(value, (list, tuple)) and len(value) > spec.max_array_length:
        raise SourceProblem(f"node {node}: an array of {len(value)} values, more than max_array_length "
                            f"{spec.max_array_length}: disconnected")
    if isinstance(value, (str, bytes)) and len(value) > spec.max_string_length:
        raise SourceProblem(f"node {node}: a string of {len(value)} characters, more than max_string_length "
                            f"{spec.max_string_length}: disconnected")


def _ref(node: p.NodeSpec) -> str:
    return "/".join(f"nsu={u};{n}" for u, n in node.path) if node.path else \
        f"nsu={node.uri};{node.kind}={node.identifier}"


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _quiet_disconnect(client: Client) -> None:
    try:
        await asyncio.wait_for(client.disconnect(), 2)
    except Exception:  # noqa: BLE001 - the connection failed already; closing what is left must not hide that
        pass
