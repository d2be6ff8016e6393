"""Log lines as text or JSON; the request's ids ride along when there is one.

``request_id`` is the gateway's own (unique, the one its worker saw); ``client_request_id`` the
client's ``x-request-id`` when it sent one (echoed in the reply, never sent to a worker).
"""

from __future__ import annotations

import logging
import sys
import time

import orjson


class RequestIdFilter(logging.Filter):
    """Puts the id of the request being served (if any) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        from gpupool.gateway.api.middleware import client_request_id, current_request_id

        ours = current_request_id.get() or "-"
        theirs = client_request_id.get()
        record.request_id = ours
        record.client_request_id = theirs
        record.request_ids = f"{ours} client={theirs}" if theirs else ours
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            line["request_id"] = rid
        client = getattr(record, "client_request_id", None)
        if client:
            line["client_request_id"] = client
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_ids)s] %(message)s")
        )
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
