"""The services' log lines: readable text by default, one JSON object per line for log
collectors (``--log-format json``: Loki, Elasticsearch, Cloud Logging read it as is).

A lifecycle line (run started, round closed, agent joined, ...) passes its fields as
``extra={"event": {...}}``; the JSON format puts them beside the message."""

from __future__ import annotations

import json
import logging
import time

FORMATS = ("text", "json")


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            out.update({k: v for k, v in event.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_log_args(p) -> None:
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text lines, or one JSON object per line for log collectors (default %(default)s)")


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
