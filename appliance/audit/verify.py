"""Checking the audit log's hash chain across its rotated files (`appliance audit verify`)."""
from __future__ import annotations

import json
from pathlib import Path

from .records import canonical, chain_files, sha256_hex


def verify(path: Path) -> tuple[bool, list[str]]:
    """Check the chain across the rotated files, oldest to newest. Returns (ok, problems), each problem naming its
    file and 1-based line. The first record of the oldest file anchors the chain (older files may be rotated away).
    A torn last line (power cut) acknowledged by the audit_resume record that follows it is not a problem: see
    `verify_report` for the tears and the gaps."""
    problems, _, _ = verify_report(path)
    return not problems, problems


def verify_report(path: Path) -> tuple[list[str], list[str], list[str]]:
    """(problems, tears, gaps): tears are torn last lines of a file that the appliance found at start and
    acknowledged with an audit_resume record chained to the last complete record before them; gaps are the
    audit_lost records the writer put where records it could not write would have stood (a full disk outlasting
    what it could hold), each "FILE:LINE: N records lost between seq A and B at TIME: CAUSE"."""
    path = Path(path)
    problems: list[str] = []
    tears: list[str] = []
    gaps: list[str] = []
    prev_line_hash: str | None = None
    prev_seq: int | None = None
    last_edited = ""  # the previous line, when its own hash failed: explains the next line's broken link
    pending_tear = ""  # a torn last line of the previous file, waiting for its audit_resume
    for p in chain_files(path):
        try:
            data = p.read_bytes()
        except OSError as exc:
            problems.append(f"{p.name}: cannot be read ({exc.strerror})")
            continue
        lines = data.split(b"\n")
        ends_with_newline = bool(lines) and lines[-1] == b""
        if ends_with_newline:
            lines.pop()
        for number, line in enumerate(lines, start=1):
            where = f"{p.name}:{number}"
            after_edit, last_edited = last_edited, ""
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError
            except ValueError:
                if number == len(lines) and not ends_with_newline:
                    pending_tear = where  # judged by the record that follows (in the next file)
                else:
                    problems.append(f"{where}: not a complete JSON record (edited?)")
                continue
            if pending_tear:
                if rec.get("action") == "audit_resume" and rec.get("prev") == prev_line_hash:
                    tears.append(f"{pending_tear}: torn last line (the power or the process stopped mid-write); "
                                 f"acknowledged at {where}, the chain continues from the line before it")
                else:
                    problems.append(f"{pending_tear}: not a complete JSON record and no audit_resume follows it")
                pending_tear = ""
            claimed = rec.pop("hash", None)
            if claimed != sha256_hex(canonical(rec)):
                problems.append(f"{where}: record hash does not match its content (edited?)")
                last_edited = where
            elif prev_line_hash is not None and rec.get("prev") != prev_line_hash:
                cause = (f"the line before it, {after_edit}, was altered" if after_edit
                         else "a record before it was deleted or reordered")
                problems.append(f"{where}: previous-hash link broken ({cause})")
            elif prev_seq is not None and rec.get("seq") != prev_seq + 1:
                problems.append(f"{where}: sequence number {rec.get('seq')} does not follow {prev_seq}")
            elif rec.get("event") == "audit_lost":
                gaps.append(f"{where}: {rec.get('detail', '')}")
            prev_line_hash = sha256_hex(line)
            prev_seq = rec.get("seq") if isinstance(rec.get("seq"), int) else None
    if pending_tear:
        problems.append(f"{pending_tear}: torn last line, not yet acknowledged (the appliance has not started since "
                        "the power or the process stopped mid-write)")
    return problems, tears, gaps


def count_records(path: Path) -> tuple[int, int]:
    """(records, files) of the log, counting non-empty lines."""
    files = chain_files(Path(path))
    records = 0
    for p in files:
        with open(p, "rb") as fh:
            records += sum(1 for line in fh if line.strip())
    return records, len(files)
