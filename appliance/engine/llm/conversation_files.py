"""Conversations (Converse, slot keys "conv:...") kept in the state directory, so they outlive the worker process
and the appliance: after each finished turn the conversation's tokens and messages are written (atomically) to
`<dir>/<key>.json`; a conversation a fresh engine does not hold comes back from its file at its next call, and its
keys and values are computed again by the prefill (a file holds tokens, not the KV cache: a few KB per turn instead
of ~46 KB per token). Files unused for the conversation TTL are removed at start (those conversations' next calls
say ContextLost, as after the serve process's own TTL); EndConversation and new weights remove them too.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from appliance.engine.llm.slots import Parked
from core.model_port import CONVERSATION_PREFIX as PREFIX

log = logging.getLogger(__name__)


class ConversationFiles:
    def __init__(self, directory: Path, ttl_s: float):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - ttl_s
        self.expired: list[str] = []  # conversations the TTL ended while no engine ran (removed here)
        for f in self.directory.glob("*.json"):
            try:
                if f.stat().st_mtime < cutoff:
                    f.unlink()
                    self.expired.append(PREFIX + f.stem)
            except OSError:
                pass

    def _path(self, session: str) -> Path | None:
        if not session.startswith(PREFIX):
            return None
        name = session[len(PREFIX):]
        return self.directory / f"{name}.json" if name.isalnum() else None

    def save(self, session: str, tokens: list[int], history: list[dict]) -> None:
        path = self._path(session)
        if path is None:
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"tokens": tokens, "history": history}), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:  # a full disk costs the conversation's survival of a restart, not the answer
            log.warning("could not keep conversation %s: %s", path.name, exc)

    def recall(self, session: str) -> Parked | None:
        path = self._path(session)
        if path is None or not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return Parked([int(t) for t in record["tokens"]], 0, list(record["history"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("conversation file %s unreadable (%s): starting over", path.name, exc)
            return None

    def forget(self, session: str) -> bool:
        """Remove the conversation's file; False when the session is not a conversation."""
        path = self._path(session)
        if path is None:
            return False
        path.unlink(missing_ok=True)
        return True

    def forget_all(self) -> None:
        for f in self.directory.glob("*.json"):
            f.unlink(missing_ok=True)
