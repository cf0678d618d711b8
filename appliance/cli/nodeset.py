"""`appliance nodeset [--config FILE] [--out FILE]`: the configured appliance's ObjectTypes and instances as an OPC UA
NodeSet2 XML file (appliance.nodeset_export writes it), for TIA Portal client interfaces, CODESYS, UaModeler."""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from .common import fail, load_config_arg


def register(sub) -> None:
    s = sub.add_parser("nodeset", help="the information model (types and instances) as NodeSet2 XML")
    s.add_argument("--config")
    s.add_argument("--out", help="the file to write (default: standard output)")
    s.set_defaults(func=run_nodeset)


def run_nodeset(args) -> int:
    from ..nodeset_export import export_nodeset
    config = load_config_arg(args.config)
    try:
        if args.out:
            count = asyncio.run(export_nodeset(config, Path(args.out)))
            print(f"wrote {args.out} ({count} nodes)")
            return 0
        with tempfile.TemporaryDirectory() as d:
            target = Path(d) / "appliance.NodeSet2.xml"
            asyncio.run(export_nodeset(config, target))
            sys.stdout.write(target.read_text(encoding="utf-8"))
        return 0
    except OSError as e:
        return fail(f"cannot write {args.out}: {e.strerror}")
