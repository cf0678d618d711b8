"""torch's private APIs are used in one module only (models/torch_internals.py), which refuses another torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from models import torch_internals

ROOT = Path(__file__).resolve().parents[1]
FENCE = ROOT / "models" / "torch_internals.py"


def private_torch_uses(path: Path) -> list[str]:
    """The lines with torch._x / torch.ops.mkldnn / torch.ops.aten._x attribute chains or imports of torch._x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if not (isinstance(inner, ast.Name) and inner.id == "torch"):
                continue
            names = ["torch", *reversed(chain)]
            if (names[1].startswith("_") and not names[1].startswith("__")) or names[1:3] == ["ops", "mkldnn"] \
                    or (names[1:3] == ["ops", "aten"] and len(names) > 3 and names[3].startswith("_")):
                found.append(f"{path}:{node.lineno}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "torch" and len(parts) > 1 and parts[1].startswith("_"):
                    found.append(f"{path}:{node.lineno}")
    return sorted(set(found))  # one entry a line (torch.ops.mkldnn.x holds torch.ops.mkldnn too)


def test_only_the_fence_uses_torch_private_apis():
    uses = []
    for package in ("core", "appliance", "uaserver", "models", "kernels", "certs"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != FENCE:
                uses += private_torch_uses(path)
    assert not uses, "torch private APIs outside models/torch_internals.py:\n" + "\n".join(uses)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch._inductor.config as c\nfrom torch._inductor import exc\n"
                      "y = torch._weight_int4pack_mm_for_cpu(1)\nz = torch.ops.mkldnn._linear_pointwise(1)\n"
                      "v = torch.__version__\nw = torch.nn.functional.linear\n")
    found = private_torch_uses(sample)
    assert [f.rsplit(":", 1)[1] for f in found] == ["2", "3", "4", "5"], found  # __version__, public names: fine


def test_another_torch_is_refused_with_what_to_do():
    torch_internals.check_torch_version("2.13.0+cpu")  # a build suffix is the same release
    with pytest.raises(torch_internals.TorchVersionError, match=r"written for torch 2\.13\.0.*2\.14\.0.*pip install"):
        torch_internals.check_torch_version("2.14.0")


def test_the_engine_does_not_import_with_another_torch():
    """As a plant would meet it after an upgrade of torch beside the appliance: the model code refuses to load, naming
    the version, instead of failing later in a renamed private call."""
    code = ("import torch; torch.__version__ = '2.99.0'\n"
            "try:\n    import models.llama\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "TorchVersionError" in out.stdout and "2.99.0" in out.stdout, out.stdout + out.stderr
