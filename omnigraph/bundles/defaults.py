"""omnigraph's defaults in one place: timeouts, bounds and the cache root.

It lives in the ground room (bundles: the standard library only here) because the lowest room that
needs one of them, the bundle cache, is there; every room may import the ground, so the workers,
the deploy schema, the engine and the plugin all read the same value. Each default says why it is
what it is. A route's defaults are the `WorkerRoute` fields' defaults (workers/route.py reads them
from here; the deploy schema reads them from `WorkerRoute`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CUDA_GRAPH_MAX_ROWS",
    "DEFAULT_HANG_GRACE_S",
    "DEFAULT_MAILBOX_BYTES",
    "DEFAULT_MAX_CUDA_GRAPHS",
    "DEFAULT_MAX_IO_BYTES",
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "DEFAULT_MAX_RESTARTS",
    "DEFAULT_NATIVE_STARTUP_TIMEOUT_S",
    "DEFAULT_RESTART_WINDOW_S",
    "DEFAULT_REVERIFY_INTERVAL_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "MAX_CUDA_GRAPHS_LIMIT",
    "MAX_IO_BYTES_LIMIT",
    "MAX_SPIN_WAIT_US",
    "cache_root",
]

# --- the cache -----------------------------------------------------------------------------------

CACHE_ENV = "OMNIGRAPH_CACHE"


def cache_root() -> Path:
    """`$OMNIGRAPH_CACHE`, or `~/.cache/omnigraph` (also when the variable is set but empty)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "omnigraph")


# --- startup -------------------------------------------------------------------------------------

# Why: a graph worker starts (interpreter, onnxruntime import, hello) and then loads and warms its
# bundle; each of the two steps gets this long. Used by the engine (StageRuntime) and as the default
# of a bare WorkerClient.start.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
# Why it differs: a vLLM pooling engine loads a checkpoint, profiles memory and allocates its KV
# cache in one step, which takes minutes for large models, not the seconds of an ONNX worker.
DEFAULT_NATIVE_STARTUP_TIMEOUT_S = 600.0

# --- admission and recovery ----------------------------------------------------------------------

# Why 128: one full `/v1/systemone/batch` (64 states, each a request) is admitted as a unit on an
# idle server, with as much room again for single requests.
DEFAULT_MAX_QUEUED_REQUESTS = 128
DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 60.0
# Why: a changed bundle is reported within half a minute, and a stat-only check of a few files
# every 30 s costs nothing measurable (bundles/watch.py re-hashes in full only now and then).
DEFAULT_REVERIFY_INTERVAL_S = 30.0
# Why: a call whose requests are all gone still runs to its end on the worker; the longest honest
# call (64 questions of 512 tokens on a CPU) takes a few seconds, so a worker silent this long after
# its call was fenced is hung, not busy.
DEFAULT_HANG_GRACE_S = 10.0

# --- a route's defaults and bounds (WorkerRoute) -------------------------------------------------

DEFAULT_MAX_IO_BYTES = 8 * 1024 * 1024
# Why: the wire's own cap on a frame's tensor bytes must stay addressable and sane.
MAX_IO_BYTES_LIMIT = 1 << 40
# Why: vLLM captures CUDA graphs up to a batch of 512 by default (max_cudagraph_capture_size); a
# decision row carries a whole sequence, so far fewer rows are launch-bound.
DEFAULT_CUDA_GRAPH_MAX_ROWS = 8
# Why: a served stage visits the bundle's example shape, its warm-up request's and one shape per
# (rows, length) bucket of its traffic; 4 slots left batch-1 Laya at 512 tokens uncaptured on the
# H200 (5.2 ms instead of 2.3). Each graph keeps its buffers inside the route's gpu_mem_limit.
DEFAULT_MAX_CUDA_GRAPHS = 16
# Why: more captured graphs than this is a shape policy gone wrong, not a cache.
MAX_CUDA_GRAPHS_LIMIT = 256
# Why: polling longer than this is a busy loop, not a wait for the next message.
MAX_SPIN_WAIT_US = 100_000
# Why: a decision model's call (token ids, masks) and its answer fit with room to spare; larger
# frames go through the socket, and the worker maps two areas of this size.
DEFAULT_MAILBOX_BYTES = 1 << 20
