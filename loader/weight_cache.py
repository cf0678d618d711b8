"""Quantized weights cached on disk in their final kernel layout, so a start after the first maps them: no
dequantising, no repacking, no requantizing.

One file per (model content, format, layout) under the model's cache directory: `<cache_dir>/<key>.weights`, the
key from the model file's full content digest (loader/file_digest.py). The file is a small JSON header (every
tensor's name, kind, shape, offset) followed by the tensors' bytes, each aligned to 64 bytes; `load` maps it
read-only and every tensor is a view of that map: the page cache holds the weights once for every worker process
that maps the same file, and nothing is copied. Files are written whole beside their final name and renamed, never
changed in place afterwards (a mapped file rewritten in place would fault its readers); a model's directory keeps
its KEEP most recently used files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from models.quant import BlockMatrix

log = logging.getLogger(__name__)

# bump when what is stored changes (3: the block formats' panel layout of kernels/cpu_layout.py; 4: each layer's
# q/k/v and gate/up back to back, so the model fuses them as views of the map, see quant.concat_rows)
LAYOUT = "4"
MAGIC = b"APPLWTS4"
ALIGN = 64
KEEP = 3  # cache files kept per model directory
SUFFIX = ".weights"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                                       torch.int8, torch.int32, torch.int64)}


def cache_key(digest: str, fmt: str) -> str:
    return hashlib.sha256(f"{digest}\0{fmt}\0layout {LAYOUT}".encode()).hexdigest()[:24]


def cache_path(cache_dir: Path, digest: str, fmt: str) -> Path:
    return Path(cache_dir) / f"{cache_key(digest, fmt)}{SUFFIX}"


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


def _plain(value: Any) -> Any:
    """numpy scalars and arrays in GGUF metadata as JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def save(path: Path, tensors: dict[str, Any], meta: dict | None = None) -> None:
    """Write atomically (a temporary file beside it, then rename), the header metadata first."""
    entries, blobs, offset = [], [], 0
    for name, t in _fusable_together(tensors):
        if isinstance(t, BlockMatrix):
            data = t.data.contiguous()
            entry = {"name": name, "kind": "block", "type": t.type_name, "shape": list(t.shape)}
        else:
            data = t.detach().contiguous()
            entry = {"name": name, "kind": "dense"}
        offset = -(-offset // ALIGN) * ALIGN
        raw = data.view(torch.uint8).reshape(-1) if data.numel() else torch.empty(0, dtype=torch.uint8)
        entry.update({"dtype": str(data.dtype).removeprefix("torch."), "data_shape": list(data.shape),
                      "offset": offset, "nbytes": raw.numel()})
        entries.append(entry)
        blobs.append((offset, raw))
        offset += raw.numel()
    header = json.dumps({"layout": LAYOUT, "tensors": entries}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    path.parent.mkdir(parents=True, exist_ok=True)
    if meta is not None:
        save_meta(path, meta)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for off, raw in blobs:
            f.seek(start + off)
            f.write(raw.numpy().tobytes())
        f.truncate(start + offset)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _keep_recent(path.parent)


# Stored back to back, in this order, when they are in one format: what the model multiplies as one matrix.
FUSED_GROUPS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def _fusable_together(tensors: dict[str, Any]) -> list[tuple[str, Any]]:
    """The tensors in the order to store them, each once: a fused group (FUSED_GROUPS) where its first member
    present comes, its members consecutive and in the group's order."""
    ordered, placed = [], set()
    for name in tensors:
        group = [name]
        for parts in FUSED_GROUPS:
            part = next((p for p in parts if name.endswith(p)), None)
            if part is not None:
                prefix = name[:-len(part)]
                group = [prefix + p for p in parts if prefix + p in tensors]
        for member in group:
            if member not in placed:
                ordered.append((member, tensors[member]))
                placed.add(member)
    return ordered


def _keep_recent(cache_dir: Path) -> None:
    """Keep the KEEP most recently used files of a model's cache directory (its current and previous versions,
    so a rollback maps rather than rebuilds)."""
    files = sorted(cache_dir.glob(f"*{SUFFIX}"), key=lambda f: f.stat().st_mtime, reverse=True)
    for old in files[KEEP:]:
        old.unlink(missing_ok=True)
        meta_path(old).unlink(missing_ok=True)


class CacheFileError(ValueError):
    """A cache file that is torn, foreign or of another layout: rebuilt."""


def _read_header(mm: mmap.mmap) -> tuple[dict, int]:
    if len(mm) < len(MAGIC) + 8 or mm[:len(MAGIC)] != MAGIC:
        raise CacheFileError("not a weight cache file of this layout")
    (size,) = struct.unpack("<Q", mm[len(MAGIC):len(MAGIC) + 8])
    if len(MAGIC) + 8 + size > len(mm):
        raise CacheFileError("torn header")
    header = json.loads(mm[len(MAGIC) + 8:len(MAGIC) + 8 + size])
    if header.get("layout") != LAYOUT:
        raise CacheFileError(f"layout {header.get('layout')} (this build reads {LAYOUT})")
    return header, -(-(len(MAGIC) + 8 + size) // ALIGN) * ALIGN


def load(path: Path) -> dict[str, Any] | None:
    """The cached tensors as read-only views of the file's map, or None when there is no usable file."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header, start = _read_header(mm)
        out: dict[str, Any] = {}
        with warnings.catch_warnings():  # a read-only map: torch warns that it cannot write; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(mm, dtype=torch.uint8)  # one storage: neighbours can be viewed as one
            for e in header["tensors"]:
                dtype = _DTYPES[e["dtype"]]
                begin = start + e["offset"]
                if begin + e["nbytes"] > len(mm):
                    raise CacheFileError(f"torn file: {e['name']} runs past its end")
                t = whole[begin:begin + e["nbytes"]].view(dtype) if e["nbytes"] else torch.empty(0, dtype=dtype)
                t = t.view(e["data_shape"])
                out[e["name"]] = BlockMatrix(e["type"], tuple(e["shape"]), t) if e["kind"] == "block" else t
        os.utime(path)  # most recently used: survives _keep_recent
        return out
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:  # torn or foreign: rebuild it
        log.warning("weight cache %s unusable (%s); rebuilding", path.name, exc)
        return None


def gguf_matrix_types(path: Path, cache_dir: Path | None) -> set[str]:
    """The GGUF types of a file's matrices."""
    return set(gguf_tensor_types(path, cache_dir).values())


def gguf_tensor_types(path: Path, cache_dir: Path | None) -> dict[str, str]:
    """Each matrix's GGUF type by its GGUF name, remembered in the model's cache directory under the file's
    digest: reading them parses the whole GGUF header (SmolLM2: 3-5 s for its vocabulary), which a cached start
    otherwise never does."""
    from loader.file_digest import file_digest
    from models.gguf_loader import matrix_types_by_name

    memo = Path(cache_dir) / f"types-{file_digest(Path(path), cache_dir)[:16]}.json" if cache_dir is not None \
        else None
    if memo is not None:
        try:
            known = json.loads(memo.read_text(encoding="utf-8"))
            if isinstance(known, dict):
                return known
        except (OSError, ValueError):
            pass
    types = matrix_types_by_name(path)
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(json.dumps(types, sort_keys=True), encoding="utf-8")
        except OSError:
            pass
    return types
