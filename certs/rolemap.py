"""The certificate -> role map (access/certificates.json), keyed by lower-case SHA-1 thumbprint."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .x509io import write_atomic

ROLES = ("monitor", "operator", "engineer", "security_admin")


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    return role


@dataclass
class RoleMap:
    path: Path

    def load(self) -> dict[str, dict]:
        """Read anew each time, so a certificate issued by the CLI counts without a server restart."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: expected a JSON object of thumbprint -> entry")
        return data

    def save(self, entries: dict[str, dict]) -> None:
        write_atomic(self.path, (json.dumps(entries, indent=2, sort_keys=True) + "\n").encode(), 0o640)

    def role_for(self, thumbprint: str) -> str | None:
        try:
            entry = self.load().get(thumbprint)
        except (OSError, ValueError):
            return None  # an unreadable map grants nothing
        role = entry.get("role") if isinstance(entry, dict) else None
        return role if role in ROLES else None

    def find(self, name_or_thumbprint: str) -> tuple[str, dict] | None:
        for thumb, entry in self.load().items():
            if thumb == name_or_thumbprint or entry.get("name") == name_or_thumbprint:
                return thumb, entry
        return None

    def put(self, thumbprint: str, entry: dict) -> None:
        entries = self.load()
        entries[thumbprint] = entry
        self.save(entries)

    def remove(self, thumbprint: str) -> bool:
        entries = self.load()
        if entries.pop(thumbprint, None) is None:
            return False
        self.save(entries)
        return True
