"""What the runner checks: this process (`inproc`), a worker command (`worker:CMD`) or a server (`http://`).

Each kind of target exposes some of the surfaces the fixtures describe; a group that a target does
not expose is skipped with that reason rather than silently dropped.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from urllib.parse import urlsplit

# Which groups each kind of target runs.
GROUPS_BY_KIND: dict[str, tuple[str, ...]] = {
    "inproc": ("wire", "manifest", "ledger", "placement"),
    "worker": ("wire", "manifest"),
    "http": ("decision",),
}


class TargetInvalid(ValueError):
    """The --target text is not `inproc`, `worker:'<command>'` or `http://HOST:PORT`."""


@dataclass(frozen=True)
class Target:
    kind: str  # "inproc" | "worker" | "http"
    command: tuple[str, ...] = ()  # worker: the argv that starts a worker (a socket path is appended)
    base_url: str = ""  # http: scheme://host:port, no trailing slash
    # http: how long connections refused are retried before the target counts as dead (a server
    # still binding its port); 0 fails at the first refusal.
    listen_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.listen_wait_s >= 0 and self.listen_wait_s != float("inf")):
            raise TargetInvalid(f"listen_wait_s must be a finite number of seconds >= 0, got {self.listen_wait_s!r}")

    def __str__(self) -> str:
        if self.kind == "worker":
            return f"worker:{shlex.join(self.command)}"
        if self.kind == "http":
            return self.base_url
        return self.kind

    def runs(self, group: str) -> bool:
        return group in GROUPS_BY_KIND[self.kind]


def parse_target(text: str, *, listen_wait_s: float = 0.0) -> Target:
    """`inproc`, `worker:<shell-quoted command>`, or `http://HOST:PORT` (https too; `listen_wait_s`
    is its Target's)."""
    if text == "inproc":
        return Target(kind="inproc")
    if text.startswith("worker:"):
        try:
            command = tuple(shlex.split(text[len("worker:") :]))
        except ValueError as exc:
            raise TargetInvalid(f"worker target {text!r}: {exc}") from None
        if not command:
            raise TargetInvalid("worker target needs a command, e.g. worker:'python -m omnigraph.workers.worker'")
        return Target(kind="worker", command=command)
    if text.startswith(("http://", "https://")):
        parts = urlsplit(text)
        if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise TargetInvalid(f"http target must be scheme://HOST:PORT with no path, got {text!r}")
        return Target(kind="http", base_url=f"{parts.scheme}://{parts.netloc}", listen_wait_s=listen_wait_s)
    raise TargetInvalid(f"target must be inproc, worker:'<command>' or http://HOST:PORT, got {text!r}")
