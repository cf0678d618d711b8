"""End to end: a real appliance on loopback, real certificates, SignAndEncrypt, every status code of the contract's
method table reached through a real client call."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model, heavy_model, log_model
from uaclient import Events, arg_statuses, call, floats, read, run, session, status_name

V = ua.VariantType


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    d = tmp_path_factory.mktemp("ua_tensor")
    affine_model(d / "affine.onnx")
    log_model(d / "log.onnx")
    heavy_model(d / "heavy.onnx")
    (d / "broken.onnx").write_bytes(b"this is not an onnx file")
    models = {
        "affine": {"kind": "tensor", "path": str(d / "affine.onnx"), "max_samples": 8, "version": "v1"},
        "nanmodel": {"kind": "tensor", "path": str(d / "log.onnx")},
        "broken": {"kind": "tensor", "path": str(d / "broken.onnx")},
        # each batch takes several dense 1024 x 1024 matrix products: longer than the 150 ms deadline
        "slow": {"kind": "tensor", "path": str(d / "heavy.onnx"), "max_batch_size": 1, "max_queue_delay_ms": 0},
    }
    a = RunningAppliance(d / "state", models, {"engine": {"request_timeout_s": 0.15, "max_queue_size": 1}})
    a.operator = a.issue("plc1", "operator")
    a.monitor = a.issue("scada", "monitor")
    a.engineer = a.issue("eng", "engineer")
    yield a
    a.stop()


def test_infer_returns_outputs_and_version(app):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "affine", "Infer", [floats([1, 2, 3, 4, 0, 0, 0, 0.5])])
            assert status_name(r) == "Good"
            out, version = r.OutputArguments
            assert out.VariantType == V.Float
            assert np.allclose(out.Value, [3, 5, 7, 9, 1, 1, 1, 2])
            assert version.Value == "v1"
            # Double[] is accepted and converted
            r = await call(c, "affine", "Infer", [ua.Variant([1.0, 1.0, 1.0, 1.0], V.Double)])
            assert status_name(r) == "Good" and np.allclose(r.OutputArguments[0].Value, [3, 3, 3, 3])
    run(go())


@pytest.mark.parametrize("args, status, arg_status", [
    ([], "BadArgumentsMissing", None),
    ([floats([1] * 4), floats([1] * 4)], "BadTooManyArguments", None),
    ([ua.Variant([1, 2, 3, 4], V.Int32)], "BadInvalidArgument", "BadTypeMismatch"),
    ([ua.Variant(1.0, V.Float)], "BadInvalidArgument", "BadTypeMismatch"),
    ([ua.Variant("1,2,3,4", V.String)], "BadInvalidArgument", "BadTypeMismatch"),
    ([floats([1, 2, 3])], "BadInvalidArgument", "BadOutOfRange"),  # not a multiple of the sample size
    ([floats([1] * 4 * 9)], "BadInvalidArgument", "BadOutOfRange"),  # 9 samples > MaxSamples 8
    ([floats([1, math.nan, 3, 4])], "BadInvalidArgument", "BadOutOfRange"),
    ([floats([1, math.inf, 3, 4])], "BadInvalidArgument", "BadOutOfRange"),
])
def test_bad_arguments(app, args, status, arg_status):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "affine", "Infer", args)
            assert status_name(r) == status
            if arg_status:
                assert arg_statuses(r) == [arg_status] + ["Good"] * (len(args) - 1)
            # a rejected call leaves the session usable
            ok = await call(c, "affine", "Infer", [floats([0, 0, 0, 0])])
            assert status_name(ok) == "Good"
    run(go())


def test_roles(app):
    async def go():
        async with session(app, *app.monitor) as c:
            assert status_name(await call(c, "affine", "Infer", [floats([1] * 4)])) == "BadUserAccessDenied"
            assert await read(c, "Models", "affine", "Kind") == "tensor"  # but may read
        async with session(app, *app.operator) as c:
            r = await call(c, "", "ReloadModel", [ua.Variant("affine", V.String)])
            assert status_name(r) == "BadUserAccessDenied"
        async with session(app, *app.engineer) as c:
            r = await call(c, "", "ReloadModel", [ua.Variant("affine", V.String)])
            assert status_name(r) == "Good" and r.OutputArguments[0].Value == "v1"
            r = await call(c, "", "ReloadModel", [ua.Variant("nosuchmodel", V.String)])
            assert status_name(r) == "BadInvalidArgument"
            assert status_name(await call(c, "affine", "Infer", [floats([1] * 4)])) == "Good"
    run(go())


def test_model_not_ready(app):
    async def go():
        async with session(app, *app.operator) as c:
            assert await read(c, "Models", "broken", "State") == "Failed"
            r = await call(c, "broken", "Infer", [floats([1] * 4)])
            assert status_name(r) == "BadInvalidState"
    run(go())


def test_non_finite_output_is_internal_error(app):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "nanmodel", "Infer", [floats([-1, 1, 1, 1])])
            assert status_name(r) == "BadInternalError"
            assert r.OutputArguments == []
            r = await call(c, "nanmodel", "Infer", [floats([1, 1, 1, 1])])
            assert status_name(r) == "Good"
    run(go())


def test_deadline_and_full_queue(app):
    async def go():
        async with session(app, *app.operator) as c:
            r = await call(c, "slow", "Infer", [floats([1] * 4)])
            assert status_name(r) == "BadTimeout"
            # five calls at once on one connection, as an S7-1500 sends them: one runs, the queue holds one, the
            # other three find it full
            results = await asyncio.gather(*[call(c, "slow", "Infer", [floats([1] * 4)]) for _ in range(5)])
            names = [status_name(r) for r in results]
            # (three or more: the batch of the call above may still be running)
            assert names.count("BadResourceUnavailable") >= 3, names
            assert set(names) == {"BadResourceUnavailable", "BadTimeout"}, names
    run(go())


def test_address_space(app):
    async def go():
        async with session(app, *app.monitor) as c:
            ns = await c.get_namespace_index("urn:opcua-inference-appliance")
            assert ns > 0
            assert await read(c, "State") in ("Degraded",)  # one model is Failed
            assert await read(c, "Device") == "cpu"
            assert await read(c, "Models", "affine", "InputShape") == [4]
            assert await read(c, "Models", "affine", "OutputShape") == [4]
            assert await read(c, "Models", "affine", "MaxSamples") == 8
            assert await read(c, "Models", "affine", "Backend") == "onnxruntime-cpu"
            assert await read(c, "Health", "WatchdogState") == "NoGpu"
            beat = await read(c, "Heartbeat")
            await asyncio.sleep(2.2)
            assert await read(c, "Heartbeat") >= beat + 1
            # three calls from another session are counted, and the count is published within a few heartbeats
            before = await read(c, "Models", "affine", "RequestCount")
            async with session(app, *app.operator) as plc:
                for _ in range(3):
                    assert status_name(await call(plc, "affine", "Infer", [floats([1, 2, 3, 4])])) == "Good"
            count = before
            for _ in range(50):
                count = await read(c, "Models", "affine", "RequestCount")
                if count >= before + 3:
                    break
                await asyncio.sleep(0.2)
            assert count == before + 3, (before, count)
    run(go())


def test_endpoints_offer_only_secure_policies_and_present_the_chain(app):
    from asyncua import Client

    async def endpoints(url):
        c = Client(url)
        return await c.connect_and_get_server_endpoints()

    eps = run(endpoints(app.endpoint))
    offered = {(e.SecurityPolicyUri.rsplit("#", 1)[1], e.SecurityMode.name) for e in eps}
    assert offered == {("Basic256Sha256", "SignAndEncrypt"), ("Aes128_Sha256_RsaOaep", "SignAndEncrypt"),
                       ("Aes256_Sha256_RsaPss", "SignAndEncrypt")}
    own = app.pki.layout.own_cert_der.read_bytes()
    ca = app.pki.layout.ca_cert_der.read_bytes()
    for e in eps:
        assert e.ServerCertificate == own + ca  # its certificate, then the appliance CA
        assert e.Server.ApplicationUri == app.config.server.application_uri
        token_types = {t.TokenType.name for t in e.UserIdentityTokens}
        assert token_types == {"Certificate", "UserName"}  # anonymous is off by default
    # GetEndpoints answers with the host the client dialled
    eps = run(endpoints(f"opc.tcp://localhost:{app.port}"))
    assert all(e.EndpointUrl == f"opc.tcp://localhost:{app.port}" for e in eps)


def test_failed_reload_keeps_old_weights_and_raises_an_event(app):
    path = app.config.models["affine"].resolved_path
    good = path.read_bytes()

    async def go():
        handler = Events()
        async with session(app, *app.engineer) as c:
            sub = await c.create_subscription(50, handler)
            await sub.subscribe_events(c.nodes.server)
            path.write_bytes(b"not a model any more")
            try:
                r = await call(c, "", "ReloadModel", [ua.Variant("affine", V.String)])
            finally:
                path.write_bytes(good)
            assert status_name(r) == "BadInternalError"
            r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
            assert status_name(r) == "Good" and r.OutputArguments[1].Value == "v1"
            assert np.allclose(r.OutputArguments[0].Value, [3, 3, 3, 3])
            for _ in range(40):
                if any("affine" in m and "fail" in m.lower() for m in handler.messages()):
                    break
                await asyncio.sleep(0.1)
            assert any("affine" in m and "fail" in m.lower() for m in handler.messages()), handler.messages()
            assert not any(str(path.parent) in m for m in handler.messages())  # no paths in events
    run(go())
