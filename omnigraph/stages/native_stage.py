"""NativeStage: an `llm_pooling` stage served by a vLLM pooling engine (a Qwen backbone's prefill).

The stage sits in the orchestrator's chain like a GraphStage (submit, check_available, handoff,
input_specs, replicas' interrupt, describe, stop) but its calls go to vLLM instead of a graph
worker. A work item carries `prompt_token_ids` int64 [T] (its P prompts concatenated) and
`prompt_lengths` int64 [P]; the stage submits the P prompts to vLLM's `encode` with LAST-token
pooling and no activation, and completes the item with `hidden_states` float32 [P, H]: the final
hidden state (after the final norm) at each prompt's last position, in prompt order. vLLM batches
the prompts of all in-flight items itself, so each item is one asyncio task and nothing is
merged here.

The engine is either
- in-process: a `vllm.v1.engine.async_llm.AsyncLLM` built from the deploy YAML's
  `vllm.pooling.v1` backend, running on an event loop in a thread of its own (owned: shut down
  with the stage), or
- served: the `engine_client` of the `vllm serve` process omnigraph runs inside (its endpoint
  plugin), used on that server's event loop (not owned: the server shuts it down). It must be a
  pooling engine of the same hidden size and dtype, checked before the stage serves.

A request that ends while its item runs (an abort, its deadline: the orchestrator's `interrupt`)
cancels the item's task, which aborts its vLLM requests (`engine.abort`) at once. An engine that
dies fails the stage for good.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from omnigraph.bundles.defaults import DEFAULT_MAX_IO_BYTES
from omnigraph.pipelines.config import StagePipelineConfig
from omnigraph.pipelines.deploy import NativeBackendConfig, StageDeployConfig
from omnigraph.stages.errors import HandoffInvalid, StageStartupError, StageUnavailable
from omnigraph.stages.handoff import outputs_as_inputs
from omnigraph.stages.ledger import Reservation, ResourceLedger
from omnigraph.stages.metrics import ReplicaMetrics, StageMetrics
from omnigraph.stages.monitor import StageMonitor
from omnigraph.stages.protocols import HandoffFunc, Stage, WorkItem
from omnigraph.stages.tensors import InputSpec

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle

logger = logging.getLogger("omnigraph.stages")

PROMPT_TOKEN_IDS = "prompt_token_ids"
PROMPT_LENGTHS = "prompt_lengths"
HIDDEN_STATES = "hidden_states"
POOLING_TASK: Final = "embed"
POOLING_TYPE: Final = "LAST"
NATIVE_INPUT_SPECS = {
    PROMPT_TOKEN_IDS: InputSpec(PROMPT_TOKEN_IDS, np.dtype(np.int64), (None,)),
    PROMPT_LENGTHS: InputSpec(PROMPT_LENGTHS, np.dtype(np.int64), (None,)),
}
_TORCH_DTYPES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}


class NativeStageError(StageStartupError):
    """A native stage cannot start: vLLM is missing, the engine did not start, or it does not fit."""


@dataclass(frozen=True)
class ServedEngine:
    """The engine of the `vllm serve` process omnigraph runs inside, and the loop it serves on."""

    engine_client: Any
    loop: asyncio.AbstractEventLoop


def engine_args(backend: NativeBackendConfig) -> Any:
    """vLLM's `AsyncEngineArgs` for a backend: a pooling engine returning raw last hidden states."""
    from vllm.config import PoolerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(backend.model),
        dtype=backend.dtype,
        max_model_len=backend.max_model_len,  # type: ignore[arg-type]  # None: vLLM's own default (the model's)
        runner="pooling",
        convert=POOLING_TASK,
        pooler_config=PoolerConfig(pooling_type=POOLING_TYPE, use_activation=False),
        **backend.engine_args,
    )


_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


