"""Content versions of model weights: a short hash that changes exactly when the bytes change."""
from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 1 << 20  # stream in 1 MiB pieces: weights can be gigabytes
VERSION_LENGTH = 12


def content_version(path: Path) -> str:
    """sha256 of a file, or of every file under a directory (sorted by relative path), as 12 hex characters.

    For a directory the relative path of each file is hashed too, so renaming a file changes the version.
    """
    path = Path(path)
    digest = hashlib.sha256()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
            _hash_file(file, digest)
    else:
        _hash_file(path, digest)
    return digest.hexdigest()[:VERSION_LENGTH]


def _hash_file(path: Path, digest: "hashlib._Hash") -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
