"""The engine room: what runs a pipeline's stages.

- `ledger.py`: ResourceLedger (named capacities, atomic reservations, quarantine).
- `runtime.py`: StageRuntime (verify, reserve the whole plan, start and warm up replicas, unwind,
  replace retired replicas in the background).
- `graph_stage.py`: GraphReplica (one worker replica and the thread that feeds it).
- `batching.py`: StageQueue (compatible work items of several requests in one call), merge and split.
- `restarts.py`: RestartBudget (how many replacements a stage may start within a window).
- `orchestrator.py`: admission, stage-to-stage handoff, cancellation, deadlines.
- `tensors.py`, `handoff.py`, `tensor_processor.py`: input checks, the default handoff, raw pipelines.
- `outputs.py`: OmniRequestOutput; `errors.py`: the engine's exceptions.

Nothing is imported here, so `import omnigraph.stages.ledger` stays light.
"""
