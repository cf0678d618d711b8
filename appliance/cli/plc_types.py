"""`appliance plc-types MODEL --format scl|plcopenxml`: PLC data types for a model's methods and its tasks'
(appliance.plc_types writes them): SCL for TIA Portal, PLCopen XML for CODESYS and TwinCAT."""
from __future__ import annotations

import sys
from pathlib import Path

from .common import fail, load_config_arg


def register(sub) -> None:
    s = sub.add_parser("plc-types", help="PLC data types for a model's methods: TIA Portal SCL or PLCopen XML")
    s.add_argument("model")
    s.add_argument("--format", required=True, choices=["scl", "plcopenxml"])
    s.add_argument("--out", help="folder for MODEL.scl / MODEL.xml (default: standard output)")
    s.add_argument("--choose-options", type=int, default=4, metavar="N",
                   help="generative models: how many options the PLC passes to Choose (1-16; its Options and "
                   "Scores arrays; default 4)")
    s.add_argument("--config")
    s.set_defaults(func=run_plc_types)


def run_plc_types(args) -> int:
    from ..plc_types import PlcTypesError, write_plc_types
    config = load_config_arg(args.config)
    model = config.models.get(args.model)
    if model is None:
        return fail(f"no model '{args.model}' in {config.source}; models: {', '.join(config.models)}")
    from core.model_port import CHOOSE_MAX_OPTIONS
    if not 1 <= args.choose_options <= CHOOSE_MAX_OPTIONS:
        return fail(f"--choose-options must be between 1 and {CHOOSE_MAX_OPTIONS}, got {args.choose_options}")
    try:
        text, target = write_plc_types(model, args.format, Path(args.out) if args.out else None,
                                       args.choose_options)
    except (PlcTypesError, OSError) as e:
        return fail(str(e))
    if target is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {target}")
    return 0
