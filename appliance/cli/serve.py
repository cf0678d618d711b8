"""`appliance serve` (run the appliance) and `appliance check-config FILE` (validate a configuration file)."""
from __future__ import annotations

import asyncio
import sys

from .common import load_config_arg


def register(sub) -> None:
    s = sub.add_parser("serve", help="run the appliance (no --config: the built-in demo)")
    s.add_argument("--config")
    s.set_defaults(func=run_serve)

    s = sub.add_parser("check-config", help="validate a configuration file")
    s.add_argument("file")
    s.set_defaults(func=run_check_config)


def run_serve(args) -> int:
    from ..daemon import configure_logging, serve
    config = load_config_arg(args.config)
    configure_logging(config)
    return asyncio.run(serve(config))


def run_check_config(args) -> int:
    return check_config_main(args.file)


def check_config_main(path: str) -> int:
    """`appliance check-config FILE`: 0 and an OK line, or 2 with every problem on stderr."""
    from core.config import ConfigError, load_config
    try:
        cfg = load_config(path, spelling=True)  # and every task's enum values against the model's tokenizer
    except ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        count = len(e.errors)
        print(f"{path}: {count} problem{'s' if count != 1 else ''} found", file=sys.stderr)
        return 2
    for warning in cfg.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    names = ", ".join(cfg.models)
    count = len(cfg.models)
    print(f"OK: {path} ({count} model{'s' if count != 1 else ''}: {names})")
    from core.config.checks import trust_list_notes
    for note in trust_list_notes(cfg):
        print(note, file=sys.stderr)
    return 0
