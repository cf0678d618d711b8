"""`appliance sources list | test NAME | trust NAME [--yes THUMBPRINT] | passwd NAME`: the OPC UA servers the
appliance reads as a client (YAML `sources`).

`trust` connects (GetEndpoints, which needs no security), shows the certificate of the endpoint with the configured
policy and mode (subject, thumbprint, validity, ApplicationUri) and stores it as the source's only trusted
certificate once confirmed: at the prompt, or with `--yes THUMBPRINT` naming exactly that certificate (scripts).
Nothing is ever trusted on first use by the appliance itself. `test` connects as serve would, resolves and reads
every node once, prints value, status and SourceTimestamp, and exits 2 naming what failed. `passwd` stores the
password of the source's `user` in the state directory (never in the YAML); APPLIANCE_PASSWORD, when set, is used
instead of the prompt. trust and passwd are recorded in the administrative audit trail.
"""
from __future__ import annotations

import asyncio
import getpass
import os
import sys
from pathlib import Path

from .common import audit_admin, fail, load_config_arg

PASSWORD_ENV = "APPLIANCE_PASSWORD"


def register(sub) -> None:
    s = sub.add_parser("sources", help="the OPC UA servers the appliance reads (YAML sources)")
    ssub = s.add_subparsers(dest="sources_action", required=True)
    ssub.add_parser("list")
    x = ssub.add_parser("test")
    x.add_argument("name")
    x = ssub.add_parser("trust")
    x.add_argument("name")
    x.add_argument("--yes", metavar="THUMBPRINT", help="trust without asking, if the server presents this certificate")
    x = ssub.add_parser("passwd")
    x.add_argument("name")
    for action_parser in ssub.choices.values():
        action_parser.add_argument("--config")
    s.set_defaults(func=run_sources)


def run_sources(args) -> int:
    config = load_config_arg(args.config)
    action = args.sources_action
    if action == "list":
        return _list(config)
    src = config.sources.get(args.name)
    if src is None:
        return fail(f"no source {args.name!r} in {config.source} (sources: {', '.join(config.sources) or 'none'})")
    state_dir = Path(config.server.state_dir)
    if action == "passwd":
        code = _passwd(src, state_dir)
    elif action == "trust":
        code = _trust(src, state_dir, args.yes)
    else:
        return _test(config, src, state_dir)
    audit_admin(config, f"sources {action}", f"{src.name}", code)
    return code


def _spec(src, state_dir: Path):
    from certs.pki import PKI

    from ..sources.identity import SourceFiles
    from ..sources.specs import source_spec
    if src.security_policy != "None":
        if not PKI(state_dir).exists():
            raise RuntimeError("the appliance has no PKI yet: run `appliance certs init` (or start serve once)")
        SourceFiles.of(state_dir, src.name).ensure_client_certificate(state_dir, src.name)
    return source_spec(src, state_dir)


def _list(config) -> int:
    from certs.x509io import thumbprint

    from ..sources.identity import SourceFiles
    if not config.sources:
        print("no sources configured")
        return 0
    for name, src in config.sources.items():
        trusted = SourceFiles.of(Path(config.server.state_dir), name).trusted_der()
        trust = f"trusts {thumbprint(trusted)}" if trusted else "server certificate not trusted yet"
        feeds = ", ".join(f"{f} -> {c.model}" for f, c in src.feeds.items()) or "no feeds"
        print(f"{name:<20} {src.endpoint}  {src.security_policy}/{src.security_mode}"
              f"{'' if src.enabled else '  (disabled)'}  {len(src.nodes)} nodes, {feeds}; {trust}")
    return 0


def _passwd(src, state_dir: Path) -> int:
    from ..sources.identity import SourceFiles
    if not src.user:
        return fail(f"source {src.name!r} has no `user` in the YAML: a password is for a user name")
    password = os.environ.get(PASSWORD_ENV)
    if password is None:
        try:
            password = getpass.getpass(f"Password of {src.user} on {src.name}: ")
            if password != getpass.getpass("Repeat password: "):
                return fail("the passwords do not match")
        except (EOFError, KeyboardInterrupt):
            return fail("no password given")
    if not password:
        return fail("the password is empty")
    SourceFiles.of(state_dir, src.name).set_password(password)
    print(f"password of {src.user!r} for source {src.name!r} stored in the state directory")
    return 0