def unguarded_main_script() -> str | None:
    """The path of the running script when it has no `if __name__ == "__main__":` guard, else None.

    vLLM starts its engine core in a process that (under the spawn start method) imports the
    parent's main script again; a script that builds an engine at import then fails there, and the
    parent sees only an engine that did not start. This names the cause."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return None  # an interactive session, `python -c`, or a frozen program: nothing is imported again
    try:
        source = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return None if _MAIN_GUARD.search(source) else path


class PoolingEngine:
    """A vLLM engine client and the event loop its calls run on; `owned` engines are ours to stop."""

    def __init__(self, client: Any, loop: asyncio.AbstractEventLoop, *, owned: bool,
                 thread: threading.Thread | None = None) -> None:
        self.client = client
        self.loop = loop
        self.owned = owned
        self._thread = thread

    @classmethod
    def start(cls, backend: NativeBackendConfig, *, stage_id: int, timeout: float) -> PoolingEngine:
        """Build an in-process `AsyncLLM` on a new loop thread; refuses after `timeout` seconds."""
        try:
            import vllm
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise NativeStageError(stage_id, 0, f"vLLM cannot be imported ({exc}); install the vllm extra") from None
        try:
            args = engine_args(backend)
        except (TypeError, ValueError) as exc:  # e.g. an engine_args value of the wrong kind
            raise NativeStageError(stage_id, 0, f"vLLM {vllm.__version__} refused the engine arguments: {exc}") from exc
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"omnigraph-stage{stage_id}-vllm", daemon=True)
        thread.start()

        async def build() -> Any:  # on the loop, so the engine's output handler runs there
            return AsyncLLM.from_engine_args(args)

        future = asyncio.run_coroutine_threadsafe(build(), loop)
        try:
            client = future.result(timeout)
        except BaseException as exc:
            future.add_done_callback(lambda done: _abandon(done, loop))  # a start still running ends first
            script = unguarded_main_script()
            if script is not None:
                raise NativeStageError(stage_id, 0, f"vLLM {vllm.__version__} did not start {backend.model}: its "
                                       f"engine process imports your script {script} again, which has no "
                                       "`if __name__ == \"__main__\":` guard, so it starts omnigraph again instead "
                                       "of vLLM's engine; put the code that builds Omni / AsyncOmni under that "
                                       "guard") from None
            if isinstance(exc, TimeoutError):
                raise NativeStageError(stage_id, 0, f"vLLM {vllm.__version__} did not start {backend.model} "
                                       f"within {timeout:g} s") from None
            raise NativeStageError(stage_id, 0, f"vLLM {vllm.__version__} did not start {backend.model}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return cls(client, loop, owned=True, thread=thread)

    @classmethod
    def served(cls, served: ServedEngine) -> PoolingEngine:
        return cls(served.engine_client, served.loop, owned=False)

    def run(self, coroutine: Any) -> Future:
        """Schedule `coroutine` on the engine's loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    @property
    def dead(self) -> bool:
        """The engine failed for good (its engine-core process died, or its output handler ended)."""
        return self.client.errored

    def close(self, timeout: float) -> None:
        """Shut an owned engine down (its engine-core process exits) and stop the loop thread.

        The engine's output handler is cancelled first: `AsyncLLM.shutdown` stops the engine core
        before it cancels the handler, and a handler that sees the core gone in between logs
        "AsyncLLM output_handler failed ... EngineDeadError" for an ordinary shutdown."""
        if not self.owned:
            return
        self.run(_cancel_other_tasks()).result(timeout)
        self.client.shutdown(timeout=timeout)
        self.run(_cancel_other_tasks()).result(timeout)  # what the shutdown itself left on the loop
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()


