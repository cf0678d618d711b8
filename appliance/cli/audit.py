"""`appliance audit verify [FILE]`: check the audit trail's hash chain (appliance.audit.verify walks it); without FILE, the
configuration's audit.jsonl and the CLI's admin.jsonl beside it."""
from __future__ import annotations

from pathlib import Path

from .common import fail, load_config_arg


def register(sub) -> None:
    a = sub.add_parser("audit", help="the audit trail")
    asub = a.add_subparsers(dest="audit_action", required=True)
    x = asub.add_parser("verify", help="check the hash chain; names the first broken line")
    x.add_argument("file", nargs="?")
    x.add_argument("--config")
    a.set_defaults(func=run_audit)


def run_audit(args) -> int:
    if args.file:
        return cmd_audit_verify(Path(args.file))
    config = load_config_arg(args.config)
    main_log = Path(config.audit.path)
    codes = [cmd_audit_verify(p) for p in (main_log, main_log.with_name("admin.jsonl")) if p.exists()]
    if not codes:
        return fail(f"no audit log at {main_log}")
    return max(codes)


def cmd_audit_verify(path: Path) -> int:
    """"OK: N records in K files" (after each acknowledged tear and each gap a failed write left, which are no
    tampering), or every problem; exit 0 or 2."""
    from ..audit import count_records, verify_report
    path = Path(path)
    try:
        records, files = count_records(path)
        if not files:
            print(f"error: no audit log at {path}")
            return 2
        problems, tears, gaps = verify_report(path)
    except OSError as e:  # a file of the chain that cannot be read (a folder, no permission)
        print(f"error: {e.filename or path}: {e.strerror or e}")
        return 2
    for tear in tears:
        print(f"TORN: {tear}")
    for gap in gaps:
        print(f"GAP: {gap}")
    if not problems:
        notes = ([f"{len(tears)} torn line(s) acknowledged"] if tears else []) + \
            ([f"{len(gaps)} gap(s) marked"] if gaps else [])
        print(f"OK: {records} records in {files} files" + "".join(f", {n}" for n in notes))
        return 0
    for problem in problems:
        print(problem)
    print(f"FAILED: {len(problems)} problem(s) in {records} records in {files} files")
    return 2
