"""A model whose files are broken fails to load with its cause in the log: `appliance serve` with a generative
model whose config.json lacks a key (a KeyError deep in the loader) and a tensor model whose file is not an ONNX
graph. Each model is Failed; the reason /readyz shows names no path and carries no traceback; the serve log (what
journald keeps) holds the traceback of each failure, so an operator can tell a missing key from a bad file."""
from __future__ import annotations

import json
import re

import pytest

from serve_process import Serve
from test_cgroup_memory import failed_reason


def test_a_broken_model_file_fails_the_load_with_its_traceback_logged(tmp_path):
    pytest.importorskip("transformers")
    from tiny_llm import make_model_dir
    chat = tmp_path / "chat"
    make_model_dir(chat)
    config = json.loads((chat / "config.json").read_text())
    del config["intermediate_size"]  # the loader reads it with d["intermediate_size"]: a KeyError
    (chat / "config.json").write_text(json.dumps(config))
    broken_onnx = tmp_path / "broken.onnx"
    broken_onnx.write_bytes(b"this is no ONNX graph\n" * 8)
    serve = Serve(tmp_path, {"chat": {"kind": "generative", "path": str(chat)},
                             "affine": {"kind": "tensor", "path": str(broken_onnx)}}, wait="up")
    try:
        chat_reason, affine_reason = failed_reason(serve, "chat"), failed_reason(serve, "affine")
        for reason in (chat_reason, affine_reason):
            assert str(tmp_path) not in reason and "Traceback" not in reason and "File \"" not in reason, reason
        assert chat_reason.endswith("loading failed (KeyError)"), chat_reason
        log = serve.log_path.read_text()
        # each failure's traceback, ending in its exception, follows the line that names the model
        chat_trace = re.search(r"model chat: load failed.*?\nTraceback \(most recent call last\):\n(.*?)\nKeyError: "
                               r"'intermediate_size'", log, re.S)
        assert chat_trace and "llama_config.py" in chat_trace.group(1), log[-6000:]
        affine_trace = re.search(r"model affine: load failed.*?\nTraceback \(most recent call last\):\n", log, re.S)
        assert affine_trace, log[-6000:]
    finally:
        serve.close()
