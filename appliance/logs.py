"""Log lines, as the YAML's `logging` section asks, for the serve process and its workers alike: text or one JSON
object per line (what the journal keeps and a log shipper parses), with the correlation id of the call a line is
about. A worker's lines name its worker group."""
from __future__ import annotations

import json
import logging


class CorrelationFilter(logging.Filter):
    """Puts the correlation id of the call being served (if any) on every log record: `correlation_id`, and
    `correlation` (" [cid=...]" or "") for the text format."""

    def filter(self, record: logging.LogRecord) -> bool:
        from core.correlation import correlation_id
        cid = correlation_id.get()
        record.correlation_id = cid
        record.correlation = f" [cid={cid}]" if cid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line (logging.format: json): time, level, logger, message, worker (in a worker process),
    correlation_id when the line is about a call, exception when there is one."""

    def __init__(self, worker: str | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if self.worker:
            doc["worker"] = self.worker
        if getattr(record, "correlation_id", ""):
            doc["correlation_id"] = record.correlation_id
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure_logging(level: str, fmt: str, worker: str | None = None) -> None:
    """level: DEBUG | INFO | WARNING | ERROR; fmt: text | json; worker: the worker group of a worker process."""
    numeric = getattr(logging, level, logging.INFO)
    handler = logging.StreamHandler()
    handler.addFilter(CorrelationFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        where = f"worker[{worker}] " if worker else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s"
                                               "%(correlation)s"))
    logging.basicConfig(level=numeric, handlers=[handler], force=True)
    logging.getLogger("asyncua").setLevel(max(numeric, logging.WARNING))  # asyncua logs every request at INFO
