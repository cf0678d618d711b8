"""The correlation id of the call being served: made when a call arrives, carried in its audit record, its log lines
(appliance/logs.py, in the serve process and in workers alike) and its exemplar. Plain Python: reading it imports
no OPC UA."""
from __future__ import annotations

import contextvars
import os

correlation_id: contextvars.ContextVar[str] = contextvars.ContextVar("correlation_id", default="")


def new_correlation_id() -> str:
    """128 random bits as 32 hex digits: made by the appliance, so a client cannot forge or predict one."""
    return os.urandom(16).hex()
