"""The OPC Foundation's draft AI information model (http://opcfoundation.org/UA/AI/, draft 0.2.0 of 2026-08; its
names and NodeIds are provisional) where it fits: each model object carries properties named as the draft's ModelType
and DeploymentType, with values from the running model and its configuration. Version and State are the contract's
variables of those names (the same nodes).

    Framework       the runtime serving it, from Backend: ONNX Runtime | TensorRT | PyTorch ("" while loading)
    Format          the weights' file format: ONNX | TorchScript | GGUF | safetensors
    TaskKind        classification (a tensor model with labels) | tensor-inference | text-generation
    Digest          sha256:<hex> of the configured weights' content (the file, or every file of a directory)
    Quantization    the weights as served: from Backend (e.g. q4_1 kept as int4, float32, fp16)
    ParameterCount  elements of the weight tensors (ONNX initializers, GGUF or safetensors tensors)
    Inputs/Outputs  one entry per argument, "Name: Type[dims]" (e.g. "Input: Float[k x 20 x 52]": k samples)
    AcceleratorKind CPU | GPU        BatchSize  samples per batch (tensor) or KV slots (generative)
    FallbackPolicy  "model <name>" (YAML fallback) or "none"
    RateLimit       the operator role's and each client's calls per second and burst, or "none"
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

from asyncua import ua

from core.model_port import ModelStatus

V = ua.VariantType
FORMATS = {".onnx": "ONNX", ".pt": "TorchScript", ".pth": "TorchScript", ".gguf": "GGUF",
           ".safetensors": "safetensors"}


class AiProperties:
    """The draft's property values of each configured model; the static ones (digest, parameter count) are read
    once from the weights' files, the rest from each status."""

    def __init__(self, config):
        self.config = config
        self._static: dict[str, tuple[str, int]] = {}

    def weights_facts(self, name: str) -> tuple[str, int]:
        """(Digest, ParameterCount) of the model's configured weights; read once (hashing a file of hundreds of MB
        takes a second: called off the event loop by the server)."""
        if name not in self._static:
            path = self.config.models[name].resolved_path
            self._static[name] = (digest(path), parameter_count(path))
        return self._static[name]

    def values(self, st: ModelStatus) -> dict[str, tuple[object, ua.VariantType]]:
        m, engine = self.config.models[st.name], self.config.engine
        path = m.resolved_path
        digest_hex, params = self._static.get(st.name, ("", 0))
        tensor = st.kind == "tensor"
        if tensor:
            inputs = [f"Input: Float[{dims(st.input_shape)}]"]
            outputs = [f"Output: Float[{dims(st.output_shape)}]", "ModelVersion: String"]
            if m.labels:
                outputs += ["ClassIndex: Int32[k]", "Label: String[k]", "Confidence: Float[k]"]
        else:
            inputs = ["Prompt: String", "MaxTokens: UInt32", "Temperature: Float"]
            outputs = [f"Text: String[{m.max_text_chars}]", "TokenCount: UInt32", "FinishReason: String",
                       "ContextTokens: UInt32", "ContextLost: Boolean", "ModelVersion: String"]
        limits = self.config.security.rate_limits
        rate = "; ".join(f"{who} {r.calls_per_s:g}/s burst {r.burst}" for who, r in
                         (("operator", limits.operator), ("per client", limits.per_client)) if r is not None)
        gpu = "cuda" in st.backend or "tensorrt" in st.backend or str(engine.device).startswith("cuda")
        return {
            "Framework": (framework(st.backend), V.String),
            "Format": (FORMATS.get(path.suffix.lower(), "safetensors" if path.is_dir() else "") if path else "",
                       V.String),
            "TaskKind": ("text-generation" if not tensor else "classification" if m.labels else "tensor-inference",
                         V.String),
            "Digest": (f"sha256:{digest_hex}" if digest_hex else "", V.String),
            "Quantization": (quantization(st.backend, tensor), V.String),
            "ParameterCount": (params, V.UInt64),
            "Inputs": (inputs, V.String),
            "Outputs": (outputs, V.String),
            "AcceleratorKind": ("GPU" if gpu else "CPU", V.String),
            "BatchSize": (m.effective_max_batch_size(engine) if tensor else engine.kv_slots, V.UInt32),
            "FallbackPolicy": (f"model {m.fallback}" if m.fallback else "none", V.String),
            "RateLimit": (rate or "none", V.String),
        }


def dims(shape: tuple[int, ...]) -> str:
    """k samples of the shape, flattened into the Float[] argument: "k x 20 x 52" ("k x ?" while unknown)."""
    return " x ".join(["k", *(str(d) for d in shape)]) if shape else "k x ?"


def framework(backend: str) -> str:
    for prefix, name in (("onnxruntime", "ONNX Runtime"), ("tensorrt", "TensorRT"), ("torch", "PyTorch"),
                         ("cpu ", "PyTorch"), ("cuda", "PyTorch")):
        if backend.startswith(prefix):
            return name
    return ""


def quantization(backend: str, tensor: bool) -> str:
    if not backend:
        return ""
    if tensor:
        return "fp16" if backend.endswith("fp16") else "float32"
    head = backend.split(":", 1)[0]  # "cpu q4_1/int4/...: engine (how)" -> the weights' label
    return head.split(" ", 1)[1] if " " in head else head


def digest(path: Path | None) -> str:
    """sha256 of the weights' content ("" when they cannot be read: the model's own load says why)."""
    try:
        return _digest(path) if path is not None and path.exists() else ""
    except OSError:
        return ""


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            h.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def parameter_count(path: Path | None) -> int:
    """Elements of the weight tensors, read from the file's metadata (0 where the format is not known here)."""
    if path is None or not path.exists():
        return 0
    try:
        if path.suffix == ".onnx":
            import onnx  # noqa: PLC0415 - heavy; only for ONNX models
            graph = onnx.load(str(path), load_external_data=False).graph
            return sum(math.prod(t.dims) for t in graph.initializer)
        if path.suffix == ".gguf":
            return _gguf_elements(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" \
            else []
        return sum(_safetensors_elements(f) for f in files)
    except Exception:  # noqa: BLE001 - an unreadable file: the count is unknown (0), the model still serves
        return 0


def _safetensors_elements(file: Path) -> int:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


# GGUF metadata value types: fixed sizes; 8 is a string, 9 an array (GGUF v2/v3 layout, little-endian)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_elements(file: Path) -> int:
    """Elements of a GGUF file's tensors from its tensor infos, skipping the metadata without decoding it (the gguf
    package's reader builds every metadata field and tensor view: 4.6 s for the demo model here, this 0.1 s)."""
    with open(file, "rb") as f:
        def u(fmt: str) -> int:
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(u("Q"), 1)
            elif vtype == 9:
                elem, count = u("I"), u("Q")
                if elem in _GGUF_SIZES:
                    f.seek(_GGUF_SIZES[elem] * count, 1)
                else:
                    for _ in range(count):
                        skip(elem)
            else:
                f.seek(_GGUF_SIZES[vtype], 1)

        if f.read(4) != b"GGUF" or u("I") < 2:
            return 0
        n_tensors, n_kv = u("Q"), u("Q")
        for _ in range(n_kv):
            f.seek(u("Q"), 1)  # the key
            skip(u("I"))
        total = 0
        for _ in range(n_tensors):
            f.seek(u("Q"), 1)  # the name
            total += math.prod(u("Q") for _ in range(u("I")))
            f.seek(12, 1)  # type (uint32) and offset (uint64)
        return total
