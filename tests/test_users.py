"""User accounts: hashes, the accounts file, YAML users, per-source back-off, the `users` CLI."""
from __future__ import annotations

import json
import os
import re
import stat
import time

import pytest

from appliance.cli.users import PASSWORD_ENV, cmd_users
from appliance.users import ROLES, UserError, UserStore
from core.password_hash import hash_password, is_password_hash, verify_password


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_scrypt_hash_format_and_verification():
    stored = hash_password("correct horse")
    assert re.fullmatch(r"scrypt\$n=16384,r=8,p=1\$[A-Za-z0-9+/=]+\$[A-Za-z0-9+/=]+", stored)
    assert verify_password("correct horse", stored)
    assert not verify_password("correct hors", stored)
    assert not verify_password("", stored)
    assert hash_password("correct horse") != stored  # salted
    assert is_password_hash(stored)


def test_tampered_or_malformed_hashes_never_verify():
    stored = hash_password("password1")
    scheme, params, salt, key = stored.split("$")
    other_key = hash_password("password2").split("$")[3]
    assert not verify_password("password1", "$".join([scheme, params, salt, other_key]))
    for bad in ("", "password1", "scrypt$n=16384,r=8,p=1$$", "scrypt$n=3,r=8,p=1$" + salt + "$" + key,
                "scrypt$n=1073741824,r=8,p=1$" + salt + "$" + key, "md5$abc", "$argon2id$garbage"):
        assert not verify_password("password1", bad), bad
        assert bad.startswith("$argon2id$") or not is_password_hash(bad)


def test_argon2id_hashes_verify():
    from argon2 import PasswordHasher

    stored = PasswordHasher(time_cost=1, memory_cost=8192, parallelism=1).hash("plc-secret-1")
    assert stored.startswith("$argon2id$")
    assert verify_password("plc-secret-1", stored)
    assert not verify_password("plc-secret-2", stored)


def test_no_account_until_one_is_made(tmp_path):
    store = UserStore(tmp_path)
    assert store.list() == []
    assert store.authenticate("admin", "admin", "10.0.0.1") is None
    assert store.authenticate("admin", "", "10.0.0.2") is None


def test_add_writes_a_private_file_without_the_password(tmp_path):
    store = UserStore(tmp_path)
    store.add("s7plc", "operator", "s7-password")
    path = tmp_path / "access" / "users.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "s7-password" not in text
    entry = json.loads(text)["users"]["s7plc"]
    assert entry["role"] == "operator" and verify_password("s7-password", entry["hash"])
    assert store.authenticate("s7plc", "s7-password", "10.0.0.5") == "operator"
    assert store.list() == [("s7plc", "operator", "cli")]


def test_refuses_bad_names_roles_passwords_and_duplicates(tmp_path):
    store = UserStore(tmp_path)
    with pytest.raises(UserError, match="role"):
        store.add("bob", "admin", "longenough")
    with pytest.raises(UserError, match="user name"):
        store.add("bob smith", "operator", "longenough")
    with pytest.raises(UserError, match="too short"):
        store.add("bob", "operator", "short")
    store.add("bob", "operator", "longenough")
    with pytest.raises(UserError, match="already exists"):
        store.add("bob", "engineer", "longenough2")
    with pytest.raises(UserError, match="no user"):
        store.remove("alice")
    with pytest.raises(UserError, match="no user"):
        store.passwd("alice", "longenough")


def test_a_running_store_sees_cli_edits_without_restart(tmp_path):
    server = UserStore(tmp_path)
    cli = UserStore(tmp_path)
    assert server.authenticate("eng", "first-password", "a") is None
    cli.add("eng", "engineer", "first-password")
    assert server.authenticate("eng", "first-password", "b") == "engineer"
    UserStore(tmp_path).passwd("eng", "second-password")
    assert server.authenticate("eng", "first-password", "c") is None
    assert server.authenticate("eng", "second-password", "d") == "engineer"
    UserStore(tmp_path).remove("eng")
    assert server.authenticate("eng", "second-password", "e") is None
    assert server.list() == []


def test_configured_users_authenticate_and_are_read_only(tmp_path):
    configured = [("scada", "monitor", hash_password("scada-pass"))]
    store = UserStore(tmp_path, configured)
    assert store.authenticate("scada", "scada-pass", "10.1.1.1") == "monitor"
    assert store.list() == [("scada", "monitor", "config")]
    for change in (lambda: store.add("scada", "engineer", "whatever1"), lambda: store.passwd("scada", "whatever1"),
                   lambda: store.remove("scada")):
        with pytest.raises(UserError, match="configuration file"):
            change()
    with pytest.raises(UserError, match="hash"):
        UserStore(tmp_path, [("x", "monitor", "plain-text-password")])
    with pytest.raises(UserError, match="role"):
        UserStore(tmp_path, [("x", "root", hash_password("whatever1"))])


def test_backoff_resets_on_success(tmp_path):
    clock = FakeClock()
    store = UserStore(tmp_path, [("op", "operator", hash_password("right-password"))],
                      backoff_s=1.0, backoff_max_s=30.0, clock=clock)
    ip = "192.168.0.10"
    for window in (1.0, 2.0, 4.0):  # three failures in a row: windows 1, 2, 4 s
        assert store.authenticate("op", "wrong-password", ip) is None
        clock.now += window
    assert store.authenticate("op", "right-password", ip) == "operator"  # success resets the count
    assert store.authenticate("op", "wrong-password", ip) is None
    clock.now += 0.99
    assert store.authenticate("op", "right-password", ip) is None  # window is 1 s again, not 8 s
    clock.now += 0.01
    assert store.authenticate("op", "right-password", ip) == "operator"


