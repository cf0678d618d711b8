"""User name + password accounts, for OPC UA clients that cannot present a user certificate (an S7-1500 cannot).

Passwords are stored only as hashes: scrypt (created by default, `scrypt$n=16384,r=8,p=1$<salt b64>$<hash b64>`)
or argon2id (`$argon2id$...`, verified when argon2-cffi is installed). No account exists until an engineer makes one.

Accounts come from two places:
- `state_dir/access/users.json` (mode 0600), managed by `appliance users ...`; re-read whenever it changes on disk,
  so CLI edits take effect in a running server without a restart;
- the YAML `users:` section, read-only here (the CLI refuses to change those and says to edit the file).

`appliance users ...` is appliance/cli/users.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from core.password_hash import MAX_PASSWORD_CHARS, hash_password, is_password_hash, verify_password

log = logging.getLogger("appliance.users")

ROLES = ("monitor", "operator", "engineer", "security_admin")
MIN_PASSWORD_CHARS = 8
# Letters, digits and a few separators: safe in a PLC's STRING, a shell and a log line (same rule as the YAML).
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


class UserError(ValueError):
    """A refused account operation; the message is meant for the engineer at the CLI."""


@dataclass(frozen=True)
class Account:
    name: str
    role: str
    password_hash: str
    source: str  # "cli" (users.json) or "config" (YAML)


@dataclass
class _SourceState:
    """Failed-login bookkeeping for one peer address."""
    lock: threading.Lock = field(default_factory=threading.Lock)  # one verification at a time per peer
    failures: int = 0
    blocked_until: float = 0.0
    holders: int = 0  # threads inside authenticate() for this peer; the entry is dropped when 0 and clean


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise UserError(f"invalid user name {name!r}: 1-64 characters A-Z a-z 0-9 _ . @ -")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise UserError(f"invalid role {role!r}: one of {', '.join(ROLES)}")


def _check_password(password: str) -> None:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD_CHARS:
        raise UserError(f"password too short: at least {MIN_PASSWORD_CHARS} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise UserError(f"password too long: at most {MAX_PASSWORD_CHARS} characters")


class UserStore:
    """Accounts and login checks. Thread-safe: the UA layer may call authenticate() from worker threads."""

    def __init__(self, state_dir: Path, configured: Iterable[tuple[str, str, str]] = (), *,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_tracked_sources: int = 4096):
        self.path = Path(state_dir) / "access" / "users.json"
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self._clock = clock
        self._max_tracked_sources = max_tracked_sources
        self._configured: dict[str, Account] = {}
        for name, role, password_hash in configured:
            _check_name(name)
            _check_role(role)
            if not is_password_hash(password_hash):
                raise UserError(f"user {name!r} in the configuration: the password hash is not a scrypt or "
                                "argon2id hash (make one with `appliance users add` and copy it from users.json)")
            self._configured[name] = Account(name, role, password_hash, "config")
        self._lock = threading.Lock()
        self._file_accounts: dict[str, Account] = {}
        self._file_stamp: tuple | None = None
        self._sources: dict[str, _SourceState] = {}
        self._dummy_hash: str | None = None

    # ---- the accounts file -------------------------------------------------------------------------------------

    def _reload_if_changed(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp == self._file_stamp:
                return
            if stamp is None:
                self._file_accounts, self._file_stamp = {}, None
                return
            try:
                accounts = self._read_file()
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # Writes are atomic (rename), so this is a hand edit gone wrong: keep the last good accounts.
                log.error("accounts file %s unreadable, keeping the previous accounts: %s", self.path, exc)
                self._file_stamp = stamp
                return
            self._file_accounts, self._file_stamp = accounts, stamp

    def _read_file(self) -> dict[str, Account]:
        data = json.loads(self.path.read_text(encoding="utf-8"))
        accounts = {}
        for name, entry in data["users"].items():
            if entry["role"] not in ROLES or not is_password_hash(entry["hash"]):
                raise ValueError(f"bad entry for user {name!r}")
            accounts[name] = Account(name, entry["role"], entry["hash"], "cli")
        return accounts

    def _write_file(self, accounts: dict[str, Account]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = {"version": 1, "users": {a.name: {"role": a.role, "hash": a.password_hash}
                                        for a in sorted(accounts.values(), key=lambda a: a.name)}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)  # atomic: a running server never reads half a file
        except BaseException:  # re-raised: whatever stopped the write (interrupt included), no temporary file stays
            with contextlib.suppress(OSError):  # the original error is the one to report
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _editing(self):
        """Read-modify-write of users.json under an exclusive file lock (two CLI runs at once stay consistent)."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_fd = os.open(self.path.with_name("users.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                accounts = self._read_file() if self.path.exists() else {}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"the accounts file {self.path} is damaged ({exc}); fix or remove it") from exc
            yield accounts
            self._write_file(accounts)
        finally:
            os.close(lock_fd)
        self._reload_if_changed()

    def refuse_configured(self, name: str) -> None:
        """UserError when `name` is defined in the YAML (`users:`): only the file changes those, never the CLI."""
        if name in self._configured:
            raise UserError(f"user {name!r} is defined in the configuration file (users: section); "
                            "edit that file to change or remove it")

    # ---- administration (the CLI) ------------------------------------------------------------------------------

    def check_new(self, name: str, role: str) -> None:
        """UserError when `add(name, role, ...)` would refuse the name or the role (asked before a password is)."""
        _check_name(name)
        _check_role(role)
        self.refuse_configured(name)

    def add(self, name: str, role: str, password: str) -> None:
        _check_name(name)
        _check_role(role)
        _check_password(password)
        self.refuse_configured(name)
        with self._editing() as accounts:
            if name in accounts:
                raise UserError(f"user {name!r} already exists (use `appliance users passwd {name}`)")
            accounts[name] = Account(name, role, hash_password(password), "cli")

    def passwd(self, name: str, password: str) -> None:
        _check_password(password)
        self.refuse_configured(name)
        with self._editing() as accounts:
            if name not in accounts:
                raise UserError(f"no user {name!r}")
            accounts[name] = Account(name, accounts[name].role, hash_password(password), "cli")

    def remove(self, name: str) -> None:
        self.refuse_configured(name)
        with self._editing() as accounts:
            if accounts.pop(name, None) is None:
                raise UserError(f"no user {name!r}")

    def list(self) -> list[tuple[str, str, str]]:
        """(name, role, source) for every account, source "config" or "cli"; a YAML user hides a file user."""
        self._reload_if_changed()
        with self._lock:
            merged = {**self._file_accounts, **self._configured}
        return [(a.name, a.role, a.source) for a in sorted(merged.values(), key=lambda a: a.name)]

    def role_of(self, name: str) -> str | None:
        self._reload_if_changed()
        account = self._lookup(name)
        return account.role if account else None

    def _lookup(self, name: str) -> Account | None:
        with self._lock:
            return self._configured.get(name) or self._file_accounts.get(name)

    # ---- login ------------------------------------------------------------------------------------------------

    def authenticate(self, name: str, password: str, source: str) -> str | None:
        """The account's role when name and password match, else None.

        Per peer (`source`, its IP): after a failure, attempts within the back-off window fail without checking;
        the window starts at backoff_s and doubles with each consecutive failure up to backoff_max_s; a success
        resets it, and so does a quiet period of backoff_max_s after the window ends. Unknown names are verified
        against a dummy hash so they take as long as known ones (no user enumeration by timing).
        """
        with self._lock:
            state = self._sources.get(source)
            if state is None:
                self._prune_sources()
                state = self._sources[source] = _SourceState()
            state.holders += 1
        try:
            with state.lock:  # a burst of parallel guesses from one peer is checked one by one
                now = self._clock()
                if now < state.blocked_until:
                    log.warning("login refused for user %r from %s: back-off (%.1f s left)",
                                name, source, state.blocked_until - now)
                    return None
                if state.failures and now >= state.blocked_until + self.backoff_max_s:
                    state.failures = 0  # quiet long enough: forget old failures
                role = self._check(name, password)
                if role is None:
                    state.failures += 1
                    window = min(self.backoff_s * 2 ** (state.failures - 1), self.backoff_max_s)
                    state.blocked_until = self._clock() + window
                    log.warning("login failed for user %r from %s (%d in a row; next attempt in %.1f s)",
                                name, source, state.failures, window)
                else:
                    state.failures, state.blocked_until = 0, 0.0
                return role
        finally:
            with self._lock:
                state.holders -= 1
                if state.holders == 0 and state.failures == 0:
                    self._sources.pop(source, None)

    def _check(self, name: str, password: str) -> str | None:
        self._reload_if_changed()
        account = self._lookup(name) if isinstance(name, str) else None
        if account is None:
            if self._dummy_hash is None:
                self._dummy_hash = hash_password(secrets.token_urlsafe(16))
            verify_password(password if isinstance(password, str) else "", self._dummy_hash)
            return None
        return account.role if verify_password(password, account.password_hash) else None

    def _prune_sources(self) -> None:
        """Bound memory under a spray from many addresses: drop idle peers whose window ended long ago."""
        if len(self._sources) < self._max_tracked_sources:
            return
        now = self._clock()
        for src, st in list(self._sources.items()):
            if st.holders == 0 and now >= st.blocked_until + self.backoff_max_s:
                del self._sources[src]
