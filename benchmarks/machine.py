"""What every benchmark row says about the machine it ran on (stdlib only)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo; elsewhere what `platform` knows, or "unknown"."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
