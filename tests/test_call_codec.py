"""The Call service's codec in uaserver/asyncua_internals/decoding.py against asyncua's own codec: the same objects from the same bytes, the same bytes from the
same answers, over many shapes (the real server's calls go through it in every tests/test_ua_*.py)."""
from __future__ import annotations

import datetime
import random
import uuid

import numpy as np
import pytest
from asyncua import ua
from asyncua.common.utils import Buffer
from asyncua.common.utils import NotEnoughData
from asyncua.ua.ua_binary import nodeid_from_binary, nodeid_to_binary, struct_from_binary, struct_to_binary

from uaserver.asyncua_internals import call_parameters_from_binary, request_header_from_binary, response_to_binary
from uaserver.asyncua_internals.decoding import _NODEID_CACHE_SIZE, _nodeids, cached_nodeid_from_binary

V = ua.VariantType


def random_node(rng: random.Random) -> ua.NodeId:
    kind = rng.randrange(5)
    if kind == 0:
        return ua.NodeId(rng.randrange(256), 0, ua.NodeIdType.TwoByte)
    if kind == 1:
        return ua.NodeId(rng.randrange(2**32), rng.randrange(1, 5), ua.NodeIdType.Numeric)
    if kind == 2:
        return ua.NodeId(rng.randbytes(32), 0, ua.NodeIdType.ByteString)
    if kind == 3:
        return ua.NodeId(uuid.UUID(int=rng.getrandbits(128)), 1, ua.NodeIdType.Guid)
    return ua.NodeId(f"ns-ü-{rng.randrange(1000)}", 2, ua.NodeIdType.String)


def test_node_ids_decode_as_asyncua_does_the_first_time_and_from_the_cache_after():
    rng = random.Random(7)
    nodes = [random_node(rng) for _ in range(300)]
    nodes += [ua.NodeId("x" * 300, 2), ua.NodeId(b"", 0, ua.NodeIdType.ByteString),
              ua.NodeId(70000, 0, ua.NodeIdType.Numeric), ua.NodeId(5, 1, ua.NodeIdType.FourByte),
              ua.ExpandedNodeId(5, 1, ua.NodeIdType.FourByte, NamespaceUri="urn:x"),
              ua.ExpandedNodeId(9, 0, ua.NodeIdType.TwoByte, ServerIndex=3)]
    for node in nodes * 2:  # the second round from the cache
        data = nodeid_to_binary(node) + b"rest"
        ours, theirs = Buffer(data), Buffer(data)
        decoded = cached_nodeid_from_binary(ours)
        assert decoded == nodeid_from_binary(theirs) and type(decoded) is type(node)
        assert ours.read(4) == theirs.read(4) == b"rest"


def test_node_id_cache_is_bounded_and_truncated_ids_fail_as_in_asyncua():
    for i in range(3 * _NODEID_CACHE_SIZE):
        assert cached_nodeid_from_binary(Buffer(nodeid_to_binary(ua.NodeId(f"n{i}", 2)))) == ua.NodeId(f"n{i}", 2)
    assert len(_nodeids) <= _NODEID_CACHE_SIZE
    for node in (ua.NodeId("abc", 2), ua.NodeId(70000, 0, ua.NodeIdType.Numeric), ua.NodeId(5, 1, ua.NodeIdType.FourByte)):
        whole = nodeid_to_binary(node)
        cached_nodeid_from_binary(Buffer(whole))
        for cut in range(len(whole)):
            with pytest.raises(NotEnoughData):
                cached_nodeid_from_binary(Buffer(whole[:cut]))
    null_string = b"\x03\x01\x00\xff\xff\xff\xff"  # a String NodeId without a string: asyncua refuses it, every time
    for _ in range(2):
        with pytest.raises(ua.UaError):
            cached_nodeid_from_binary(Buffer(null_string))


def random_header(rng: random.Random) -> ua.RequestHeader:
    h = ua.RequestHeader()
    h.AuthenticationToken = random_node(rng)
    h.Timestamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(
        microseconds=rng.randrange(10**12))
    h.RequestHandle, h.ReturnDiagnostics, h.TimeoutHint = (rng.randrange(2**32) for _ in range(3))
    h.AuditEntryId = rng.choice([None, "", "plc-7", "ü" * 70])
    if rng.random() < 0.3:
        # a type no one registered (namespace 3): kept as the raw ExtensionObject by both decoders
        h.AdditionalHeader = ua.ExtensionObject(ua.NodeId(rng.randrange(1, 9999), 3), rng.randbytes(rng.randrange(9)))
    return h


