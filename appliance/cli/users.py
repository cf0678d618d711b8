"""`appliance users add NAME --role ROLE | passwd NAME | remove NAME | list`: accounts for clients without user
certificates (appliance.users.UserStore keeps them).

Passwords are read with getpass (twice), or from the environment variable APPLIANCE_PASSWORD when it is set (for
scripts and tests; it is visible to other processes of the same user, so prefer the prompt interactively). Every
action but list is recorded in the administrative audit trail.
"""
from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from ..users import ROLES, UserError, UserStore
from .common import audit_admin, load_config_arg

PASSWORD_ENV = "APPLIANCE_PASSWORD"


def register(sub) -> None:
    u = sub.add_parser("users", help="accounts for clients without user certificates")
    usub = u.add_subparsers(dest="users_action", required=True)
    x = usub.add_parser("add")
    x.add_argument("name")
    x.add_argument("--role", required=True, choices=list(ROLES))
    x = usub.add_parser("passwd")
    x.add_argument("name")
    x = usub.add_parser("remove")
    x.add_argument("name")
    usub.add_parser("list")
    for action_parser in usub.choices.values():
        action_parser.add_argument("--config")
    u.set_defaults(func=run_users)


def run_users(args) -> int:
    config = load_config_arg(args.config)
    configured = [(u.name, u.role, u.password_hash) for u in config.users]
    code = cmd_users(Path(config.server.state_dir), configured, args.users_action, getattr(args, "name", None),
                     getattr(args, "role", None), None)
    if args.users_action != "list":
        role = f" role={args.role}" if getattr(args, "role", None) else ""
        audit_admin(config, f"users {args.users_action}", f"{args.name}{role}", code)
    return code


def _read_new_password(prompt: Callable[[str], str]) -> str:
    env = os.environ.get(PASSWORD_ENV)
    if env is not None:
        return env
    first = prompt("Password: ")
    if first != prompt("Repeat password: "):
        raise UserError("the passwords do not match")
    return first


def cmd_users(state_dir: Path, configured: Iterable[tuple[str, str, str]], action: str, name: str | None,
              role: str | None, password_source: Callable[[str], str] | None = None) -> int:
    """One `users` action; returns 0, or 2 with a message on stderr.

    `password_source` prompts for a password (default getpass.getpass); APPLIANCE_PASSWORD, when set, wins.
    """
    prompt = password_source or getpass.getpass
    try:
        store = UserStore(Path(state_dir), configured)
        if action == "list":
            rows = store.list()
            if not rows:
                print("no user accounts (create one with `appliance users add NAME --role ROLE`)")
            for user, user_role, source in rows:
                print(f"{user:<24} {user_role:<10} {'configuration file' if source == 'config' else 'users.json'}")
            return 0
        if action not in ("add", "passwd", "remove"):
            raise UserError(f"unknown action {action!r}: add, passwd, remove or list")
        if not name:
            raise UserError(f"`users {action}` needs a user name")
        if action == "add":
            if not role:
                raise UserError(f"`users add` needs --role ({', '.join(ROLES)})")
            store.check_new(name, role)
            store.add(name, role, _read_new_password(prompt))
            print(f"user {name!r} added with role {role}")
        elif action == "passwd":
            store.refuse_configured(name)
            if store.role_of(name) is None:
                raise UserError(f"no user {name!r}")
            store.passwd(name, _read_new_password(prompt))
            print(f"password of user {name!r} changed")
        else:
            store.remove(name)
            print(f"user {name!r} removed")
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (EOFError, KeyboardInterrupt):
        print("error: no password given", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot update the accounts file: {exc.strerror or exc}", file=sys.stderr)
        return 2
