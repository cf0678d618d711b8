"""The `appliance` command line: serve, check-config, certs, users, call, audit, plc-types, models.

Every failure ends with a clear message on stderr and exit status 2; nothing prints a stack trace.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import logging
import socket
import sys
from pathlib import Path

DEFAULT_CONFIG = Path("/etc/appliance/appliance.yaml")


def load_config_arg(path: str | None):
    """--config FILE; without it the installed file if there is one, else the built-in demo."""
    from .config import demo_config, load_config
    if path:
        return load_config(path)
    if DEFAULT_CONFIG.exists():
        return load_config(DEFAULT_CONFIG)
    return demo_config()


def _fail(message: str) -> int:
    print(f"appliance: {message}", file=sys.stderr)
    return 2


def cmd_serve(args) -> int:
    from .daemon import configure_logging, serve
    config = load_config_arg(args.config)
    configure_logging(config)
    return asyncio.run(serve(config))


def cmd_check_config(args) -> int:
    from .config import check_config_main
    return check_config_main(args.file)


def audit_admin(config, action: str, detail: str, code: int, event: str = "admin") -> None:
    """Administrative CLI actions go to their own hash chain (admin.jsonl): the running daemon owns audit.jsonl,
    and two writers on one chain would break it."""
    import getpass
    if not config.audit.enabled:
        return
    from .audit import AuditLog
    log = AuditLog(Path(config.audit.path).with_name("admin.jsonl"), max_bytes=config.audit.max_bytes,
                   keep_files=config.audit.keep_files)
    try:
        from uaserver.session import new_correlation_id
        log.record(event=event, action=action, correlation_id=new_correlation_id(), session="", client="",
                   user=f"cli:{getpass.getuser()}", role="engineer", status="Good" if code == 0 else "Bad",
                   detail=detail)
    finally:
        log.close()


def cmd_certs(args) -> int:
    config = load_config_arg(args.config)
    code = _certs(args, config)
    if args.certs_action not in ("list", "export-server"):
        subject = getattr(args, "name", None) or getattr(args, "file", None) or ""
        role = f" role={args.role}" if getattr(args, "role", None) else ""
        audit_admin(config, f"certs {args.certs_action}", f"{subject}{role}", code)
    return code


def _certs(args, config) -> int:
    from certs import cli as certs_cli

    from .daemon import certificate_names
    state_dir = Path(config.server.state_dir)
    action = args.certs_action
    if action == "init":
        hostnames, ips = certificate_names(config)
        return certs_cli.cmd_init(state_dir, config.server.application_uri, hostnames, ips, args.force,
                                 new_ca=args.new_ca)
    if action == "issue":
        out = Path(args.out) if args.out else None
        return certs_cli.cmd_issue(state_dir, args.name, args.role, out, socket.gethostname(), args.password)
    if action == "list":
        return certs_cli.cmd_list(state_dir)
    if action == "trust":
        return certs_cli.cmd_trust(state_dir, Path(args.file))
    if action == "reject":
        return certs_cli.cmd_reject(state_dir, Path(args.file))
    if action == "revoke":
        return certs_cli.cmd_revoke(state_dir, args.name)
    if action == "export-server":
        return certs_cli.cmd_export_server(state_dir, Path(args.out) if args.out else Path.cwd())
    return _fail(f"unknown certs action {action}")


def cmd_users(args) -> int:
    from .users import cmd_users as run
    config = load_config_arg(args.config)
    configured = [(u.name, u.role, u.password_hash) for u in config.users]
    code = run(Path(config.server.state_dir), configured, args.users_action, getattr(args, "name", None),
               getattr(args, "role", None), None)
    if args.users_action != "list":
        role = f" role={args.role}" if getattr(args, "role", None) else ""
        audit_admin(config, f"users {args.users_action}", f"{args.name}{role}", code)
    return code


def cmd_audit(args) -> int:
    from .audit import cmd_audit_verify
    if args.file:
        return cmd_audit_verify(Path(args.file))
    config = load_config_arg(args.config)
    main_log = Path(config.audit.path)
    codes = [cmd_audit_verify(p) for p in (main_log, main_log.with_name("admin.jsonl")) if p.exists()]
    if not codes:
        return _fail(f"no audit log at {main_log}")
    return max(codes)


def cmd_plc_types(args) -> int:
    from .plc_types import PlcTypesError, write_plc_types
    config = load_config_arg(args.config)
    model = config.models.get(args.model)
    if model is None:
        return _fail(f"no model '{args.model}' in {config.source}; models: {', '.join(config.models)}")
    try:
        text, target = write_plc_types(model, args.format, Path(args.out) if args.out else None)
    except (PlcTypesError, OSError) as e:
        return _fail(str(e))
    if target is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {target}")
    return 0


def cmd_models(args) -> int:
    config = load_config_arg(args.config)
    if args.models_action == "prepare":  # touches no versions: no commissioning identity, nothing to audit
        from .model_prepare import prepare
        code, text = prepare(config, args.name)
        if code:
            return _fail(text)
        print(text)
        return 0
    engineer = Path(config.server.state_dir) / "clients" / "commissioning-engineer.der"
    existed = engineer.exists()
    try:
        return _cmd_models(args, config)
    finally:
        if not existed and engineer.exists():  # deploy/rollback/promote issued the box's engineer certificate
            import hashlib
            audit_admin(config, "certs issue commissioning-engineer", "implicit commissioning certificate for "
                        f"`appliance models`: commissioning-engineer (engineer) "
                        f"x509:{hashlib.sha1(engineer.read_bytes()).hexdigest()}", 0, event="commissioning_certificate")


def _cmd_models(args, config) -> int:
    from .model_store import ModelStore, ModelStoreError, switch_checked
    store = ModelStore(Path(config.server.state_dir))
    action = args.models_action
    try:
        if action == "list":
            return _list_models(store, config, args.name)
        if args.name not in config.models:
            return _fail(f"no model '{args.name}' in {config.source}; models: {', '.join(config.models)}")
        if action == "promote":
            from .variants import request_promote
            ok, detail = request_promote(config, args.name, args.variant)
            audit_admin(config, "models promote", f"{args.name} {args.variant or '(split)'}: {detail}",
                        0 if ok else 2, event="promote")
            print(f"{args.name}: {detail}")
            return 0 if ok else 2
        if action == "deploy":
            version, created = store.add(args.name, Path(args.dir), args.version)
            detail = f"{args.name} {version} from {Path(args.dir).resolve()}"
            if version == store.serving_version(args.name):
                audit_admin(config, "models deploy", detail + ": already serving", 0, event=action)
                print(f"{args.name}: version {version} already serves")
                return 0
        else:
            version, created = store.previous_version(args.name), False
            detail = f"{args.name} {version}"
        print(f"{args.name}: loading version {version} to check it ...", flush=True)
        result = switch_checked(config, args.name, version, created)
    except (ModelStoreError, OSError) as e:
        audit_admin(config, f"models {action}", f"{getattr(args, 'name', '')}: {e}", 2, event=action)
        return _fail(str(e))
    if not result.ok:
        audit_admin(config, f"models {action}", f"{detail}: {result.message}", 2, event=action)
        return _fail(f"{args.name}: {result.message}")
    audit_admin(config, f"models {action}", detail, 0, event=action)
    print(f"{args.name}: version {version} serves from {store.model_dir(args.name) / 'current'}")
    print(result.message)
    return 0


def _list_models(store, config, name: str | None) -> int:
    """Every configured model (and any other the store holds): its versions, or where it serves from."""
    from .config import BUILTIN_MODELS
    names = [name] if name else sorted(set(store.names()) | set(config.models))
    for name in names:
        versions = store.versions(name)
        m = config.models.get(name)
        if versions:
            print(f"{name}: {len(versions)} version(s)" + ("" if m else " (not in the configuration)"))
        elif m is None:
            return _fail(f"no model '{name}' in {config.source} and no version of it deployed")
        elif m.path.startswith("builtin:") and m.path.removeprefix("builtin:") in BUILTIN_MODELS:
            print(f"{name}: built-in ({m.path}), no version deployed")
        else:
            print(f"{name}: the configured path ({m.path}), no version deployed")
        for v in reversed(versions):  # newest first
            mark = ("* serving" if v.serving else "  previous" if v.previous else
                    "  candidate (being checked, or a deploy was interrupted)" if v.candidate else "")
            print(f"  {v.version:24s} sha256:{v.digest[:16]}  {v.deployed_at}  {mark}".rstrip())
    return 0


def parse_floats(text: str) -> list[float]:
    """JSON (a list, nested lists are flattened) or CSV (a header row of names is skipped)."""
    text = text.strip()
    if text.startswith("["):
        data = json.loads(text)

        def flat(x):
            if isinstance(x, list):
                for y in x:
                    yield from flat(y)
            elif isinstance(x, (int, float)) and not isinstance(x, bool):
                yield float(x)
            else:
                raise ValueError(f"not a number: {x!r}")
        return list(flat(data))
    values: list[float] = []
    for row_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in row if c.strip()]
        if not cells:
            continue
        try:
            values.extend(float(c) for c in cells)
        except ValueError:
            if row_no == 1 and not values:
                continue  # a header
            raise ValueError(f"line {row_no}: not a number in {row!r}") from None
    return values


def cmd_call(args) -> int:
    from asyncua import ua

    from .client import call_method, connect, model_node
    config = load_config_arg(args.config)
    state_dir = Path(config.server.state_dir)
    if args.cert and args.key:
        cert, key = Path(args.cert), Path(args.key)
    elif args.cert or args.key:
        return _fail("give both --cert and --key")
    else:
        existed = (state_dir / "clients" / "commissioning.der").exists()
        cert, key = commissioning_identity(state_dir)
        if cert is None:
            return _fail("no client certificate: give --cert and --key (make them with "
                         "`appliance certs issue NAME --role operator`)")
        if not existed:
            audit_commissioning(config, cert)
    port = config.server.port
    endpoint = args.endpoint or f"opc.tcp://127.0.0.1:{port}"
    if args.input is None and args.prompt is None:
        return _fail("give --input (CSV or JSON, a file or inline) or --prompt TEXT")
    if args.input is not None:
        source = Path(args.input)
        try:
            is_file = source.is_file()
        except OSError:  # inline values longer than a file name can be
            is_file = False
        try:
            text = source.read_text() if is_file else args.input
            values = parse_floats(text)
        except (ValueError, OSError) as e:
            return _fail(f"{source if is_file else '--input'}: {e}")

    async def run() -> int:
        try:
            client = await connect(endpoint, cert, key, timeout=args.timeout)
        except Exception as e:
            return _fail(f"cannot connect to {endpoint}: {type(e).__name__}: {e}")
        try:
            model, ns = await model_node(client, args.model)
            if args.input is not None:
                method = await model.get_child(f"{ns}:Infer")
                res = await call_method(client, model, method, [ua.Variant(values, ua.VariantType.Float)])
            else:
                method = await model.get_child(f"{ns}:Generate")
                res = await call_method(client, model, method, [
                    ua.Variant(args.prompt, ua.VariantType.String),
                    ua.Variant(args.max_tokens, ua.VariantType.UInt32),
                    ua.Variant(args.temperature, ua.VariantType.Float)])
            status = res.StatusCode
            print(f"status: {status.name}")
            if not status.is_good():
                bad = [f"argument {i}: {s.name}" for i, s in enumerate(res.InputArgumentResults) if not s.is_good()]
                if bad:
                    print("  " + "; ".join(bad))
                return 1
            names = (["Output", "ModelVersion"] if args.input is not None else
                     ["Text", "TokenCount", "FinishReason", "ContextTokens", "ContextLost", "ModelVersion"])
            for name, var in zip(names, res.OutputArguments):
                value = var.Value
                if name == "Output":
                    value = "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
                print(f"{name}: {value}")
            return 0
        except ua.UaStatusCodeError as e:
            return _fail(f"{args.model}: {e}")
        finally:
            await client.disconnect()
    return asyncio.run(run())


def commissioning_identity(state_dir: Path):
    """On the appliance itself: an operator certificate for commissioning, issued once by the local CA."""
    out = state_dir / "clients"
    cert, key = out / "commissioning.der", out / "commissioning.key.pem"
    if cert.exists() and key.exists():
        return cert, key
    from certs.pki import PKI
    pki = PKI(state_dir)
    if not pki.exists():
        return None, None
    pki.issue("commissioning", "operator", out, socket.gethostname())
    return cert, key


def audit_commissioning(config, cert: Path) -> None:
    """`appliance call` without --cert issued itself an operator certificate: the audit trail says so."""
    import hashlib
    thumb = hashlib.sha1(cert.read_bytes()).hexdigest()
    audit_admin(config, "certs issue commissioning", f"implicit commissioning certificate for `appliance call`: "
                f"commissioning (operator) x509:{thumb}", 0, event="commissioning_certificate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description="OPC UA edge inference appliance")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the appliance (no --config: the built-in demo)")
    s.add_argument("--config")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("check-config", help="validate a configuration file")
    s.add_argument("file")
    s.set_defaults(func=cmd_check_config)

    c = sub.add_parser("certs", help="manage the PKI")
    csub = c.add_subparsers(dest="certs_action", required=True)
    x = csub.add_parser("init", help="create the CA and the server certificate")
    x.add_argument("--force", action="store_true", help="replace the server certificate (the CA is kept)")
    x.add_argument("--new-ca", action="store_true", help="with --force: also replace the CA (every client must "
                   "trust the new one and be issued anew)")
    x = csub.add_parser("issue", help="issue a client certificate, trusted and mapped to a role")
    x.add_argument("name")
    x.add_argument("--role", required=True, choices=["monitor", "operator", "engineer"])
    x.add_argument("--out")
    x.add_argument("--password", help="encrypt the key and the PKCS#12 file with it")
    csub.add_parser("list", help="trusted, issuer and rejected certificates")
    x = csub.add_parser("trust", help="trust a client certificate file")
    x.add_argument("file")
    x = csub.add_parser("reject", help="move a trusted certificate to rejected")
    x.add_argument("file")
    x = csub.add_parser("revoke", help="revoke an issued certificate (takes effect at once)")
    x.add_argument("name")
    x = csub.add_parser("export-server", help="the server certificate and CA as DER and PEM")
    x.add_argument("--out")
    for action_parser in csub.choices.values():
        action_parser.add_argument("--config")
    c.set_defaults(func=cmd_certs)

    u = sub.add_parser("users", help="accounts for clients without user certificates")
    usub = u.add_subparsers(dest="users_action", required=True)
    x = usub.add_parser("add")
    x.add_argument("name")
    x.add_argument("--role", required=True, choices=["monitor", "operator", "engineer"])
    x = usub.add_parser("passwd")
    x.add_argument("name")
    x = usub.add_parser("remove")
    x.add_argument("name")
    usub.add_parser("list")
    for action_parser in usub.choices.values():
        action_parser.add_argument("--config")
    u.set_defaults(func=cmd_users)

    s = sub.add_parser("call", help="call a model as a PLC would (commissioning)")
    s.add_argument("model")
    s.add_argument("--config")
    s.add_argument("--cert")
    s.add_argument("--key")
    s.add_argument("--endpoint")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--input", help="CSV or JSON floats: a file or inline text")
    g.add_argument("--prompt")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--timeout", type=float, default=30.0)
    s.set_defaults(func=cmd_call)

    m = sub.add_parser("models", help="model versions on disk: list, deploy, rollback; A/B variants: promote")
    msub = m.add_subparsers(dest="models_action", required=True)
    x = msub.add_parser("list", help="versions, digests and which serves")
    x.add_argument("name", nargs="?")
    x = msub.add_parser("deploy", help="copy DIR in as a new version of NAME and make it serve")
    x.add_argument("name")
    x.add_argument("dir")
    x.add_argument("--version", help="version label (default: the first 12 hex digits of the content digest)")
    x = msub.add_parser("rollback", help="make the previous version serve again")
    x.add_argument("name")
    x = msub.add_parser("prepare", help="measure the weight paths on this CPU, lay out the weights and compile the "
                        "decode step, so every start serves at full speed from Ready")
    x.add_argument("name")
    x = msub.add_parser("promote", help="send all of NAME's traffic to one of its A/B variants (Admin/PromoteVariant)")
    x.add_argument("name")
    x.add_argument("variant", help="a variant of the YAML, 'main' for the model's own path, '' for the split again")
    for action_parser in msub.choices.values():
        action_parser.add_argument("--config")
    m.set_defaults(func=cmd_models)

    s = sub.add_parser("plc-types", help="PLC data types for a model's methods: TIA Portal SCL or PLCopen XML")
    s.add_argument("model")
    s.add_argument("--format", required=True, choices=["scl", "plcopenxml"])
    s.add_argument("--out", help="folder for MODEL.scl / MODEL.xml (default: standard output)")
    s.add_argument("--config")
    s.set_defaults(func=cmd_plc_types)

    a = sub.add_parser("audit", help="the audit trail")
    asub = a.add_subparsers(dest="audit_action", required=True)
    x = asub.add_parser("verify", help="check the hash chain; names the first broken line")
    x.add_argument("file", nargs="?")
    x.add_argument("--config")
    a.set_defaults(func=cmd_audit)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncua").setLevel(logging.ERROR)  # its client warns about every client certificate
    from .config import ConfigError
    try:
        return args.func(args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