@pytest.mark.parametrize("seed", range(200))
def test_request_header_decodes_as_asyncua_does(seed):
    data = struct_to_binary(random_header(random.Random(seed))) + b"rest"
    ours, theirs = Buffer(data), Buffer(data)
    assert request_header_from_binary(ours) == struct_from_binary(ua.RequestHeader, theirs)
    assert ours.read(4) == theirs.read(4) == b"rest"


def random_variant(rng: random.Random) -> ua.Variant:
    kind = rng.randrange(8)
    if kind == 0:
        return ua.Variant([rng.random() for _ in range(rng.randrange(30))], V.Float)
    if kind == 1:
        return ua.Variant(f"sha256:{rng.randrange(10**9)}-ü", V.String)
    if kind == 2:
        return ua.Variant(rng.random() < 0.5, V.Boolean)
    if kind == 3:
        return ua.Variant([rng.randrange(-99, 99) for _ in range(rng.randrange(5))], V.Int32)
    if kind == 4:
        return ua.Variant(rng.randrange(2**32), V.UInt32)
    if kind == 5:
        return ua.Variant(["a", "", "ü"][: rng.randrange(4)], V.String)
    if kind == 6:
        return ua.Variant(None, V.String)
    return ua.Variant(rng.random(), V.Float)


def random_response(rng: random.Random) -> ua.CallResponse:
    r = ua.CallResponse()
    r.ResponseHeader.RequestHandle = rng.randrange(2**32)
    r.ResponseHeader.ServiceResult = ua.StatusCode(rng.choice([0, ua.StatusCodes.BadTooManyOperations]))
    for _ in range(rng.randrange(4)):
        m = ua.CallMethodResult()
        m.StatusCode = ua.StatusCode(rng.choice([0, ua.StatusCodes.BadInvalidArgument, ua.StatusCodes.BadInternalError]))
        m.InputArgumentResults = [ua.StatusCode(rng.choice([0, ua.StatusCodes.BadTypeMismatch]))
                                  for _ in range(rng.randrange(3))]
        m.OutputArguments = [random_variant(rng) for _ in range(rng.randrange(7))]
        r.Results.append(m)
    return r


@pytest.mark.parametrize("seed", range(200))
def test_a_call_answer_encodes_as_asyncua_does(seed):
    response = random_response(random.Random(seed))
    assert response_to_binary(response) == struct_to_binary(response)


def test_answers_with_diagnostics_or_other_services_go_to_asyncua():
    response = random_response(random.Random(1))
    response.ResponseHeader.StringTable = ["x"]
    response.DiagnosticInfos = [ua.DiagnosticInfo(SymbolicId=3)]
    assert response_to_binary(response) == struct_to_binary(response)
    response = random_response(random.Random(2))
    response.ResponseHeader.ServiceDiagnostics = ua.DiagnosticInfo(AdditionalInfo="why")
    assert response_to_binary(response) == struct_to_binary(response)
    read = ua.ReadResponse()
    read.Results = [ua.DataValue(ua.Variant(1.5, V.Double))]
    assert response_to_binary(read) == struct_to_binary(read)


def test_float_arguments_arrive_as_arrays_and_the_rest_as_asyncua_decodes_them():
    params = ua.CallParameters()
    item = ua.CallMethodRequest()
    item.ObjectId, item.MethodId = ua.NodeId(5, 2), ua.NodeId("Infer", 2)
    samples = [0.5, -1.25, 3.0]
    item.InputArguments = [ua.Variant(samples, V.Float), ua.Variant(samples, V.Double), ua.Variant("p", V.String),
                           ua.Variant(7, V.UInt32), ua.Variant([[1.0, 2.0], [3.0, 4.0]], V.Float)]
    params.MethodsToCall.append(item)
    data = struct_to_binary(params)
    ours, theirs = call_parameters_from_binary(Buffer(data)), struct_from_binary(ua.CallParameters, Buffer(data))
    got, expected = ours.MethodsToCall[0].InputArguments, theirs.MethodsToCall[0].InputArguments
    assert isinstance(got[0].Value, np.ndarray) and got[0].Value.dtype == np.float32
    assert isinstance(got[1].Value, np.ndarray) and got[1].Value.dtype == np.float64
    for a, b in zip(got[:2], expected[:2]):
        assert a.VariantType == b.VariantType and a.Value.tolist() == b.Value
    assert got[2:] == expected[2:]  # other types, and a matrix (with dimensions), decoded by asyncua
    assert ours.MethodsToCall[0].ObjectId == item.ObjectId and ours.MethodsToCall[0].MethodId == item.MethodId
