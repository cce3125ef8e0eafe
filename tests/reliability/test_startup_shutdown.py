"""Startup and shutdown (issue 18, findings 10 and 11): a signal while replicas are starting stops the
start, the server exits within seconds, and no worker folder is left in TMPDIR after any exit;
folders a killed server left behind are swept by the next start; a TMPDIR that cannot hold a
worker's folder is named with the cause."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omnigraph import Omni
from omnigraph.stages.errors import StageStartupError

from ..plugin.conftest import REFUND_REQUEST, ServerProcess
from .plans import demo_plan
from .test_fault_model import _wait_for, _worker_folders

REPLICAS = 20  # the finding's plan: a signal after 3 of 20 replicas started
EXIT_BOUND_S = 2.0  # the bound on exiting after a signal during startup


def test_sigint_while_replicas_start_stops_starting_and_exits_at_once(tmp_path, tmpdir_env):
    server = ServerProcess(["--deploy-config", str(demo_plan(tmp_path, replicas=REPLICAS))], {"TMPDIR": str(tmpdir_env)},
                           tmp_path / "server.log")
    try:
        _wait_for(lambda: len(server.worker_pids()) >= 3, "three replicas started", timeout=120)
        server.process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        started_by_then = len(_worker_folders(tmpdir_env))
        most_workers = 0
        while server.process.poll() is None and time.monotonic() - signalled < 30:
            most_workers = max(most_workers, len(server.worker_pids()))
            time.sleep(0.01)
        exited_after = time.monotonic() - signalled
    finally:
        server.stop()
    assert started_by_then < REPLICAS
    assert most_workers <= started_by_then + 1, "workers were started after the signal"
    assert exited_after <= EXIT_BOUND_S, f"exited {exited_after:.1f} s after SIGINT; log {server.log}"
    assert _worker_folders(tmpdir_env) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_a_serving_server_leaves_no_worker_or_folder(tmp_path, tmpdir_env, sig):
    server = ServerProcess([], {"TMPDIR": str(tmpdir_env)}, tmp_path / "server.log")
    try:
        server.wait_ready()
        assert httpx.post(f"{server.url}/v1/systemone", json=REFUND_REQUEST, timeout=30).status_code == 200
        workers = server.worker_pids()
        assert len(_worker_folders(tmpdir_env)) == len(workers) == 1
        server.process.send_signal(sig)
        # uvicorn shuts down gracefully, then re-raises the signal (the shell's 128 + n convention)
        assert server.process.wait(timeout=30) in (0, 128 + sig, -sig)
    finally:
        server.stop()
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    assert _worker_folders(tmpdir_env) == []


def test_the_folder_of_a_killed_server_is_swept_by_the_next_start(tmp_path, tmpdir_env):
    killed = ServerProcess([], {"TMPDIR": str(tmpdir_env)}, tmp_path / "killed.log")
    try:
        killed.wait_ready()
        workers = killed.worker_pids()
        os.kill(killed.process.pid, signal.SIGKILL)
        killed.process.wait(timeout=10)
        for pid in workers:  # a worker outlives a SIGKILLed controller only until it sees the hang-up
            _wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), f"worker {pid} exits")
    finally:
        killed.stop()
    (stale,) = _worker_folders(tmpdir_env)
    assert stale.startswith(f"omnigraph-worker-{killed.process.pid}-")
    server = ServerProcess([], {"TMPDIR": str(tmpdir_env)}, tmp_path / "server.log")
    try:
        server.wait_ready()
        (folder,) = _worker_folders(tmpdir_env)
        assert folder != stale and folder.startswith(f"omnigraph-worker-{server.process.pid}-")
    finally:
        server.stop()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def full_tmpfs(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs whose two inodes are taken (needs the right to mount: root, as on CI)."""
    mountpoint = tmp_path / "full"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=2", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (mountpoint / "taken").touch()
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_a_tmpdir_with_no_room_for_a_worker_folder_is_named_with_the_cause(full_tmpfs, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(full_tmpfs))  # what TMPDIR sets, without the fallback to /tmp
    with pytest.raises(StageStartupError, match=rf"cannot create the worker's folder in {full_tmpfs} \(TMPDIR\): "
                                                "No space left on device"):
        Omni()
