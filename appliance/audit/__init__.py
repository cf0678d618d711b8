"""The audit log: its writer (writer.py), its verifier (verify.py), the payload digest its records carry
(digest.py) and the record format they share (records.py)."""
from .digest import DigestOf, digest
from .records import EVENTS, GENESIS
from .verify import count_records, verify, verify_report
from .writer import AuditLog, AuditLogClosed

__all__ = ["AuditLog", "AuditLogClosed", "DigestOf", "EVENTS", "GENESIS", "count_records", "digest", "verify",
           "verify_report"]
