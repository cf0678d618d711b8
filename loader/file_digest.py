"""A model file's full content digest (sha256), computed once and trusted afterwards while the file's size,
modification time and inode are the ones it was computed for: the key of everything cached from a model file
(weight layouts, measured path choices), so a file edited or replaced in place, bytes in its middle included, is
never served from a stale cache. Hashing runs at about 1-2 GB/s (OpenSSL's sha256); a memo beside the caches keeps
it to once per file version.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MEMO = "digests.json"
VERSION_CHARS = 12  # a version named by its content: the first hex digits of content_digest
CHUNK = 8 << 20


def _stamp(path: Path) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: Path, memo_dir: Path | None = None) -> str:
    """sha256 of the file's bytes; with memo_dir, remembered there under the file's path and stamp."""
    path = Path(path).resolve()
    stamp = _stamp(path)
    memo = Path(memo_dir) / MEMO if memo_dir is not None else None
    known: dict = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
        entry = known.get(str(path))
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and entry.get("sha256"):
            return entry["sha256"]
    digest = file_sha256(path)
    if _stamp(path) != stamp:  # written while we read it: do not remember a digest of a torn file
        log.warning("model file %s changed while it was hashed; not remembering its digest", path.name)
        return digest
    if memo is not None:
        known[str(path)] = {**stamp, "sha256": digest}
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
            os.replace(tmp, memo)
        except OSError as exc:  # a read-only state directory costs the next start a hash, nothing else
            log.warning("could not remember the digest of %s in %s: %s", path.name, memo_dir, exc)
    return digest


def content_digest(source: Path | list[Path], memo_dir: Path | None = None) -> str:
    """The one digest of a model's content, whatever holds it: one file's sha256; for several files (a list, by
    name, or every file under a folder, by relative path) the sha256 over each file's name and digest, in name
    order. The weight caches, a tensor model's version and the versions `appliance models deploy` keeps all use it,
    so a file's version is the same wherever it is named."""
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        named = (sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
                 if root.is_dir() else [(root.name, root)])
    else:
        named = sorted((p.name, p) for p in source)
    if len(named) == 1:
        return file_digest(named[0][1], memo_dir)
    h = hashlib.sha256()
    for name, f in named:
        h.update(f"{name}\0{file_digest(f, memo_dir)}\0".encode())
    return h.hexdigest()