def test_backoff_forgets_after_a_quiet_period(tmp_path):
    clock = FakeClock()
    store = UserStore(tmp_path, [("op", "operator", hash_password("right-password"))],
                      backoff_s=1.0, backoff_max_s=4.0, clock=clock)
    ip = "10.2.2.2"
    for window in (1.0, 2.0, 4.0):
        assert store.authenticate("op", "wrong-password", ip) is None
        clock.now += window
    clock.now += 4.0  # quiet for backoff_max_s after the last window
    assert store.authenticate("op", "wrong-password", ip) is None
    clock.now += 1.0  # the window restarted at 1 s
    assert store.authenticate("op", "right-password", ip) == "operator"


def test_backoff_window_sequence_is_1_2_4_8_then_capped(tmp_path):
    clock = FakeClock()
    store = UserStore(tmp_path, [("op", "operator", hash_password("right-password"))],
                      backoff_s=1.0, backoff_max_s=8.0, clock=clock)
    ip = "10.9.9.9"
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        failed_at = clock.now
        assert store.authenticate("op", "wrong-password", ip) is None
        clock.now = failed_at + expected - 0.01
        assert store.authenticate("op", "right-password", ip) is None, expected  # still blocked
        clock.now = failed_at + expected  # window over: next attempt is checked (and fails again)
    assert store.authenticate("op", "right-password", ip) == "operator"


def test_backoff_is_per_source(tmp_path):
    clock = FakeClock()
    store = UserStore(tmp_path, [("op", "operator", hash_password("right-password"))], clock=clock)
    assert store.authenticate("op", "wrong-password", "10.0.0.66") is None
    assert store.authenticate("op", "right-password", "10.0.0.66") is None  # blocked
    assert store.authenticate("op", "right-password", "10.0.0.7") == "operator"  # another peer is not


def test_unknown_names_cost_as_much_as_known_ones(tmp_path):
    store = UserStore(tmp_path, [("op", "operator", hash_password("right-password"))], backoff_s=0.0)

    def timed(name: str, n: int) -> float:
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            assert store.authenticate(name, "wrong-password", f"{name}-{n}-{i}") is None
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    timed("nobody", 0)  # first call builds the dummy hash
    known, unknown = timed("op", 1), timed("nobody", 2)
    assert unknown > 0.3 * known, (known, unknown)
    assert known > 0.005  # scrypt really ran


def test_cmd_users_with_environment_password(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(PASSWORD_ENV, "env-password")
    assert cmd_users(tmp_path, [], "add", "plc1", "operator", None) == 0
    assert UserStore(tmp_path).authenticate("plc1", "env-password", "x") == "operator"
    assert cmd_users(tmp_path, [], "list", None, None, None) == 0
    assert "plc1" in capsys.readouterr().out
    monkeypatch.setenv(PASSWORD_ENV, "new-env-password")
    assert cmd_users(tmp_path, [], "passwd", "plc1", None, None) == 0
    assert UserStore(tmp_path).authenticate("plc1", "new-env-password", "y") == "operator"
    assert cmd_users(tmp_path, [], "remove", "plc1", None, None) == 0
    assert UserStore(tmp_path).list() == []


def test_cmd_users_prompts_twice_and_explains_refusals(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    answers = iter(["prompted-pass", "prompted-pass"])
    assert cmd_users(tmp_path, [], "add", "hmi", "monitor", lambda prompt: next(answers)) == 0
    assert UserStore(tmp_path).authenticate("hmi", "prompted-pass", "z") == "monitor"

    mismatch = iter(["one-password", "two-password"])
    assert cmd_users(tmp_path, [], "add", "hmi2", "monitor", lambda prompt: next(mismatch)) == 2
    assert "do not match" in capsys.readouterr().err

    short = iter(["short", "short"])
    assert cmd_users(tmp_path, [], "add", "hmi3", "monitor", lambda prompt: next(short)) == 2
    assert "at least 8" in capsys.readouterr().err

    assert cmd_users(tmp_path, [], "add", "hmi4", "superuser", lambda prompt: "x" * 10) == 2
    err = capsys.readouterr().err
    assert all(role in err for role in ROLES)

    configured = [("yamluser", "engineer", hash_password("yaml-password"))]
    assert cmd_users(tmp_path, configured, "remove", "yamluser", None, None) == 2
    assert "configuration file" in capsys.readouterr().err
    assert cmd_users(tmp_path, [], "remove", "ghost", None, None) == 2
    assert "no user 'ghost'" in capsys.readouterr().err
    assert cmd_users(tmp_path, configured, "list", None, None, None) == 0
    out = capsys.readouterr().out
    assert "yamluser" in out and "configuration file" in out and "hmi" in out
    assert os.listdir(tmp_path / "access")  # the file exists, only hmi in it
    assert list(json.loads((tmp_path / "access" / "users.json").read_text())["users"]) == ["hmi"]


def test_a_damaged_accounts_file_keeps_the_last_good_accounts(tmp_path, monkeypatch, capsys):
    server = UserStore(tmp_path)
    server.add("op", "operator", "op-password")
    assert server.authenticate("op", "op-password", "a") == "operator"
    path = tmp_path / "access" / "users.json"
    path.write_text("{ not json")
    assert server.authenticate("op", "op-password", "b") == "operator"  # a bad hand edit does not lock PLCs out
    monkeypatch.setenv(PASSWORD_ENV, "other-password")
    assert cmd_users(tmp_path, [], "add", "op2", "operator", None) == 2
    assert "damaged" in capsys.readouterr().err
