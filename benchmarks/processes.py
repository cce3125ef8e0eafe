"""Stopping the servers a benchmark starts (stdlib only)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the group of a process started with `start_new_session=True`, SIGKILL it if it
    outlives `timeout`; nothing for a process that already exited (it has said why elsewhere)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
