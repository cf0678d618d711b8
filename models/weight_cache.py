"""Quantized weights cached on disk, so a second start maps them instead of requantizing the model file.

One safetensors file per (model content, format, torch version, cache layout) under the state directory:
`<cache_dir>/<key>.safetensors`. Loading maps the file (the page cache holds the int8/int4 matrices, shared by every
process that maps it); only the layout the matmul op wants (fbgemm's packing) is made at start. A changed model file
has another fingerprint and so another key; a model's directory keeps its KEEP most recently used files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.quant import Int4Groups, Int8Rows

log = logging.getLogger(__name__)

LAYOUT = "1"  # bump when what is stored changes
KEEP = 3  # cache files kept per model directory


def cache_key(fingerprint: str, fmt: str) -> str:
    text = f"{fingerprint}\0{fmt}\0torch {torch.__version__}\0layout {LAYOUT}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_path(cache_dir: Path, fingerprint: str, fmt: str) -> Path:
    return Path(cache_dir) / f"{cache_key(fingerprint, fmt)}.safetensors"


def meta_path(path: Path) -> Path:
    return path.with_suffix(".meta.json")


def load_meta(path: Path) -> dict | None:
    """The model file's header metadata saved beside the cached tensors (GGUF: the tokenizer's vocabulary, the
    config's fields), or None."""
    try:
        return json.loads(meta_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save_meta(path: Path, meta: dict) -> None:
    tmp = path.with_suffix(f".meta.tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, default=_plain), encoding="utf-8")
    os.replace(tmp, meta_path(path))


def save(path: Path, tensors: dict[str, Any], meta: dict | None = None) -> None:
    """Write atomically (temporary file + rename), the header metadata first; a model's directory keeps its KEEP most
    recently used files."""
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if isinstance(t, Int8Rows):
            flat[name + "#q8"], flat[name + "#scale"] = t.q, t.scale
        elif isinstance(t, Int4Groups):
            flat[name + "#q4"], flat[name + "#scale"], flat[name + "#zero"] = t.q, t.scale, t.zero
        else:
            flat[name] = t
    path.parent.mkdir(parents=True, exist_ok=True)
    if meta is not None:
        save_meta(path, meta)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in flat.items()}, str(tmp), metadata={"layout": LAYOUT})
    os.replace(tmp, path)
    _keep_recent(path.parent)


def _keep_recent(cache_dir: Path) -> None:
    """Keep the KEEP most recently used files of a model's cache directory (its current and previous versions,
    so a rollback maps rather than rebuilds)."""
    files = sorted(cache_dir.glob("*.safetensors"), key=lambda f: f.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        old.unlink(missing_ok=True)
        meta_path(old).unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays in GGUF metadata as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def load(path: Path) -> dict[str, Any] | None:
    """The cached tensors as views of the file's memory map, or None when there is no usable file."""
    if not path.is_file():
        return None
    try:
        os.utime(path)  # most recently used: survives _keep_recent
        out: dict[str, Any] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        with safe_open(str(path), framework="pt") as st:
            if (st.metadata() or {}).get("layout") != LAYOUT:
                return None
            for key in st.keys():
                name, _, part = key.partition("#")
                if part:
                    parts.setdefault(name, {})[part] = st.get_tensor(key)
                else:
                    out[name] = st.get_tensor(key)
        for name, p in parts.items():
            out[name] = Int8Rows(p["q8"], p["scale"]) if "q8" in p else Int4Groups(p["q4"], p["scale"], p["zero"])
        return out
    except Exception as exc:  # a torn or foreign file: rebuild it
        log.warning("weight cache %s unusable (%s); rebuilding", path.name, exc)
        return None


def gguf_matrix_types(path: Path, cache_dir: Path | None) -> set[str]:
    """The GGUF types of a file's matrices (to choose `engine.weights: auto`), remembered in the model's cache
    directory under the file's fingerprint: reading them parses the whole GGUF header (SmolLM2: 3-5 s for its
    vocabulary), which a cached start otherwise never does."""
    from models.gguf_loader import matrix_types
    from models.weights import fingerprint

    memo = Path(cache_dir) / f"types-{fingerprint([Path(path)])}.json" if cache_dir is not None else None
    if memo is not None:
        try:
            return set(json.loads(memo.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            pass
    types = matrix_types(path)
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(json.dumps(sorted(types)), encoding="utf-8")
        except OSError:
            pass
    return types
