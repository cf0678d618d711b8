"""Device choice per backend: what the installed packages and devices allow, faked by replacing the queries
(the provider list, torch's CUDA check, the tensorrt package check), never the backends themselves."""
from pathlib import Path

import numpy as np
import pytest

from appliance.engine.tensor import backends as tb
from core.errors import EngineFailure

TE_ONNX = Path(__file__).resolve().parents[1] / "models" / "te_classifier" / "te_classifier.onnx"
CPU_ONLY = ["CPUExecutionProvider"]
WITH_CUDA = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_onnx_providers_follow_what_the_package_has():
    assert tb.onnx_providers("auto", CPU_ONLY) == ["CPUExecutionProvider"]
    assert tb.onnx_providers("auto", WITH_CUDA) == [("CUDAExecutionProvider", {"device_id": 0}),
                                                    "CPUExecutionProvider"]
    assert tb.onnx_providers("cuda:1", WITH_CUDA)[0] == ("CUDAExecutionProvider", {"device_id": 1})
    assert tb.onnx_providers("cpu", WITH_CUDA) == ["CPUExecutionProvider"]
    with pytest.raises(EngineFailure, match="no CUDA provider.*onnxruntime-gpu"):
        tb.onnx_providers("cuda", CPU_ONLY)


def test_auto_on_this_cpu_package_is_onnxruntime_cpu():
    backend = tb.load_tensor_backend(TE_ONNX, "auto", "auto")
    assert backend.name == "onnxruntime-cpu"


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_a_cuda_provider_that_cannot_start_is_not_reported_as_cuda(monkeypatch, caplog):
    # onnxruntime-gpu lists CUDAExecutionProvider even on a box without a GPU; the session then runs on the CPU.
    monkeypatch.setattr(tb, "available_onnx_providers", lambda: WITH_CUDA)
    backend = tb.load_tensor_backend(TE_ONNX, "onnxruntime", "auto")
    assert backend.name == "onnxruntime-cpu"
    assert backend.run(np.zeros((2, 20, 52), np.float32)).shape == (2, 22)
    with pytest.raises(EngineFailure, match="could not start its CUDA provider"):
        tb.load_tensor_backend(TE_ONNX, "onnxruntime", "cuda:0")


def test_torch_device_per_backend(monkeypatch):
    monkeypatch.setattr(tb, "torch_sees_cuda", lambda: False)
    assert tb.torch_device("auto") == "cpu"
    with pytest.raises(EngineFailure, match="torch has no CUDA device"):
        tb.torch_device("cuda:0")
    monkeypatch.setattr(tb, "torch_sees_cuda", lambda: True)
    assert tb.torch_device("auto") == "cuda"
    assert tb.torch_device("cpu") == "cpu"


def test_onnx_model_stays_on_cpu_while_torch_sees_a_gpu(monkeypatch):
    """The demo failure: torch sees CUDA, the pinned onnxruntime has no CUDA provider. Auto must still serve."""
    monkeypatch.setattr(tb, "torch_sees_cuda", lambda: True)
    monkeypatch.setattr(tb, "available_onnx_providers", lambda: CPU_ONLY)
    assert tb.load_tensor_backend(TE_ONNX, "auto", "auto").name == "onnxruntime-cpu"


@pytest.mark.parametrize("installed,gpu,device,reason", [
    (False, True, "auto", "the tensorrt package is not installed"),
    (True, False, "auto", "no CUDA GPU is visible"),
    (True, True, "cpu", "device cpu was asked for"),
])
def test_tensorrt_falls_back_to_onnxruntime_and_says_why(monkeypatch, tmp_path, installed, gpu, device, reason):
    monkeypatch.setattr(tb, "tensorrt_installed", lambda: installed)
    monkeypatch.setattr(tb, "torch_sees_cuda", lambda: gpu)
    from appliance.engine.tensor.tensorrt_backend import TensorRtSettings
    backend = tb.load_tensor_backend(TE_ONNX, "tensorrt", device, tensorrt=TensorRtSettings(tmp_path))
    assert backend.name == "onnxruntime-cpu"
    assert backend.note == f"TensorRT not used: {reason}"
    assert backend.run(np.zeros((3, 20, 52), np.float32)).shape == (3, 22)
    assert not any(tmp_path.iterdir())  # no engine was cached


def test_tensorrt_build_failure_still_serves(monkeypatch, tmp_path):
    """Both checks faked true on a box without them: the real import of tensorrt fails inside the build."""
    monkeypatch.setattr(tb, "tensorrt_installed", lambda: True)
    monkeypatch.setattr(tb, "torch_sees_cuda", lambda: True)
    from appliance.engine.tensor.tensorrt_backend import TensorRtSettings
    backend = tb.load_tensor_backend(TE_ONNX, "tensorrt", "auto", tensorrt=TensorRtSettings(tmp_path))
    assert backend.name == "onnxruntime-cpu"
    assert backend.note.startswith("TensorRT not used: the engine build failed (")


def test_tensorrt_needs_an_onnx_file():
    pt = TE_ONNX.with_suffix(".pt2")
    with pytest.raises(EngineFailure, match="builds its engine from an ONNX model"):
        tb.load_tensor_backend(pt, "tensorrt", "auto")
