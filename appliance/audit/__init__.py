"""The audit log: its writer (writer.py), its verifier (verify.py) and the record format they share (records.py).
The payload digest its records carry is core's (core/audit_digest.py): the server makes it, the log writes it."""
from .records import EVENTS, GENESIS
from .verify import count_records, verify, verify_report
from .writer import AuditLog, AuditLogClosed

__all__ = ["AuditLog", "AuditLogClosed", "EVENTS", "GENESIS", "count_records", "verify", "verify_report"]