async def _cancel_other_tasks() -> None:
    """Cancel and await every other task of the running loop (the engine's output handlers)."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _abandon(build: Future, loop: asyncio.AbstractEventLoop) -> None:
    """Once a refused engine start has ended: shut the engine down if it was built, stop its loop."""
    try:
        if not build.cancelled() and build.exception() is None:
            build.result().shutdown()
    finally:
        loop.call_soon_threadsafe(loop.stop)


def check_engine_fits(engine: Any, backend: NativeBackendConfig, *, stage_id: int) -> None:
    """Refuse an engine that would not return what the plan's backend describes: a pooling runner
    with LAST-token pooling, in the backend's dtype, taking prompts as long as the plan's."""
    model_config = engine.model_config
    problems = []
    if model_config.runner_type != "pooling":
        problems.append(f"it runs the {model_config.runner_type!r} runner, not 'pooling' (serve with --runner pooling "
                        f"--convert {POOLING_TASK})")
    pooler = model_config.pooler_config
    pooling_type = getattr(pooler, "seq_pooling_type", None) if pooler is not None else None
    if pooling_type != POOLING_TYPE:
        problems.append(f"it pools with {pooling_type!r}, not {POOLING_TYPE!r} "
                        f"(--pooler-config '{{\"pooling_type\": \"{POOLING_TYPE}\"}}')")
    if str(model_config.dtype) != _TORCH_DTYPES[backend.dtype]:
        problems.append(f"it computes in {model_config.dtype}, the plan asks for {backend.dtype} "
                        f"(--dtype {backend.dtype})")
    if backend.max_model_len is not None and model_config.max_model_len < backend.max_model_len:
        problems.append(f"it takes prompts of up to {model_config.max_model_len} tokens, the plan's are up to "
                        f"{backend.max_model_len} (--max-model-len {backend.max_model_len})")
    if problems:
        raise NativeStageError(stage_id, 0, f"the vLLM engine serving {model_config.model} does not fit this stage: "
                               + "; ".join(problems))


def _int64_vector(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    array = tensors.get(name)
    if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
        raise HandoffInvalid(f"native stage input {name!r} must be an int64 array of rank 1")
    return array


def split_prompts(tensors: Mapping[str, np.ndarray], max_model_len: int) -> list[list[int]]:
    """The work item's prompts as token-id lists; refuses lengths that do not add up or exceed the engine."""
    ids, lengths = _int64_vector(tensors, PROMPT_TOKEN_IDS), _int64_vector(tensors, PROMPT_LENGTHS)
    if lengths.size == 0 or lengths.min() < 1 or int(lengths.sum()) != ids.size:
        raise HandoffInvalid(f"prompt_lengths {lengths.tolist()} must be >= 1 and add up to the {ids.size} "
                             "prompt token ids")
    if lengths.max() > max_model_len:
        raise HandoffInvalid(f"a prompt of {int(lengths.max())} tokens exceeds the engine's "
                             f"max_model_len {max_model_len}")
    bounds = np.cumsum(lengths)
    return [chunk.tolist() for chunk in np.split(ids, bounds[:-1])]


async def pool_last_hidden_state(client: Any, request_id: str, token_ids: list[int]) -> np.ndarray:
    """One prompt's last hidden state, float32 [H], from a pooling engine's `encode` (what the
    stage asks vLLM for each prompt; the native-stage benchmark times it alone)."""
    from vllm import PoolingParams

    params = PoolingParams(task=POOLING_TASK, use_activation=False)
    final = None
    async for output in client.encode({"prompt_token_ids": token_ids}, params, request_id):
        final = output
    if final is None:
        raise RuntimeError(f"vLLM returned no output for {request_id}")
    return final.outputs.data.cpu().numpy().astype(np.float32, copy=False)


