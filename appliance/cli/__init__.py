"""The `appliance` command line: serve, check-config, certs, users, call, models, plc-types, audit.

One module per verb group declares its subparser(s) and handler(s); the library modules do the work, the CLI parses,
calls, prints and chooses the exit code. Every failure ends with a clear message on stderr and exit status 2;
nothing prints a stack trace.

    common.py     --config (installed file, else the demo), the error exit, the administrative audit trail
    serve.py      serve, check-config
    certs.py      certs init | issue | list | trust | reject | revoke | export-server
    users.py      users add | passwd | remove | list
    call.py       call MODEL (--input | --prompt)
    models.py     models list | deploy | rollback | prepare | promote
    plc_types.py  plc-types MODEL --format scl|plcopenxml
    nodeset.py    nodeset [--out FILE]: the information model as NodeSet2 XML
    audit.py      audit verify [FILE]
    sources.py    sources list | test NAME | trust NAME [--yes THUMBPRINT] | passwd NAME
"""
from __future__ import annotations

import argparse
import logging
import sys

from core.config import ConfigError
from . import audit, call, certs, models, nodeset, plc_types, serve, sources, users

VERB_GROUPS = (serve, certs, users, call, models, sources, plc_types, nodeset, audit)  # the order `appliance --help` lists them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description="OPC UA edge inference appliance")
    sub = p.add_subparsers(dest="command", required=True)
    for group in VERB_GROUPS:
        group.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncua").setLevel(logging.ERROR)  # its client warns about every client certificate
    try:
        return args.func(args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
