"""One log format for `omnigraph serve`: omnigraph's own lines and uvicorn's, access lines included,
with the probes' access lines (health, readiness, metrics) left out unless asked for, and a routed
request's access line ending with its request id (`request_id=...`, the `X-Request-Id` it answered).

Load balancers and Prometheus poll the probes every few seconds; their access lines would bury the
requests an operator looks for. `OMNIGRAPH_LOG_PROBES=1` keeps them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omnigraph.plugin.api.request_ids import current_request_id

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_PROBES_ENV = "OMNIGRAPH_LOG_PROBES"
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/systemone/ready"})


class AccessLineFilter(logging.Filter):
    """Drops uvicorn's access line of a probe request (its record's third argument is the path)
    unless `log_probes`, and appends the request id of the request whose task logs the line."""

    def __init__(self, log_probes: bool = False) -> None:
        super().__init__()
        self.log_probes = log_probes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not self.log_probes and isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) \
                and args[2].partition("?")[0] in PROBE_PATHS:
            return False
        shared = current_request_id.get()
        if shared is not None and isinstance(args, tuple):
            record.msg = f"{record.msg} request_id=%s"
            record.args = (*args, shared)
        return True


def log_probes_from_env() -> bool:
    value = os.environ.get(LOG_PROBES_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{LOG_PROBES_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def logging_config(*, log_probes: bool = False, level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` (also uvicorn's `log_config`): every logger through one handler
    in LOG_FORMAT; uvicorn's access lines without the probes' unless `log_probes`."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"format": LOG_FORMAT}},
        "filters": {"access": {"()": AccessLineFilter, "log_probes": log_probes}},
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr",
                       "filters": ["access"]},
        },
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            "uvicorn": {"level": level},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["access"], "level": level, "propagate": False},
        },
    }
