"""One log format for `omnigraph serve`: omnigraph's own lines and uvicorn's, access lines included,
with the probes' access lines (health, readiness, metrics) left out unless asked for.

Load balancers and Prometheus poll the probes every few seconds; their access lines would bury the
requests an operator looks for. `OMNIGRAPH_LOG_PROBES=1` keeps them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_PROBES_ENV = "OMNIGRAPH_LOG_PROBES"
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/systemone/ready"})


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn's access line of a probe request (its record's third argument is the path)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in PROBE_PATHS
        return True


def log_probes_from_env() -> bool:
    value = os.environ.get(LOG_PROBES_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{LOG_PROBES_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def logging_config(*, log_probes: bool = False, level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` (also uvicorn's `log_config`): every logger through one handler
    in LOG_FORMAT; uvicorn's access lines without the probes' unless `log_probes`."""
    access_filters = [] if log_probes else ["no_probes"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"format": LOG_FORMAT}},
        "filters": {"no_probes": {"()": ProbeAccessFilter}},
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr",
                       "filters": access_filters},
        },
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            "uvicorn": {"level": level},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": ["access"], "level": level, "propagate": False},
        },
    }
