"""Versions of a model on disk, side by side, with one atomic switch between them.

    state_dir/models/NAME/
        <version>/          a deployed copy of the model's folder (or file), never changed after deploy
        current -> <version>    the version that serves, and that an appliance start loads (a relative symlink)
        previous -> <version>   the version that served before the last switch (what `rollback` goes back to)
        candidate -> <version>  while `appliance models deploy` / `rollback` checks a version: what the running
                                appliance's reload loads; gone once it is switched in or rejected
        manifest.json       per version: content digest, deploy time, source, files

`add` copies into a hidden temporary folder beside the versions, fsyncs it and renames it into place; `switch`
points `current` at a version by creating a new symlink and renaming it over the old one: rename(2) replaces it
atomically, so a reader sees the old version or the new one, never neither. Old versions beyond `keep` are deleted
after a switch, never `current`, `previous` or `candidate`. A worker loads a version's own folder (`version_path`),
not through `current`: a worker that restarts loads what it served, whatever was switched meanwhile.

The store itself never loads a model: the deploy workflow that checks a version before switching it in is
appliance/model_deploy.py, which uses the store.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from loader.file_digest import VERSION_CHARS, content_digest

_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LINKS = ("current", "previous", "candidate")  # names a version cannot take


class ModelStoreError(Exception):
    """A store operation that cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class VersionInfo:
    version: str
    digest: str  # loader/file_digest.content_digest of the version's files
    deployed_at: str
    source: str
    serving: bool
    previous: bool
    candidate: bool = False  # a deploy or rollback is checking it (or was interrupted while it did)


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

    def serving_version(self, name: str) -> str | None:
        """What `current` names (None: no version deployed; the configuration's path serves)."""
        return self._link_target(name, "current")

    def candidate_version(self, name: str) -> str | None:
        """The version a deploy or rollback in progress checks (what a reload of the running appliance loads)."""
        target = self._link_target(name, "candidate")
        return target if target is not None and (self.model_dir(name) / target).is_dir() else None

    def previous_version(self, name: str) -> str:
        previous = self._link_target(name, "previous")
        if previous is None or not (self.model_dir(name) / previous).is_dir():
            raise ModelStoreError(f"model '{name}': there is no previous version to roll back to")
        return previous

    def current_path(self, name: str) -> Path:
        """The path the engine loads: through the `current` link, so that a switch is seen by the next load."""
        self.current_version(name)
        return self.model_dir(name) / "current"

    def deployed(self, name: str) -> bool:
        """Versions of this model are managed here (then they, not the YAML's path, serve)."""
        return (self.model_dir(name) / "current").is_symlink()

    def served_path(self, name: str, kind: str) -> Path:
        """What the engine loads for a deployed model: its `current` version's model (see version_path)."""
        return self.version_path(name, self.current_version(name), kind)

    def version_path(self, name: str, version: str, kind: str) -> Path:
        """A version's one model file (.onnx / .pt / .gguf), or its folder itself (an HF directory), in the version's
        own folder: a worker that loaded it loads the same files when it restarts, whatever `current` says by then."""
        folder = self.model_dir(name) / version
        if not folder.is_dir():
            raise ModelStoreError(f"model '{name}': version '{version}' does not exist")
        suffixes = (".onnx", ".pt", ".pt2") if kind == "tensor" else (".gguf",)
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        if len(files) == 1:
            return folder / files[0]
        if kind == "generative" and (folder / "config.json").exists():
            return folder
        raise ModelStoreError(f"model '{name}': version '{version}' holds "
                              f"{'no' if not files else 'more than one'} model file ({', '.join(suffixes)})")

    def versions(self, name: str) -> list[VersionInfo]:
        if not self.model_dir(name).is_dir():
            return []
        manifest = self._manifest(name)
        current, previous = self._link_target(name, "current"), self._link_target(name, "previous")
        candidate = self._link_target(name, "candidate")
        present = sorted((p.name for p in self.model_dir(name).iterdir()
                          if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")),
                         key=lambda v: (manifest.get(v, {}).get("seq", 0), v))  # oldest first
        return [VersionInfo(v, manifest.get(v, {}).get("digest", "?"), manifest.get(v, {}).get("deployed_at", "?"),
                            manifest.get(v, {}).get("source", "?"), v == current, v == previous, v == candidate)
                for v in present]

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    # ---- changing ----------------------------------------------------------------------------------------------
    def add(self, name: str, source: Path, version: str | None = None) -> tuple[str, bool]:
        """Copy `source` (a folder or one file) in as a version, without switching to it; answers the version and
        whether this call created it (False: the same content was there under that name)."""
        source = Path(source)
        if not source.exists():
            raise ModelStoreError(f"{source}: no such file or directory")
        if source.is_dir() and not any(p.is_file() for p in source.rglob("*")):
            raise ModelStoreError(f"{source}: the folder holds no file")
        digest = content_digest(source)
        version = version or digest[:VERSION_CHARS]  # no label: named by its content
        if not _VERSION.fullmatch(version) or version in LINKS:
            raise ModelStoreError(f"version {version!r}: expected 1-64 characters A-Z a-z 0-9 . _ - starting with a "
                                  f"letter or digit (not {' or '.join(repr(x) for x in LINKS)})")
        folder = self.model_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(name)
        target = folder / version
        if target.exists():
            if manifest.get(version, {}).get("digest") != digest:
                raise ModelStoreError(f"model '{name}': version '{version}' already exists with other content; "
                                      "choose another --version")
            return version, False
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
        return version, True

    def deploy(self, name: str, source: Path, version: str | None = None, keep: int = 5) -> str:
        """`add` and `switch` at once, without a check that the version loads (model_deploy.switch_checked makes it)."""
        version, _ = self.add(name, source, version)
        self.switch(name, version, keep)
        return version

    def rollback(self, name: str) -> str:
        """Make the previous version serve again (and the rolled-back one `previous`); answers the version."""
        previous = self.previous_version(name)
        self.switch(name, previous)
        return previous

    def switch(self, name: str, version: str, keep: int | None = None) -> None:
        """Make `version` serve (`current`), the one that served `previous`; a candidate link goes; versions beyond
        `keep` are pruned."""
        old = self._link_target(name, "current")
        if old != version:
            self._switch(name, version, previous=old)
        self._unlink(name, "candidate")
        if keep is not None:
            self.prune(name, keep)

    def propose(self, name: str, version: str) -> None:
        """`candidate` -> version: a reload of the running appliance loads it, `current` still names the old one."""
        folder = self.model_dir(name)
        self._point(folder / "candidate", version)
        _fsync_dir(folder)

    def withdraw(self, name: str, version: str, remove: bool) -> None:
        """A version that did not load: the candidate link goes, and with `remove` its copy (never the current or
        previous version's); a model folder left with no version at all goes too."""
        self._unlink(name, "candidate")
        folder = self.model_dir(name)
        if remove and version not in (self._link_target(name, "current"), self._link_target(name, "previous")):
            shutil.rmtree(folder / version, ignore_errors=True)
            manifest = self._manifest(name)
            if manifest.pop(version, None) is not None:
                self._write_manifest(name, manifest)
        if folder.is_dir() and not self.versions(name) and not (folder / "current").is_symlink():
            shutil.rmtree(folder)

    def _unlink(self, name: str, link: str) -> None:
        path = self.model_dir(name) / link
        if path.is_symlink():
            path.unlink()
            _fsync_dir(path.parent)

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
        """Delete the oldest versions beyond `keep`, never the current, previous or candidate; answers the deleted."""
        manifest = self._manifest(name)
        removable = [v for v in self.versions(name) if not v.serving and not v.previous and not v.candidate]
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
