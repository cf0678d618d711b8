"""What every verb shares: the configuration it reads (--config), the error exit, the administrative audit trail."""
from __future__ import annotations

import getpass
import sys
from pathlib import Path

from core.config import DEFAULT_CONFIG_PATH


def load_config_arg(path: str | None):
    """--config FILE; without it the installed file if there is one, else the built-in demo."""
    from core.config import demo_config, load_config
    if path:
        return load_config(path)
    if DEFAULT_CONFIG_PATH.exists():
        return load_config(DEFAULT_CONFIG_PATH)
    return demo_config()


def fail(message: str) -> int:
    """A refused command: one line on stderr, exit status 2 (never a stack trace)."""
    print(f"appliance: {message}", file=sys.stderr)
    return 2


def audit_admin(config, action: str, detail: str, code: int, event: str = "admin") -> None:
    """Administrative CLI actions go to their own hash chain (admin.jsonl): the running daemon owns audit.jsonl,
    and two writers on one chain would break it."""
    if not config.audit.enabled:
        return
    from core.correlation import new_correlation_id

    from ..audit import AuditLog
    log = AuditLog(Path(config.audit.path).with_name("admin.jsonl"), max_bytes=config.audit.max_bytes,
                   keep_files=config.audit.keep_files)
    try:
        log.record(event=event, action=action, correlation_id=new_correlation_id(), session="", client="",
                   user=f"cli:{getpass.getuser()}", role="engineer", status="Good" if code == 0 else "Bad",
                   detail=detail)
    finally:
        log.close()


def audit_implicit_certificate(config, verb: str, name: str, role: str, cert: Path) -> None:
    """A verb issued itself a certificate from the local CA (`call`: an operator, `models`: an engineer): the audit
    trail says so, with the new certificate's thumbprint."""
    from certs.x509io import thumbprint
    thumb = thumbprint(cert.read_bytes())
    audit_admin(config, f"certs issue {name}", f"implicit commissioning certificate for `appliance {verb}`: "
                f"{name} ({role}) x509:{thumb}", 0, event="commissioning_certificate")
