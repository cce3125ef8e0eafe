"""What Linux's /proc says about a process: its identity (pid + start time) and its memory."""

from __future__ import annotations

import os


def process_start_ticks(pid: int | str = "self") -> int:
    """Field 22 of /proc/<pid>/stat: the start time in clock ticks since boot. With the pid it is
    the process's identity (a reused pid has another start time). FileNotFoundError: no such pid."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return int(fields[19])  # the fields after "(comm)" start at field 3


def process_start_unix(ticks: int) -> float:
    """A start time in ticks since boot as seconds since the epoch."""
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"btime "):
                return float(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    raise OSError("/proc/stat has no btime line")


def memory_status() -> dict[str, int]:
    """This process's resident set (VmRSS) and its peak (VmHWM), in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return {"rss_bytes": values.get("VmRSS", 0), "peak_rss_bytes": values.get("VmHWM", 0)}


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