def _trust(src, state_dir: Path, yes: str | None) -> int:
    from certs.x509io import normalize_thumbprint, thumbprint

    from ..sources.identity import SourceFiles, describe_certificate
    from ..sources.session import SourceProblem, server_certificate
    if src.security_policy == "None":
        return fail(f"source {src.name!r} uses security policy None: there is no certificate to trust")
    try:
        der = asyncio.run(server_certificate(_spec(src, state_dir)))
    except (SourceProblem, RuntimeError) as e:
        return fail(str(e))
    if not der:
        return fail(f"the server at {src.endpoint} presents no certificate")
    info = describe_certificate(der)
    print(f"source {src.name} at {src.endpoint} presents:\n"
          f"  subject         {info['subject']}\n  issuer          {info['issuer']}\n"
          f"  thumbprint      {info['thumbprint']}\n  valid           {info['not_before']} .. {info['not_after']}\n"
          f"  ApplicationUri  {info['application_uri'] or '(none)'}")
    files = SourceFiles.of(state_dir, src.name)
    before = files.trusted_der()
    if before is not None and thumbprint(before) == info["thumbprint"]:
        print("already trusted")
        return 0
    if before is not None:
        print(f"it replaces the certificate trusted until now ({thumbprint(before)})")
    if yes is not None:
        if normalize_thumbprint(yes) != info["thumbprint"]:
            return fail(f"--yes {yes} does not name this certificate (thumbprint {info['thumbprint']}): "
                        "nothing trusted")
    else:
        try:
            answer = input("Trust this certificate for this source? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            return fail("not trusted")
    files.trust(der)
    print(f"trusted for source {src.name}; a running appliance uses it from its next connection attempt after a "
          "restart of serve")
    return 0


def _test(config, src, state_dir: Path) -> int:
    from ..sources.session import SourceProblem
    try:
        spec = _spec(src, state_dir)
        problems = asyncio.run(_probe(spec, src))
    except (SourceProblem, RuntimeError) as e:
        return fail(f"source {src.name}: {e}")
    for line in problems:
        print(f"appliance: source {src.name}: {line}", file=sys.stderr)
    if problems:
        return 2
    print(f"source {src.name}: every node resolved and read")
    return 0


async def _probe(spec, src) -> list[str]:
    """Connect, resolve, read every node once and print it; what does not fit the feeds, as lines."""
    from ..sources.session import connect, read_once, resolve
    from ..sources.windows import severity
    client = await connect(spec)
    problems = []
    try:
        nodeids = await resolve(client, spec)
        values = await read_once(client, spec, nodeids)
        columns = {c for f in src.feeds.values() for c in f.columns} | {f.trigger for f in src.feeds.values()
                                                                          if f.trigger}
        for node, nodeid, dv in zip(spec.nodes, nodeids, values):
            value = dv.Value.Value if dv.Value is not None else None
            status = dv.StatusCode.name if dv.StatusCode is not None else "Good"
            when = dv.SourceTimestamp.isoformat() if dv.SourceTimestamp else "no SourceTimestamp"
            shown = value if not isinstance(value, (list, tuple)) else f"array of {len(value)}"
            print(f"{node.name:<24} {nodeid.to_string():<40} {shown!s:<24} {status:<20} {when}")
            code = dv.StatusCode.value if dv.StatusCode is not None else 0
            if node.name in columns and (isinstance(value, bool) or not isinstance(value, (int, float))):
                problems.append(f"node {node.name}: a feed needs a number, the server has "
                                f"{'an array' if isinstance(value, (list, tuple)) else type(value).__name__}")
            elif node.name in columns and severity(code) != "Good":
                problems.append(f"node {node.name}: status {status}")
    finally:
        try:
            await asyncio.wait_for(client.disconnect(), 2)
        except Exception:  # noqa: BLE001 - the probe's result stands
            pass
    return problems
