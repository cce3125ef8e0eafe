"""`omnigraph serve` for the HTTP reliability tests: a real server on 127.0.0.1, optionally under an
open-file limit (as `ulimit -n` would set it), and its Prometheus samples."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import httpx

from ..serving import ServerProcess, free_port

#: `python -c` program: set RLIMIT_NOFILE to argv[1] (0: leave it), then run the omnigraph CLI on
#: the rest, so the limit holds in the server process from its first descriptor.
_SERVE_UNDER_FD_LIMIT = (
    "import resource, sys\n"
    "limit = int(sys.argv[1])\n"
    "if limit:\n"
    "    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
    "from omnigraph.plugin.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def start_server(log: Path, *, fd_limit: int = 0, env: Mapping[str, str] | None = None) -> ServerProcess:
    """`omnigraph serve` (the embedded demo Laya) ready to answer; the caller stops it."""
    port = free_port()
    server = ServerProcess(["-c", _SERVE_UNDER_FD_LIMIT, str(fd_limit), "serve", "--port", str(port)],
                           port=port, log=log, env=env)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def metric_samples(url: str) -> dict[str, float]:
    """Every Prometheus sample of the server at `url`, by its full name with labels."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
