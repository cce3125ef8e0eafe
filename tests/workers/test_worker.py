"""A real worker process behind WorkerClient: load, warmup, placement, calls, refusals, death."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from omnigraph.workers import wire
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.errors import (
    CallRefused, LoadRefused, PlacementRefused, RemoteError, WorkerBusy, WorkerDied, WorkerTimeout,
)
from omnigraph.workers.route import WorkerRoute

from omnigraph.bundles import pack_bundle

from .conftest import affine_graph, affine_inputs, pack_graph


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_until_computing(pid: int, baseline: int, ticks: int = 10, timeout: float = 30.0) -> None:
    """Block until the worker has burnt ``ticks`` CPU ticks since ``baseline``: a call is in flight."""
    deadline = time.monotonic() + timeout
    while cpu_ticks(pid) - baseline < ticks:
        assert time.monotonic() < deadline, "the worker never started computing"
        time.sleep(0.01)


def test_hello_names_the_process_and_its_software(start_worker, cpu_route):
    client = start_worker()
    hello = client.hello
    assert hello.pid == client.pid and hello.interpreter == sys.executable
    assert hello.onnxruntime_version == ort.__version__ and hello.numpy_version == np.__version__
    assert "CPUExecutionProvider" in hello.available_providers
    assert hello.wire_version == wire.WIRE_VERSION and "shm_fd" in hello.features
    assert len(hello.instance) == 32 and hello.start_time_ticks > 0
    assert abs(hello.start_time_unix - time.time()) < 120
    assert client.generation == 1


def test_thousand_calls_match_an_in_process_session(start_worker, affine_bundle, cpu_route):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=256 * 1024))
    report = client.load(affine_bundle.manifest_path)
    assert report.manifest_sha256 == affine_bundle.manifest_sha256 and report.component == "test.graph"
    assert report.session_providers == ("CPUExecutionProvider",)
    assert report.placement.source == "ort_profile" and report.placement.fraction_on_target == 1.0
    assert set(report.placement.node_providers) >= {"relu", "double", "shift", "sum_ids"}
    assert [s.name for s in report.inputs] == ["x", "ids"] and [s.name for s in report.outputs] == ["y", "z"]

    reference = ort.InferenceSession(str(affine_bundle.graph_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    descriptors_before = len(os.listdir("/proc/self/fd"))
    for call in range(1000):
        n = int(rng.integers(1, 9))
        inputs = affine_inputs(n, 16, seed=call)
        if call % 100 == 0:  # 512 x 256 float32 = 512 KiB: more than the mailbox holds, through the socket
            inputs = affine_inputs(512, 256, seed=call)
        got = client.run(inputs, request_id=f"r{call}", stage_id=0, epoch=0)
        expected = dict(zip(["y", "z"], reference.run(None, inputs)))
        assert got.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
    del got
    assert len(os.listdir("/proc/self/fd")) == descriptors_before  # no descriptor leaked
    stats = client.stats()
    assert stats["runs"] == 1000 and stats["failed_runs"] == 0 and stats["rss_bytes"] > 0
    assert stats["manifest_sha256"] == affine_bundle.manifest_sha256


def test_polling_and_sleeping_workers_answer_alike_through_the_socket_or_the_mailbox(start_worker, affine_bundle, cpu_route):
    """spin_wait_us and mailbox_bytes only change how each end waits for the next message and
    which way a frame travels, never what it reads."""
    answers = []
    for spin_wait_us, mailbox_bytes in ((0, 0), (2000, 0), (0, 1 << 20), (2000, 1 << 20)):
        client = start_worker(dataclasses.replace(cpu_route, spin_wait_us=spin_wait_us, mailbox_bytes=mailbox_bytes))
        assert (client._mailbox is not None) == bool(mailbox_bytes)
        client.load(affine_bundle.manifest_path)
        answers.append([client.run(affine_inputs(3, 16, seed=call), request_id=f"r{call}", stage_id=0, epoch=0)
                        for call in range(50)])
        assert client.stats()["runs"] == 50
        client.close()
    for first, *others in zip(*answers):
        for other in others:
            for name in first:
                np.testing.assert_array_equal(first[name], other[name])


def test_input_mismatches_are_refused_and_the_worker_survives(start_worker, affine_bundle):
    client = start_worker()
    client.load(affine_bundle.manifest_path)
    good = affine_inputs(2, 4)
    cases = [
        ({"x": good["x"]}, "input_name_mismatch", "missing inputs ['ids']"),
        ({**good, "extra": good["x"]}, "input_name_mismatch", "unexpected inputs ['extra']"),
        ({**good, "x": good["x"].astype(np.float64)}, "input_dtype_mismatch", "'x' is float64"),
        ({**good, "x": good["x"][0]}, "input_rank_mismatch", "'x' has rank 1"),
        ({**good, "ids": np.zeros((2, 4), np.int64)}, "input_shape_mismatch", "'ids' dim 1 is 4, the graph declares 3"),
    ]
    for _ in range(2):  # and again after a good call: an accepted layout vouches for no other
        for inputs, code, message in cases:
            with pytest.raises(RemoteError) as info:
                client.run(inputs, request_id="bad", stage_id=0, epoch=0)
            assert info.value.code == code and message in info.value.message
        assert client.run(good, request_id="ok", stage_id=0, epoch=0)["y"].shape == (2, 4)
    stats = client.stats()
    assert (stats["runs"], stats["refused_runs"], stats["failed_runs"]) == (12, 10, 0)  # refused before ORT


def test_run_before_load_and_a_tampered_bundle(start_worker, affine_bundle):
    client = start_worker()
    with pytest.raises(RemoteError) as info:
        client.run(affine_inputs(1, 1), request_id="r", stage_id=0, epoch=0)
    assert info.value.code == "not_loaded"
    graph = Path(affine_bundle.graph_path)
    graph.write_bytes(graph.read_bytes() + b"\0")
    with pytest.raises(LoadRefused) as refused:
        client.load(affine_bundle.manifest_path)
    assert refused.value.code == "bundle_invalid" and "sha256" in refused.value.message


def test_a_custom_op_library_of_another_abi_is_refused_before_ort_sees_it(start_worker, tmp_path):
    folder = tmp_path / "bundle"
    pack_graph(folder, affine_graph(), affine_inputs(1, 4))
    (folder / "libomnigraph_ops.so").write_bytes(b"not a shared library")
    bundle = pack_bundle(folder, component="test.graph", example_inputs_file="inputs.npz",
                         custom_ops={"library_file": "libomnigraph_ops.so", "abi_version": 99, "domain": "omnigraph"})
    client = start_worker()
    with pytest.raises(LoadRefused) as refused:
        client.load(bundle.manifest_path)
    assert refused.value.code == "bundle_invalid"
    assert "custom-op library" in refused.value.message and "ABI version 99" in refused.value.message


def test_stale_epoch_is_refused_by_client_and_worker(start_worker, affine_bundle):
    client = start_worker()
    client.load(affine_bundle.manifest_path)
    inputs = affine_inputs(1, 4)
    client.run(inputs, request_id="a", stage_id=0, epoch=5)
    with pytest.raises(wire.StaleEpoch):  # the worker has seen epoch 5
        client.run(inputs, request_id="b", stage_id=0, epoch=4)
    client.fence(9)
    with pytest.raises(wire.StaleEpoch, match="below the fenced epoch 9"):  # refused before sending
        client.run(inputs, request_id="c", stage_id=0, epoch=8)
    assert client.run(inputs, request_id="d", stage_id=0, epoch=9)["y"].shape == (1, 4)
    assert client.stats()["max_epoch"] == 9


def test_load_stats_and_close_follow_the_epochs_the_calls_used(cpu_route, affine_bundle):
    """Calls carry their requests' epochs (the pipeline's, raised by each cancellation); the
    messages of no request (stats, load, close) carry the highest one sent, which the worker takes."""
    client = WorkerClient.start(cpu_route, generation=1)
    client.load(affine_bundle.manifest_path)
    client.run(affine_inputs(1, 4), request_id="a", stage_id=0, epoch=3)
    assert client.stats()["max_epoch"] == 3
    client.load(affine_bundle.manifest_path)
    assert client.close() == 0  # answered and exited, not killed


@pytest.mark.parametrize("mailbox_bytes", [0, 8 << 20])  # the 4 MiB call through the socket, or the mailbox
def test_fence_discards_the_reply_of_an_older_call(start_worker, slow_bundle, cpu_route, mailbox_bytes):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=mailbox_bytes))
    client.load(slow_bundle.manifest_path)
    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            client.run({"x": np.ones((1024, 1024), np.float32)}, request_id="old", stage_id=0, epoch=1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=call)
    baseline = cpu_ticks(client.pid)
    thread.start()
    wait_until_computing(client.pid, baseline)
    client.fence(2)
    thread.join(60)
    assert isinstance(outcome.get("error"), wire.StaleEpoch)
    assert "discarded" in str(outcome["error"])
    assert client.run({"x": np.ones((1, 1024), np.float32)}, request_id="new", stage_id=0, epoch=2)["y"].shape == (1, 1024)


def test_stale_generation_and_instance_are_refused(start_worker, affine_bundle, cpu_route):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=0), generation=3)
    client.load(affine_bundle.manifest_path)
    inputs = affine_inputs(1, 4)
    for field, value, error in [("generation", 2, wire.StaleGeneration), ("instance", "0" * 32, wire.StaleInstance)]:
        with client._send_lock:  # a message as a previous backend would send it
            wire.send_frame(client._sock, "run", request_id="stale", epoch=0, tensors=inputs,
                            max_payload_bytes=client.route.max_io_bytes,
                            **{"generation": client.generation, "instance": client.instance, field: value})
        frame, _ = wire.recv_message(client._sock, max_payload_bytes=client.route.max_io_bytes)
        assert frame.type == "error" and frame.body["code"] == error.code
        assert frame.request_id == "stale"
    assert client.run(inputs, request_id="fresh", stage_id=0, epoch=0)["y"].shape == (1, 4)
    assert client.stats()["refused_frames"] == 2


def test_a_worker_killed_mid_call_raises_worker_died(start_worker, slow_bundle):
    client = start_worker()
    client.load(slow_bundle.manifest_path)
    baseline = cpu_ticks(client.pid)

    def kill_once_computing() -> None:
        wait_until_computing(client.pid, baseline)
        os.kill(client.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_computing)
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        client.run({"x": np.ones((4096, 1024), np.float32)}, request_id="slow", stage_id=0, epoch=0)
    killer.join()
    assert info.value.exit_status == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert client.wait_exit(1.0)
    with pytest.raises(WorkerDied):
        client.run({"x": np.ones((1, 1024), np.float32)}, request_id="after", stage_id=0, epoch=0)
    private_dir = client._process.private_dir
    assert client.close() == -signal.SIGKILL and not private_dir.exists()


def test_a_timed_out_call_retires_the_worker(start_worker, slow_bundle):
    client = start_worker()
    client.load(slow_bundle.manifest_path)
    with pytest.raises(WorkerTimeout, match="retired"):
        client.run({"x": np.ones((4096, 1024), np.float32)}, request_id="slow", stage_id=0, epoch=0, timeout=0.3)
    assert client.wait_exit(1.0) and client.returncode == -signal.SIGKILL


def test_a_call_s_send_is_bounded_by_its_own_deadline_only(start_worker, affine_bundle, cpu_route, monkeypatch):
    """The frame goes out under the call's own deadline: a call without one is never cut short by
    the socket timeout that an earlier call with a deadline left behind."""
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=0))  # every frame on the socket
    client.load(affine_bundle.manifest_path)
    timeouts_at_send = []
    send = wire.EncodedFrame.send

    def recording(frame, sock):
        timeouts_at_send.append(sock.gettimeout())
        return send(frame, sock)

    monkeypatch.setattr(wire.EncodedFrame, "send", recording)
    client.run(affine_inputs(1, 4), request_id="with", stage_id=0, epoch=0, timeout=0.5)
    client.run(affine_inputs(1, 4), request_id="without", stage_id=0, epoch=0)
    assert 0 < timeouts_at_send[0] <= 0.5 and timeouts_at_send[1] is None


def test_a_send_that_cannot_finish_in_time_retires_the_worker(start_worker, slow_bundle):
    """A worker busy elsewhere does not read: a large frame cannot go out before the deadline, the
    half-sent stream is lost, so the worker is retired (WorkerTimeout), as for a late reply."""
    client = start_worker()
    client.load(slow_bundle.manifest_path)
    with client._send_lock:  # keep the worker computing, reading nothing, for a second or more
        client._mailbox.announce(0)  # the frame is on the socket (16 MB: more than the mailbox holds)
        wire.send_frame(client._sock, "run", request_id="busy", epoch=0, generation=client.generation,
                        instance=client.instance, tensors={"x": np.ones((4096, 1024), np.float32)},
                        max_payload_bytes=client.route.max_io_bytes)
    started = time.monotonic()
    with pytest.raises(WorkerTimeout, match="retired"):
        client.run({"x": np.ones((4096, 1024), np.float32)}, request_id="late", stage_id=0, epoch=0, timeout=0.3)
    assert time.monotonic() - started < 5
    assert client.wait_exit(1.0) and client.returncode == -signal.SIGKILL


def test_a_call_the_wire_cannot_carry_is_refused_before_sending_and_the_worker_serves_on(start_worker, affine_bundle):
    client = start_worker(WorkerRoute(name="small", interpreter=sys.executable, max_io_bytes=1024, intra_op_num_threads=1))
    client.load(affine_bundle.manifest_path)
    with pytest.raises(CallRefused) as refused:  # 64 rows: 1 KiB of x and 1.5 KiB of ids
        client.run(affine_inputs(64, 4), request_id="big", stage_id=0, epoch=0)
    assert refused.value.code == "payload_too_large"
    assert client.run(affine_inputs(1, 4), request_id="small", stage_id=0, epoch=0)["y"].shape == (1, 4)
    assert client.stats()["runs"] == 1  # the refused call never reached the worker


def test_one_call_in_flight(start_worker, slow_bundle):
    client = start_worker()
    client.load(slow_bundle.manifest_path)
    thread = threading.Thread(target=lambda: client.run({"x": np.ones((1024, 1024), np.float32)}, request_id="a", stage_id=0, epoch=0))
    baseline = cpu_ticks(client.pid)
    thread.start()
    wait_until_computing(client.pid, baseline)
    with pytest.raises(WorkerBusy):
        client.run({"x": np.ones((1, 1024), np.float32)}, request_id="b", stage_id=0, epoch=0)
    thread.join(60)
    assert client.run({"x": np.ones((1, 1024), np.float32)}, request_id="c", stage_id=0, epoch=0)["y"].shape == (1, 1024)


def test_cuda_requested_on_a_cpu_machine_is_refused_with_the_nodes_named(start_worker, affine_bundle, cpu_route):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: every node would land on it")
    strict = WorkerRoute(name="cuda-only", interpreter=sys.executable, ep="cuda", allowed_providers=("CUDAExecutionProvider",))
    client = start_worker(strict)
    with pytest.raises(PlacementRefused) as info:
        client.load(affine_bundle.manifest_path)
    report = info.value.report
    assert report.fraction_on_target == 0.0
    assert set(report.off_target_nodes()) >= {"relu", "double", "shift", "sum_ids"}
    assert "relu (Relu on CPUExecutionProvider)" in info.value.message
    # the worker stays usable after a refused load
    assert client.stats()["manifest_sha256"] is None

    lenient = WorkerRoute(name="cuda-or-cpu", interpreter=sys.executable, ep="cuda",
                          allowed_providers=("CUDAExecutionProvider", "CPUExecutionProvider"), min_fraction_on_target=0.0)
    client = start_worker(lenient)
    loaded = client.load(affine_bundle.manifest_path)
    assert loaded.placement.nodes_by_provider == {"CPUExecutionProvider": len(loaded.placement.node_providers)}
    assert loaded.placement.fraction_on_target == 0.0
    assert any("CUDAExecutionProvider" in note for note in loaded.notes)


def test_close_leaves_nothing_behind(cpu_route, affine_bundle):
    client = WorkerClient.start(cpu_route, generation=1)
    private_dir = client._process.private_dir
    assert not (private_dir / "worker.sock").exists()  # removed once the worker connected
    client.load(affine_bundle.manifest_path)
    assert client.close() == 0
    assert client.close() == 0  # idempotent
    assert client.wait_exit(0.1)
    assert not private_dir.exists()
    assert not Path(f"/proc/{client.pid}").exists() or _is_other_process(client)


def _is_other_process(client: WorkerClient) -> bool:
    from omnigraph.workers.procfs import process_start_ticks

    return process_start_ticks(client.pid) != client.hello.start_time_ticks


def test_a_bad_interpreter_fails_to_start(tmp_path):
    route = WorkerRoute(name="missing", interpreter=str(tmp_path / "no-python"))
    from omnigraph.workers.errors import WorkerStartFailed

    with pytest.raises(WorkerStartFailed, match="not an executable"):
        WorkerClient.start(route, generation=0)
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho no onnxruntime here >&2\nexit 7\n")
    broken.chmod(0o755)
    with pytest.raises(WorkerStartFailed, match="(?s)status 7.*no onnxruntime here"):
        WorkerClient.start(WorkerRoute(name="broken", interpreter=str(broken)), generation=0, startup_timeout=10)
