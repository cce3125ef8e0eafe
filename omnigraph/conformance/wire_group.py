"""The wire group: frames built from data (frames.py), sent to a codec or a live worker.

`inproc` checks the codec: the bytes go through a socket pair into
`omnigraph.workers.wire.recv_message`, which must refuse with the expected `WireError.code` or
return exactly the tensors that were sent. A `worker:` target gets the same bytes on its socket
after loading the case's graph (`send.graph`, a bundle generated from `setup.graphs`; `null`: a
worker with nothing loaded) and must answer `result` with `expect.outputs`, or an `error` frame
whose `body.code` is the expected code. Wire-level, epoch, generation and instance refusals must
leave the worker usable when its stream is still in sync; a frame that ends the stream (`truncate`)
may be answered by an error frame with `truncated_frame` or by closing the stream.

Session fields in `send`: `epoch` (relative to the case's start, default 0), `fence`: [epochs]
sent first, `stale`: "generation_newer" | "generation_older" | "instance" | "instance_empty"
(the frame names a generation or instance other than the worker's). Cases that only a live
worker can judge list `"targets": ["worker"]` and are skipped elsewhere with that reason.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omnigraph.conformance.bundle_cases import build_case_bundle
from omnigraph.conformance.expect import check_accepted, check_refused, expected_outcome
from omnigraph.conformance.frames import build_frame, send_frame_bytes
from omnigraph.conformance.report import CaseFailed, CaseRunner, CaseSkipped
from omnigraph.conformance.suite import Case, FixtureInvalid, Group
from omnigraph.conformance.targets import Target
from omnigraph.conformance.tensors import compare_tensors, tensor_from_spec
from omnigraph.workers import wire

DEFAULT_ATOL = 1e-6
# The session an in-process codec check uses (the codec itself does not judge freshness).
INPROC_SESSION = {"request_id": "conformance", "stage_id": 0, "epoch": 0, "generation": 7, "instance": "inproc"}
INPROC_TIMEOUT_S = 10.0
_TRUNCATED = "truncated_frame"


@contextlib.contextmanager
def open_runner(group: Group, target: Target) -> Iterator[CaseRunner]:
    setup = group.setup
    max_payload = setup.get("max_payload_bytes")
    if type(max_payload) is not int or max_payload <= 0:
        raise FixtureInvalid("wire setup needs max_payload_bytes (a positive integer)")
    if target.kind == "inproc":
        yield lambda case: _check_inproc(case, max_payload)
        return
    from omnigraph.conformance.worker_target import WorkerTargetSession

    with tempfile.TemporaryDirectory(prefix="omnigraph-conformance-wire-") as scratch, \
            WorkerTargetSession(target.command, setup=setup) as session:
        bundles = _GraphBundles(setup, Path(scratch))
        yield lambda case: _check_worker(case, session, bundles, setup)


def _targets_allow(case: Case, kind: str) -> None:
    targets = case.send.get("targets")
    if targets is not None and kind not in targets:
        raise CaseSkipped(f"only a {' or '.join(targets)} target can judge this (it depends on a live worker's state)")


# ----------------------------------------------------------------------------------------------
# In-process: the codec


def _check_inproc(case: Case, max_payload: int) -> None:
    _targets_allow(case, "inproc")
    built = build_frame(case.send, session=INPROC_SESSION, where=case.id)
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    writer = threading.Thread(target=send_frame_bytes, args=(sender, built), daemon=True)
    try:
        writer.start()
        receiver.settimeout(INPROC_TIMEOUT_S)
        try:
            frame, arrays = wire.recv_message(receiver, max_payload_bytes=max_payload)
        except wire.WireError as error:
            check_refused(case.expect, error.code, str(error), case_id=case.id)
            return
        except TimeoutError:
            raise CaseFailed(f"the codec waited {INPROC_TIMEOUT_S} s for bytes that were never sent") from None
    finally:
        receiver.close()
        sender.close()
        writer.join(INPROC_TIMEOUT_S)
    check_accepted(case.expect, case_id=case.id)
    if frame.type != case.send.get("message", "run") or frame.request_id != INPROC_SESSION["request_id"]:
        raise CaseFailed(f"decoded type {frame.type!r} / request {frame.request_id!r} differ from what was sent")
    problems = compare_tensors(built.tensors, arrays, atol=0.0)
    if problems:
        raise CaseFailed("the decoded tensors differ from those sent: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# A live worker


class _GraphBundles:
    """One generated bundle per graph of setup.graphs, built on first use."""

    def __init__(self, setup: Mapping[str, Any], scratch: Path) -> None:
        self._graphs = setup.get("graphs", {})
        self._examples = setup.get("example_inputs", {})
        self._scratch = scratch
        self._paths: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            if name not in self._graphs:
                raise FixtureInvalid(f"send.graph {name!r} is not one of setup.graphs {sorted(self._graphs)}")
            workdir = self._scratch / name
            workdir.mkdir()
            bundle: dict[str, Any] = {"graph": name, "component": f"conformance.{name}"}
            if name in self._examples:
                bundle["example_inputs"] = {"file": "inputs.npz", "tensors": self._examples[name]}
            self._paths[name] = build_case_bundle({"bundle": bundle}, self._graphs, workdir, where=f"graph {name}")
        return self._paths[name]


def _check_worker(case: Case, session: Any, bundles: _GraphBundles, setup: Mapping[str, Any]) -> None:
    _targets_allow(case, "worker")
    send = case.send
    if send.get("header_format") == "binary" and wire.FEATURE_BINARY_HEADER not in session.features:
        raise CaseSkipped(f"the worker's hello does not announce {wire.FEATURE_BINARY_HEADER!r}")
    graph = send.get("graph", setup.get("default_graph"))
    if graph is None:
        if session.loaded is not None:
            session.restart()
    elif session.loaded != graph:
        refusal = session.load_bundle(bundles.path(graph), key=graph)
        if refusal is not None:
            raise CaseFailed(f"the worker refused to load graph {graph!r}: {refusal[0]}: {refusal[1]}")
    base = session.epoch
    for epoch in send.get("fence", []):
        session.fence(base + epoch)
    fields = session.session_fields(request_id=case.id, epoch=base + send.get("epoch", 0))
    fields.update(_stale_fields(send.get("stale"), session, case_id=case.id))
    built = build_frame(send, session=fields, where=case.id)
    reply = session.exchange(built)
    session.epoch = base + max([send.get("epoch", 0), *send.get("fence", [])]) + 1
    if expected_outcome(case.expect, case_id=case.id) == "refused":
        try:
            _judge_refusal(case, reply)
        finally:
            if reply.closed or built.ends_stream or not session.healthy():
                session.restart()
        return
    if reply.closed:
        session.restart()
        raise CaseFailed("the worker closed the stream instead of answering")
    if reply.type == "error":
        raise CaseFailed(f"refused ({reply.body.get('code')}: {reply.body.get('message')}), expected accepted")
    check_accepted(case.expect, case_id=case.id)
    if reply.type != "result" or reply.request_id != case.id:
        raise CaseFailed(f"answered {reply.type!r} for request {reply.request_id!r}, expected a result for {case.id!r}")
    expected = {name: tensor_from_spec(spec, where=f"{case.id} output {name}")
                for name, spec in case.expect["outputs"].items()}
    problems = compare_tensors(expected, reply.tensors, atol=case.expect.get("atol", DEFAULT_ATOL))
    if problems:
        raise CaseFailed("wrong outputs: " + "; ".join(problems))


def _judge_refusal(case: Case, reply: Any) -> None:
    if reply.closed:
        if case.expect["code"] == _TRUNCATED and case.send.get("truncate"):
            return  # the peer ended the stream: closing it is an acceptable refusal
        raise CaseFailed(f"the worker closed the stream without an error frame, expected code {case.expect['code']!r}")
    if reply.type != "error":
        raise CaseFailed(f"answered {reply.type!r}, expected an error frame with code {case.expect['code']!r}")
    check_refused(case.expect, str(reply.body.get("code")), str(reply.body.get("message", "")), case_id=case.id)


def _stale_fields(stale: str | None, session: Any, *, case_id: str) -> dict[str, Any]:
    if stale is None:
        return {}
    if stale == "generation_newer":
        return {"generation": session.generation + 1}
    if stale == "generation_older":
        return {"generation": session.generation - 1}
    if stale == "instance":
        return {"instance": "f" * 32 if session.instance != "f" * 32 else "e" * 32}
    if stale == "instance_empty":
        return {"instance": ""}
    raise FixtureInvalid(f"{case_id}: send.stale must be generation_newer, generation_older, instance or "
                         "instance_empty")

