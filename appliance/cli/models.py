"""`appliance models list | deploy | rollback | prepare | promote`: model versions on disk (appliance.model_store),
switched only once a version has loaded; A/B promotion (appliance.variants); weights prepared for this CPU
(appliance.model_prepare). deploy, rollback and promote are recorded in the administrative audit trail."""
from __future__ import annotations

from pathlib import Path

from .common import audit_admin, audit_implicit_certificate, fail, load_config_arg


def register(sub) -> None:
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
    x.add_argument("name", nargs="?", help="default: every generative model of the configuration")
    x = msub.add_parser("promote", help="send all of NAME's traffic to one of its A/B variants (Admin/PromoteVariant)")
    x.add_argument("name")
    x.add_argument("variant", help="a variant of the YAML, 'main' for the model's own path, '' for the split again")
    for action_parser in msub.choices.values():
        action_parser.add_argument("--config")
    m.set_defaults(func=run_models)


def run_models(args) -> int:
    config = load_config_arg(args.config)
    if args.models_action == "prepare":  # touches no versions: no commissioning identity, nothing to audit
        from ..model_prepare import prepare
        names = [args.name] if args.name else [n for n, m in config.models.items() if m.kind == "generative"]
        if not names:
            print(f"{config.source}: no generative model to prepare")
        for name in names:
            code, text = prepare(config, name)
            if code:
                return fail(text)
            print(text, flush=True)
        return 0
    engineer = Path(config.server.state_dir) / "clients" / "commissioning-engineer.der"
    existed = engineer.exists()
    try:
        return _change(args, config)
    finally:
        if not existed and engineer.exists():  # deploy/rollback/promote issued the box's engineer certificate
            audit_implicit_certificate(config, "models", "commissioning-engineer", "engineer", engineer)


def _change(args, config) -> int:
    """list, promote, deploy or rollback; every outcome but list's is audited."""
    from ..model_deploy import switch_checked
    from ..model_store import ModelStore, ModelStoreError
    store = ModelStore(Path(config.server.state_dir))
    action = args.models_action
    try:
        if action == "list":
            return _list_models(store, config, args.name)
        if args.name not in config.models:
            return fail(f"no model '{args.name}' in {config.source}; models: {', '.join(config.models)}")
        if action == "promote":
            from ..variants import request_promote
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
        return fail(str(e))
    if not result.ok:
        audit_admin(config, f"models {action}", f"{detail}: {result.message}", 2, event=action)
        return fail(f"{args.name}: {result.message}")
    audit_admin(config, f"models {action}", detail, 0, event=action)
    print(f"{args.name}: version {version} serves from {store.model_dir(args.name) / 'current'}")
    print(result.message)
    return 0


def _list_models(store, config, name: str | None) -> int:
    """Every configured model (and any other the store holds): its versions, or where it serves from."""
    from core.config import BUILTIN_MODELS
    names = [name] if name else sorted(set(store.names()) | set(config.models))
    for name in names:
        versions = store.versions(name)
        m = config.models.get(name)
        if versions:
            print(f"{name}: {len(versions)} version(s)" + ("" if m else " (not in the configuration)"))
        elif m is None:
            return fail(f"no model '{name}' in {config.source} and no version of it deployed")
        elif m.path.startswith("builtin:") and m.path.removeprefix("builtin:") in BUILTIN_MODELS:
            print(f"{name}: built-in ({m.path}), no version deployed")
        else:
            print(f"{name}: the configured path ({m.path}), no version deployed")
        for v in reversed(versions):  # newest first
            mark = ("* serving" if v.serving else "  previous" if v.previous else
                    "  candidate (being checked, or a deploy was interrupted)" if v.candidate else "")
            print(f"  {v.version:24s} sha256:{v.digest[:16]}  {v.deployed_at}  {mark}".rstrip())
    return 0
