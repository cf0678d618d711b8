"""Versions of a model on disk, side by side, with one atomic switch between them.

    state_dir/models/NAME/
        <version>/          a deployed copy of the model's folder (or file), never changed after deploy
        current -> <version>    the version that serves (a relative symlink)
        previous -> <version>   the version that served before the last switch (what `rollback` goes back to)
        manifest.json       per version: content digest, deploy time, source, files

`deploy` copies into a hidden temporary folder beside the versions, fsyncs it, renames it into place, then points
`current` at it by creating a new symlink and renaming it over the old one: rename(2) replaces it atomically, so a
reader (the engine loading `current/...`) sees the old version or the new one, never neither. `rollback` is the
same rename towards `previous`. Old versions beyond `keep` are deleted after a deploy, never `current` or
`previous`. The store itself never loads a model; asking the running appliance to reload is `request_reload`.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DIGEST_CHARS = 12  # version name from the content digest when no label is given


class ModelStoreError(Exception):
    """A store operation that cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class VersionInfo:
    version: str
    digest: str  # sha256 over the files' relative paths and contents
    deployed_at: str
    source: str
    serving: bool
    previous: bool


def content_digest(source: Path) -> str:
    """sha256 over every file under `source` (relative path and content, in sorted order), or over one file."""
    h = hashlib.sha256()
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for file in files:
        rel = file.name if source.is_file() else file.relative_to(source).as_posix()
        h.update(rel.encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ModelStore:
    def __init__(self, state_dir: Path):
        self.root = Path(state_dir) / "models"

    def model_dir(self, name: str) -> Path:
        return self.root / name

    # ---- reading -----------------------------------------------------------------------------------------------
    def _manifest(self, name: str) -> dict:
        path = self.model_dir(name) / "manifest.json"
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            raise ModelStoreError(f"{path} is not valid JSON; it lists the deployed versions (restore it from a "
                                  "backup, or delete it and deploy again)") from None

    def _link_target(self, name: str, link: str) -> str | None:
        path = self.model_dir(name) / link
        return os.readlink(path) if path.is_symlink() else None

    def current_version(self, name: str) -> str:
        """The version that serves; ModelStoreError with what to do when there is none or it points nowhere."""
        link = self.model_dir(name) / "current"
        target = self._link_target(name, "current")
        if target is None:
            raise ModelStoreError(f"model '{name}': no version deployed ({link} does not exist); deploy one with "
                                  f"`appliance models deploy {name} DIR`")
        if not (self.model_dir(name) / target).is_dir():
            raise ModelStoreError(f"model '{name}': {link} points to '{target}', which does not exist; deploy a "
                                  f"version or roll back with `appliance models rollback {name}`")
        return target

    def current_path(self, name: str) -> Path:
        """The path the engine loads: through the `current` link, so that a switch is seen by the next load."""
        self.current_version(name)
        return self.model_dir(name) / "current"

    def deployed(self, name: str) -> bool:
        """Versions of this model are managed here (then they, not the YAML's path, serve)."""
        return (self.model_dir(name) / "current").is_symlink()

    def served_path(self, name: str, kind: str) -> Path:
        """What the engine loads for a deployed model, through `current` (so a switch is seen by the next load):
        the version's one model file (.onnx / .pt / .gguf), or the version folder itself (an HF directory)."""
        folder = self.current_path(name)
        suffixes = (".onnx", ".pt", ".pt2") if kind == "tensor" else (".gguf",)
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        if len(files) == 1:
            return folder / files[0]
        if kind == "generative" and (folder / "config.json").exists():
            return folder
        raise ModelStoreError(f"model '{name}': version '{self.current_version(name)}' holds "
                              f"{'no' if not files else 'more than one'} model file ({', '.join(suffixes)})")

    def versions(self, name: str) -> list[VersionInfo]:
        manifest = self._manifest(name)
        current, previous = self._link_target(name, "current"), self._link_target(name, "previous")
        present = sorted((p.name for p in self.model_dir(name).iterdir()
                          if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")),
                         key=lambda v: (manifest.get(v, {}).get("seq", 0), v))  # oldest first
        return [VersionInfo(v, manifest.get(v, {}).get("digest", "?"), manifest.get(v, {}).get("deployed_at", "?"),
                            manifest.get(v, {}).get("source", "?"), v == current, v == previous)
                for v in present] if self.model_dir(name).is_dir() else []

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    # ---- changing ----------------------------------------------------------------------------------------------
    def deploy(self, name: str, source: Path, version: str | None = None, keep: int = 5) -> str:
        """Copy `source` (a folder or one file) in as a new version and make it serve; answers the version."""
        source = Path(source)
        if not source.exists():
            raise ModelStoreError(f"{source}: no such file or directory")
        if source.is_dir() and not any(p.is_file() for p in source.rglob("*")):
            raise ModelStoreError(f"{source}: the folder holds no file")
        digest = content_digest(source)
        version = version or digest[:DIGEST_CHARS]
        if not _VERSION.fullmatch(version) or version in ("current", "previous"):
            raise ModelStoreError(f"version {version!r}: expected 1-64 characters A-Z a-z 0-9 . _ - starting with a "
                                  "letter or digit (not 'current' or 'previous')")
        folder = self.model_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(name)
        target = folder / version
        if target.exists():
            if manifest.get(version, {}).get("digest") != digest:
                raise ModelStoreError(f"model '{name}': version '{version}' already exists with other content; "
                                      "choose another --version")
        else:
            staging = folder / f".staging-{uuid.uuid4().hex}"
            try:
                if source.is_dir():
                    shutil.copytree(source, staging, symlinks=False)
                else:
                    staging.mkdir()
                    shutil.copy2(source, staging / source.name)
                _fsync_tree(staging)
                if content_digest(staging if source.is_dir() else staging / source.name) != digest:
                    raise ModelStoreError(f"{source} changed while it was copied; deploy again")
                os.rename(staging, target)
                _fsync_dir(folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            seq = 1 + max((m.get("seq", 0) for m in manifest.values()), default=0)  # deploy order
            manifest[version] = {"digest": digest, "source": str(source.resolve()), "seq": seq,
                                 "deployed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                     timespec="seconds")}
            self._write_manifest(name, manifest)
        old = self._link_target(name, "current")
        if old != version:
            self._switch(name, version, previous=old)
        self.prune(name, keep)
        return version

    def rollback(self, name: str) -> str:
        """Make the previous version serve again (and the rolled-back one `previous`); answers the version."""
        previous = self._link_target(name, "previous")
        if previous is None or not (self.model_dir(name) / previous).is_dir():
            raise ModelStoreError(f"model '{name}': there is no previous version to roll back to")
        self._switch(name, previous, previous=self._link_target(name, "current"))
        return previous

    def _switch(self, name: str, version: str, previous: str | None) -> None:
        folder = self.model_dir(name)
        self._point(folder / "current", version)  # the one switch that matters, atomic
        if previous is not None and previous != version:
            self._point(folder / "previous", previous)
        _fsync_dir(folder)

    @staticmethod
    def _point(link: Path, target: str) -> None:
        tmp = link.with_name(f".{link.name}-{uuid.uuid4().hex}")
        os.symlink(target, tmp)
        os.replace(tmp, link)  # rename(2) over the old link

    def prune(self, name: str, keep: int) -> list[str]:
        """Delete the oldest versions beyond `keep`, never the current or previous one; answers the deleted."""
        manifest = self._manifest(name)
        removable = [v for v in self.versions(name) if not v.serving and not v.previous]
        excess = max(0, len(self.versions(name)) - keep)
        deleted = [v.version for v in removable[:excess]]
        for version in deleted:
            shutil.rmtree(self.model_dir(name) / version)
            manifest.pop(version, None)
        if deleted:
            self._write_manifest(name, manifest)
        return deleted

    def _write_manifest(self, name: str, manifest: dict) -> None:
        path = self.model_dir(name) / "manifest.json"
        tmp = path.with_name(f".manifest-{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)


@dataclass(frozen=True)
class ReloadResult:
    done: bool
    message: str


def request_reload(config, name: str, timeout_s: float = 600.0) -> ReloadResult:
    """Ask the running appliance on this box to load the model's `current` version: Admin/ReloadModel over OPC UA
    on loopback, as the box's commissioning engineer (a certificate the local CA issues once, like `appliance call`'s
    commissioning operator). Not running: the new version serves from its next start."""
    from asyncua import ua

    from .client import AdminUnreachable, call_admin

    try:
        r = call_admin(config, "ReloadModel", [ua.Variant(name, ua.VariantType.String)], timeout_s)
    except AdminUnreachable as e:
        if e.reason == "no_pki":
            return ReloadResult(False, "the appliance has no PKI yet (never started): the version serves from its "
                                       "first start")
        return ReloadResult(False, "the appliance is not running: the version serves from its next start")
    if r.StatusCode.is_good():
        return ReloadResult(True, f"the appliance now serves version {r.OutputArguments[0].Value}")
    return ReloadResult(False, f"ReloadModel answered {r.StatusCode.name}: the previous version keeps serving "
                               "(see the audit log and the appliance's log for the reason)")
