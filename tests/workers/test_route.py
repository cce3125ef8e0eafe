"""WorkerRoute: validated once, carried to the worker as JSON, turned into ORT providers."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnigraph.workers.route import ROUTE_FIELDS, RouteInvalid, WorkerRoute, route_default

PY = "/usr/bin/python3"


def test_defaults_allow_only_the_target():
    route = WorkerRoute(name="r", interpreter=PY)
    assert route.allowed_providers == ("CPUExecutionProvider",)
    assert route.ort_providers() == [("CPUExecutionProvider", {})]


def test_cuda_route_options_and_cpu_fallback():
    route = WorkerRoute(
        name="gpu", interpreter=PY, ep="cuda", device_id=1, gpu_mem_limit=4 << 30, enable_cuda_graph=True,
        provider_options={"cudnn_conv_algo_search": "HEURISTIC", "do_copy_in_default_stream": True},
        allowed_providers=("CUDAExecutionProvider", "CPUExecutionProvider"), min_fraction_on_target=0.9,
    )
    assert route.ort_providers() == [
        ("CUDAExecutionProvider", {"device_id": "1", "gpu_mem_limit": str(4 << 30), "enable_cuda_graph": "1",
                                   "cudnn_conv_algo_search": "HEURISTIC", "do_copy_in_default_stream": "1"}),
        ("CPUExecutionProvider", {}),
    ]
    strict = WorkerRoute(name="gpu", interpreter=PY, ep="cuda")
    assert [p for p, _ in strict.ort_providers()] == ["CUDAExecutionProvider"]


def test_tensorrt_route_chains_cuda_when_allowed():
    route = WorkerRoute(name="trt", interpreter=PY, ep="tensorrt", provider_options={"trt_fp16_enable": True},
                        allowed_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider"))
    assert route.ort_providers() == [
        ("TensorrtExecutionProvider", {"device_id": "0", "trt_fp16_enable": "1"}),
        ("CUDAExecutionProvider", {"device_id": "0"}),
    ]


def test_json_round_trip():
    route = WorkerRoute(name="r", interpreter=PY, ep="cuda", env={"A": "1"}, intra_op_num_threads=2,
                        allowed_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    assert WorkerRoute.from_json(route.to_json()) == route


@pytest.mark.parametrize("fields,message", [
    ({"interpreter": "python3"}, "absolute path"),
    ({"ep": "rocm"}, "ep must be one of"),
    ({"device_id": -1}, "device_id"),
    ({"allowed_providers": ("CUDAExecutionProvider",)}, "lacks the target"),
    ({"allowed_providers": ("cpu",)}, "ORT provider names"),
    ({"min_fraction_on_target": 1.5}, "min_fraction_on_target"),
    ({"os_domain": "windows"}, "os_domain"),
    ({"max_io_bytes": 0}, "max_io_bytes"),
    ({"enable_cuda_graph": True}, "needs ep 'cuda'"),
    ({"gpu_mem_limit": 1 << 30}, "cuda and tensorrt routes only"),
    ({"intra_op_num_threads": 0}, "intra_op_num_threads"),
    ({"env": {"A": 1}}, "env"),
    ({"provider_options": {"a": [1]}}, "provider_options"),
    ({"spin_wait_us": -1}, "spin_wait_us"),
    ({"cuda_graph_max_rows": 0}, "cuda_graph_max_rows"),
    ({"max_cuda_graphs": 0}, "max_cuda_graphs"),
    ({"max_cuda_graphs": 257}, "max_cuda_graphs"),
    ({"spin_wait_us": 100_001}, "spin_wait_us"),
    ({"spin_wait_us": 0.5}, "spin_wait_us"),
    ({"mailbox_bytes": 100}, "mailbox_bytes"),
    ({"mailbox_bytes": (1 << 30) + 1}, "mailbox_bytes"),
    ({"mailbox_bytes": True}, "mailbox_bytes"),
])
def test_invalid_fields_are_refused(fields, message):
    with pytest.raises(RouteInvalid, match=message):
        WorkerRoute(**{"name": "r", "interpreter": PY, **fields})


def test_unknown_json_fields_are_refused():
    with pytest.raises(RouteInvalid, match="unknown fields"):
        WorkerRoute.from_dict({"name": "r", "interpreter": PY, "providers": []})
    with pytest.raises(RouteInvalid, match="shm_threshold_bytes"):  # memory files per tensor left the senders
        WorkerRoute.from_dict({"name": "r", "interpreter": PY, "shm_threshold_bytes": 1 << 27})
    with pytest.raises(RouteInvalid, match="interpreter"):
        WorkerRoute.from_dict({"name": "r"})


def test_defaults_are_declared_once():
    """A route's defaults are its dataclass fields' (read from bundles/defaults.py); the deploy schema
    reads them through route_default, and the fields without one are the two every route names."""
    from omnigraph.bundles import defaults

    route = WorkerRoute(name="r", interpreter=PY)
    assert (route.max_io_bytes, route.cuda_graph_max_rows, route.max_cuda_graphs, route.mailbox_bytes) == (
        defaults.DEFAULT_MAX_IO_BYTES, defaults.DEFAULT_CUDA_GRAPH_MAX_ROWS, defaults.DEFAULT_MAX_CUDA_GRAPHS,
        defaults.DEFAULT_MAILBOX_BYTES)
    for name in ROUTE_FIELDS:
        if name in ("name", "interpreter"):
            with pytest.raises(KeyError):
                route_default(name)
        else:
            default = route_default(name)
            assert default == getattr(WorkerRoute(name="r", interpreter=PY, ep="cuda"), name) or name in (
                "ep", "allowed_providers")  # the cuda route's own ep, and the target filled in
    assert route_default("provider_options") is not route_default("provider_options")  # a fresh dict each time


def test_the_cache_root_is_one_function(monkeypatch, tmp_path):
    from omnigraph.bundles import cache, defaults
    from omnigraph.workers.ops import build

    monkeypatch.setenv(defaults.CACHE_ENV, str(tmp_path))
    assert cache.cache_root() == defaults.cache_root() == tmp_path and build._cache_root() == tmp_path / "ops"
    monkeypatch.setenv(defaults.CACHE_ENV, "")  # set but empty: the user cache, for the ops library too
    assert build._cache_root() == Path.home() / ".cache" / "omnigraph" / "ops"
