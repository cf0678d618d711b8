"""A refused ReloadModel says why: the reason reaches the engineer as the operation's status text (its DiagnosticInfo
LocalizedText, which a client asks for in RequestHeader.ReturnDiagnostics), with file paths reduced to their last
part, through a real client over SignAndEncrypt; the old weights serve on. (`appliance models deploy` shows the same
text: tests/test_deploy_failure.py.)"""
from __future__ import annotations

import os

from asyncua import ua

from harness import RunningAppliance
from onnx_models import affine_model
from uaclient import call, floats, run, session, status_name


def test_a_refused_reload_answers_its_reason_without_paths(tmp_path):
    configured = affine_model(tmp_path / "configured.onnx", scale=2.0)
    app = RunningAppliance(tmp_path / "state", {"affine": {"kind": "tensor", "path": str(configured)}})
    try:
        engineer, plc = app.issue("eng", "engineer"), app.issue("plc", "operator")

        async def reload():
            async with session(app, *engineer) as c:
                return await call(c, "", "ReloadModel", [ua.Variant("affine", ua.VariantType.String)])

        affine_model(configured, width=5)  # loads, but its samples have another shape
        r = run(reload())
        assert status_name(r) == "BadInternalError"
        assert "the new weights change the sample shapes ([4] -> [5]" in r.status_text, r.status_text

        configured.write_bytes(b"\x0a\xff\xff\xff" + os.urandom(64))  # corrupt: a length past the end
        r = run(reload())
        assert status_name(r) == "BadInternalError"
        assert r.status_text and str(tmp_path) not in r.status_text and "/" not in r.status_text, r.status_text
        assert "Traceback" not in r.status_text

        async def infer():
            async with session(app, *plc) as c:
                r = await call(c, "affine", "Infer", [floats([1, 1, 1, 1])])
                return status_name(r), r.OutputArguments[0].Value
        assert run(infer()) == ("Good", [3.0] * 4)  # the old weights serve on
    finally:
        app.stop()