class NativeReplica:
    """The native stage's one replica: submits work items to the engine, tracks them for abort."""

    replica = 0

    def __init__(self, stage: NativeStage, engine: PoolingEngine, reservation: Reservation,
                 ledger: ResourceLedger) -> None:
        self.stage = stage
        self.engine = engine
        self.reservation = reservation
        self._ledger = ledger
        self._lock = threading.Lock()
        self._in_flight: dict[int, tuple[str, Future]] = {}
        self._ids = itertools.count()
        self.max_model_len: int = engine.client.model_config.max_model_len
        self.hidden_size: int = engine.client.model_config.get_hidden_size()
        self.retired_reason: str | None = None
        self.items = 0
        self.prompts = 0

    @property
    def serving(self) -> bool:
        return self.retired_reason is None

    def submit(self, item: WorkItem) -> None:
        """Start the item's engine requests on the engine's loop (returns at once)."""
        with self._lock:
            key = next(self._ids)
            future = self.engine.run(self._run(key, item))
            self._in_flight[key] = (item.request_id, future)
        future.add_done_callback(lambda _: self._forget(key))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._in_flight.pop(key, None)

    def interrupt(self, request_id: str, reason: str) -> bool:
        """Cancel the request's calls in flight; their vLLM requests are aborted (the engine stays)."""
        with self._lock:
            futures = [future for owner, future in self._in_flight.values() if owner == request_id]
        for future in futures:
            future.cancel()
        return bool(futures)

    async def _run(self, key: int, item: WorkItem) -> None:
        """Pool the item's prompts; complete or fail it. Runs on the engine's loop."""
        if not item.is_live():
            return
        item.dispatched()
        try:
            prompts = split_prompts(item.tensors, self.max_model_len)
        except HandoffInvalid as exc:
            item.fail(HandoffInvalid(f"stage {self.stage.stage_id}: {exc}"))
            return
        request_ids = [f"omnigraph-{item.request_id}-{key}-{index}" for index in range(len(prompts))]
        started = time.perf_counter()
        finished = False
        try:
            states = await asyncio.gather(*(pool_last_hidden_state(self.engine.client, rid, ids)
                                            for rid, ids in zip(request_ids, prompts)))
            finished = True
        except Exception as exc:  # the engine refused or failed the requests
            if self.engine.dead:
                self.stage.engine_died(f"vLLM engine failed: {type(exc).__name__}: {exc}")
                item.fail(StageUnavailable(f"stage {self.stage.stage_id}: the vLLM engine died during request "
                                           f"{item.request_id}: {exc}"))
            else:
                item.fail(exc)
            return
        finally:
            if not finished and not self.engine.dead:  # cancelled, late or failed: free the engine's slots now
                await self.engine.client.abort(request_ids)
        seconds = time.perf_counter() - started
        self.items += 1
        self.prompts += len(prompts)
        if item.is_live():
            item.complete({HIDDEN_STATES: np.stack(states)}, seconds)

    def close(self, timeout: float) -> None:
        """Cancel what is in flight, stop an owned engine, release the reservation."""
        if self.retired_reason == "shut down":
            return
        self.retired_reason = "shut down"
        with self._lock:
            futures = [future for _, future in self._in_flight.values()]
        for future in futures:
            future.cancel()
        try:
            self.engine.close(timeout)
        finally:
            self._ledger.release(self.reservation)

    def describe(self) -> dict[str, Any]:
        model_config = self.engine.client.model_config
        with self._lock:
            in_flight = sorted({owner for owner, _ in self._in_flight.values()})
        return {
            "replica": self.replica,
            "state": "serving" if self.serving else "retired",
            "engine": "in-process AsyncLLM" if self.engine.owned else "vllm serve engine_client",
            "served_model": str(model_config.model),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "hidden_size": self.hidden_size,
            "in_flight": in_flight,
            "items": self.items,
            "prompts": self.prompts,
            "reservation": dict(self.reservation.demands),
        }


class NativeStage:
    """An `llm_pooling` stage's serving state: its backend, its one engine replica, its failure."""

    def __init__(self, config: StagePipelineConfig, deploy: StageDeployConfig, *,
                 served: ServedEngine | None = None) -> None:
        if not isinstance(deploy.backend, NativeBackendConfig):
            raise NativeStageError(config.stage_id, 0, "an llm_pooling stage needs a vllm.pooling.v1 backend")
        self.config = config
        self.deploy = deploy
        self.backend: NativeBackendConfig = deploy.backend
        self.stage_id = config.stage_id
        self.input_specs: dict[str, InputSpec] = dict(NATIVE_INPUT_SPECS)
        self.handoff: HandoffFunc = outputs_as_inputs
        self.replicas: list[NativeReplica] = []
        self.failure: str | None = None
        self.verified_by: VerifiedBundle | None = None
        self._served = served

    @property
    def max_io_bytes(self) -> int:
        """An in-process engine has no wire; the graph wire's default bounds its tensors alike."""
        return DEFAULT_MAX_IO_BYTES

    def count_requests(self, admitted: Callable[[], int], in_flight: Callable[[], int]) -> None:
        """vLLM batches by itself: the stage does not wait for batch-mates."""

    # -- the runtime's lifecycle (protocols.ServingStage) -------------------------------------------

    @property
    def bundle(self) -> None:
        """A native stage runs no bundle of its own (`verified_by` holds the one its model is in)."""
        return None

    def bind(self, verified: Sequence[VerifiedBundle]) -> None:
        """Note the verified bundle whose files hold the model folder (its every file is then hashed)."""
        for bundle in verified:
            if self.backend.model.is_relative_to(Path(bundle.root).resolve()):
                self.verified_by = bundle
                return

    def start_replica(self, replica: int, reservation: Reservation, ledger: ResourceLedger,
                      launched: list[Any]) -> None:
        """Start (within the backend's `startup_timeout_s`) or attach to the served engine under
        `reservation`; checks the engine fits. (Its one replica is no worker: `launched` stays as it is.)"""
        started = time.monotonic()
        timeout = self.backend.startup_timeout_s
        if self._served is not None:
            engine = PoolingEngine.served(self._served)
        else:
            engine = PoolingEngine.start(self.backend, stage_id=self.stage_id, timeout=timeout)
        try:
            check_engine_fits(engine.client, self.backend, stage_id=self.stage_id)
            self.replicas.append(NativeReplica(self, engine, reservation, ledger))
        except BaseException:
            engine.close(timeout)
            raise
        how = ("attached (the server's)" if self._served is not None
               else f"started in {time.monotonic() - started:.1f} s")
        logger.info("stage %d: vLLM engine on %s %s", self.stage_id, self.backend.model, how)

    def loaded(self) -> None:
        """Nothing: the inputs are the fixed NATIVE_INPUT_SPECS."""

    def check_consumer(self, following: Stage) -> None:
        """Refuse a next stage whose declared `hidden_states` input does not take this engine's rows."""
        spec = following.input_specs.get(HIDDEN_STATES)
        hidden_size = self.replicas[0].hidden_size
        if spec is None or spec.dtype != np.float32 or len(spec.shape) != 2 or spec.shape[1] not in (None, hidden_size):
            declared = "no hidden_states input" if spec is None else f"hidden_states {spec.describe()}"
            raise NativeStageError(self.stage_id, 0, f"stage {following.stage_id} declares {declared}; this engine "
                                   f"({self.replicas[0].describe()['served_model']}) returns hidden_states "
                                   f"float32[P, {hidden_size}]")

    def abort_start(self, timeout: float) -> None:
        """A start that failed elsewhere: close the engine this stage started."""
        self.stop(timeout)

    def start_serving(self, monitor: StageMonitor) -> None:
        """Nothing to start: the engine serves from its start (and is never replaced)."""

    def metrics(self) -> StageMetrics:
        """Each pooled item counts as one engine call; a native engine is never replaced."""
        state, reason = self.status()
        replicas = list(self.replicas)
        return StageMetrics(
            self.stage_id, self.config.execution_type.value, state, reason, self.deploy.num_replicas,
            sum(r.serving for r in replicas) if self.failure is None else 0, 0,
            tuple(ReplicaMetrics(r.replica, None, "serving" if r.serving else "retired", 0, r.items, r.items, 0)
                  for r in replicas),
            None)

    def submit(self, item: WorkItem) -> None:
        self.check_available()
        self.replicas[0].submit(item)

    def status(self) -> tuple[str, str | None]:
        """("failed", why) once the engine died (a vLLM engine is not replaced), else ("ok", None)."""
        return ("ok", None) if self.failure is None else ("failed", self.failure)

    def interrupt(self, request_id: str, reason: str) -> None:
        """Abort the request's engine calls (the engine stays)."""
        for replica in self.replicas:
            replica.interrupt(request_id, reason)

    def check_available(self) -> None:
        if self.failure is not None:
            raise StageUnavailable(f"stage {self.stage_id} has no live engine ({self.failure}); recreate the pipeline")

    def engine_died(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("stage %d: %s", self.stage_id, reason)

    def stop_replacing(self) -> None:
        """Nothing to stop: a native stage's engine is never replaced (a dead one fails the stage)."""

    def stop(self, timeout: float) -> None:
        for replica in self.replicas:
            replica.close(timeout)

    def describe(self) -> dict[str, Any]:
        import vllm

        return {
            **self.config.describe(),
            "backend": {
                "name": self.backend.name,
                "model": str(self.backend.model),
                "dtype": self.backend.dtype,
                "engine_args": dict(self.backend.engine_args),
                "verified_by": None if self.verified_by is None else {
                    "manifest": str(self.verified_by.manifest_path), "sha256": self.verified_by.manifest_sha256},
            },
            "vllm_version": vllm.__version__,
            "num_replicas": 1,
            "live_replicas": sum(r.serving for r in self.replicas) if self.failure is None else 0,
            "failure": self.failure,
            "replicas": [r.describe() for r in self.replicas],
        }
