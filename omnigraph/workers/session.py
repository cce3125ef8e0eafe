"""The ONNX Runtime side of a graph worker: build the session a route asks for, warm it up on the
bundle's example inputs while ORT profiles where each node runs, and run calls (plain on CPU,
IOBinding on CUDA, one CUDA graph per input shape where the route enables them).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import onnxruntime as ort

from omnigraph.bundles import BundleError, VerifiedBundle
from omnigraph.bundles.loading import LoadedBundle, load_bundle
from omnigraph.workers.errors import LoadRefused, PlacementRefused, RemoteError
from omnigraph.workers.ops.loader import OpsLibraryError, custom_ops_library
from omnigraph.workers.placement import PlacementReport, check_placement, placement_from_profile
from omnigraph.workers.reports import LoadReport, TensorSpec
from omnigraph.workers.route import WorkerRoute
from omnigraph.workers.wire import TensorDescriptor, wire_dtype_of

# ORT type string -> wire dtype name (the types a graph's I/O may have to be served).
ONNX_TO_WIRE = {
    "tensor(bool)": "bool",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}
_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16
# ORT's run option naming the CUDA graph to capture / replay; -1 runs without one.
GPU_GRAPH_ID = "gpu_graph_id"
_FALLBACK_DISABLED = "fallback to CPU EP has been explicitly disabled"


# Why: CUDA allocations are 256-byte aligned; tensors packed in one buffer keep that alignment.
_DEVICE_ALIGNMENT = 256


def _packed_offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Aligned offsets of tensors of these sizes in one buffer, and the buffer's size."""
    offsets, total = [], 0
    for size in nbytes:
        offsets.append(total)
        total += -(-size // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
    return offsets, max(total, _DEVICE_ALIGNMENT)


@dataclass
class _CudaGraphSlot:
    """Fixed device memory of one input shape: a CUDA graph replays on the same addresses.

    The inputs share one device buffer and the outputs another, so a call costs one copy each way
    instead of one per tensor (each copy is a synchronous CUDA call)."""

    graph_id: int
    binding: ort.IOBinding
    staging: np.ndarray                                  # host image of the input buffer
    device_inputs: ort.OrtValue                          # uint8 [staging.size] on the device
    input_views: tuple[tuple[str, np.ndarray], ...]      # (name, its bytes inside staging)
    device_outputs: ort.OrtValue | None = None           # uint8, every output at its offset
    output_layout: tuple[tuple[int, int, np.dtype, tuple[int, ...]], ...] = ()  # (start, stop, dtype, shape)


class GraphSession:
    """One verified bundle's InferenceSession, built for one route."""

    def __init__(self, session: ort.InferenceSession, route: WorkerRoute) -> None:
        self._session = session
        self._route = route
        self.inputs = tuple(TensorSpec(i.name, i.type, tuple(i.shape)) for i in session.get_inputs())
        self.outputs = tuple(TensorSpec(o.name, o.type, tuple(o.shape)) for o in session.get_outputs())
        for spec in self.inputs + self.outputs:
            if spec.onnx_type not in ONNX_TO_WIRE:
                raise LoadRefused("load_failed", f"graph tensor {spec.name!r} has type {spec.onnx_type}, "
                                                 "which the wire does not carry")
        for spec in self.outputs:
            if spec.onnx_type == "tensor(bfloat16)":
                raise LoadRefused(
                    "load_failed",
                    f"graph output {spec.name!r} is bfloat16, which onnxruntime's Python binding cannot return; "
                    "cast it to float in the graph",
                )
        self._input_wire = {spec.name: ONNX_TO_WIRE[spec.onnx_type] for spec in self.inputs}
        # (name, wire dtype, declared shape) per input: what check_inputs walks for a new descriptor tuple
        self._input_checks = tuple((spec.name, self._input_wire[spec.name], spec.shape) for spec in self.inputs)
        self._bfloat16_inputs = "bfloat16" in self._input_wire.values()
        self._output_names = [spec.name for spec in self.outputs]
        self._on_cuda = session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        self._cuda_graph_slots: dict[tuple[tuple[int, ...], ...], _CudaGraphSlot] = {}
        self._accepted: tuple[TensorDescriptor, ...] | None = None  # the inputs last accepted (check_inputs)
        # Why: a call given RunOptions skips pybind11's overload resolution of None (0.8 us of 7 on the CI machine)
        self._run_options = ort.RunOptions()

    @property
    def providers(self) -> tuple[str, ...]:
        return tuple(self._session.get_providers())

    # ------------------------------------------------------------------------------------------
    # Calls

    def check_inputs(self, descriptors: Sequence[TensorDescriptor]) -> None:
        """Refuse inputs (described as the wire describes them) that differ from the graph's declared
        names, dtypes, ranks and static dims. The last descriptors accepted are remembered by value,
        so a call laid out like the one before is not checked again (the comparison is cheapest
        when the wire hands back the very tuple it cached for a repeated header, but any equal
        descriptors match)."""
        if descriptors == self._accepted:
            return
        described = {desc.name: desc for desc in descriptors}
        declared = self._input_wire
        if described.keys() != declared.keys():
            missing = sorted(declared.keys() - described.keys())
            unexpected = sorted(described.keys() - declared.keys())
            raise RemoteError("input_name_mismatch", f"missing inputs {missing}, unexpected inputs {unexpected}; "
                                                     f"the graph takes {sorted(declared)}")
        for name, wire_dtype, declared_shape in self._input_checks:
            dtype, shape = described[name].dtype, described[name].shape
            if dtype != wire_dtype:
                raise RemoteError("input_dtype_mismatch", f"input {name!r} is {dtype}, the graph declares {wire_dtype}")
            if len(shape) != len(declared_shape):
                raise RemoteError("input_rank_mismatch", f"input {name!r} has rank {len(shape)} (shape {list(shape)}), "
                                                         f"the graph declares rank {len(declared_shape)}")
            for axis, (got, want) in enumerate(zip(shape, declared_shape)):
                if got != want and isinstance(want, int):
                    raise RemoteError("input_shape_mismatch", f"input {name!r} dim {axis} is {got}, the graph declares "
                                                              f"{want} (shape {list(declared_shape)})")
        self._accepted = tuple(descriptors)

    def run(self, arrays: Mapping[str, np.ndarray], descriptors: Sequence[TensorDescriptor]) -> dict[str, np.ndarray]:
        """Check the inputs, run, and return host arrays by output name. ``descriptors`` describe
        ``arrays`` (the frame's tensors, or ``describe(arrays)``)."""
        self.check_inputs(descriptors)
        feed: Mapping[str, np.ndarray | ort.OrtValue]
        if self._bfloat16_inputs:
            feed = {name: self._ort_input(arrays[name], dtype) for name, dtype in self._input_wire.items()}
        else:  # the checked arrays are the feed as they are
            feed = arrays
        try:
            if self._route.enable_cuda_graph:
                outputs = self._run_cuda_graph(arrays)
            elif self._on_cuda:
                outputs = self._run_io_binding(feed)
            else:
                outputs = self._session.run(self._output_names, feed, self._run_options)
        except Exception as exc:  # ORT's exception classes derive from Exception only
            raise RemoteError("run_failed", f"{type(exc).__name__}: {exc}") from None
        return dict(zip(self._output_names, outputs))

    @staticmethod
    def _ort_input(array: np.ndarray, wire_dtype: str) -> np.ndarray | ort.OrtValue:
        if wire_dtype == "bfloat16":  # raw bits: tell ORT the element type
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(array), _BFLOAT16)
        return array

    def _run_io_binding(
        self, feed: Mapping[str, np.ndarray | ort.OrtValue], options: ort.RunOptions | None = None
    ) -> list[np.ndarray]:
        """Host inputs in, device outputs copied back (a fresh binding each call)."""
        binding = self._session.io_binding()
        for name, value in feed.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        for name in self._output_names:
            binding.bind_output(name, "cuda", self._route.device_id)
        self._session.run_with_iobinding(binding, options)
        return binding.copy_outputs_to_cpu()

    @property
    def cuda_graph_shapes(self) -> int:
        """Input shapes that have a CUDA graph slot (captured, or captured on their next call)."""
        return len(self._cuda_graph_slots)

    def _run_cuda_graph(self, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Replay (or let ORT capture, after its two warm-up runs) the CUDA graph of this shape."""
        key = tuple(arrays[name].shape for name in self._input_wire)
        slot = self._cuda_graph_slots.get(key)
        if slot is None and len(self._cuda_graph_slots) < self._route.max_cuda_graphs \
                and all(not shape or shape[0] <= self._route.cuda_graph_max_rows for shape in key):
            slot = self._new_cuda_graph_slot(arrays, graph_id=len(self._cuda_graph_slots))
            self._cuda_graph_slots[key] = slot
        options = ort.RunOptions()
        if slot is None:  # too many rows, or more shapes than graphs: run this one uncaptured
            options.add_run_config_entry(GPU_GRAPH_ID, "-1")
            return self._run_io_binding({name: np.ascontiguousarray(arrays[name]) for name in self._input_wire},
                                        options)
        for name, view in slot.input_views:
            view[:] = np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8)
        slot.device_inputs.update_inplace(slot.staging)
        if slot.device_outputs is None:  # first call of this shape: learn the output shapes uncaptured
            options.add_run_config_entry(GPU_GRAPH_ID, "-1")
            for name in self._output_names:
                slot.binding.bind_output(name, "cuda", self._route.device_id)
            self._session.run_with_iobinding(slot.binding, options)
            produced = [value.numpy() for value in slot.binding.get_outputs()]
            self._bind_packed_outputs(slot, produced)
            return produced
        options.add_run_config_entry(GPU_GRAPH_ID, str(slot.graph_id))
        self._session.run_with_iobinding(slot.binding, options)
        packed = slot.device_outputs.numpy()  # one copy back; the outputs are views of it
        return [packed[start:stop].view(dtype).reshape(shape) for start, stop, dtype, shape in slot.output_layout]

    def _new_cuda_graph_slot(self, arrays: Mapping[str, np.ndarray], graph_id: int) -> _CudaGraphSlot:
        names = list(self._input_wire)
        offsets, total = _packed_offsets([arrays[name].nbytes for name in names])
        staging = np.zeros(total, dtype=np.uint8)
        device_inputs = ort.OrtValue.ortvalue_from_numpy(staging, "cuda", self._route.device_id)
        binding = self._session.io_binding()
        views = []
        for name, offset in zip(names, offsets):
            array = arrays[name]
            binding.bind_input(name, "cuda", self._route.device_id, array.dtype.type, list(array.shape),
                               device_inputs.data_ptr() + offset)
            views.append((name, staging[offset:offset + array.nbytes]))
        return _CudaGraphSlot(graph_id=graph_id, binding=binding, staging=staging, device_inputs=device_inputs,
                              input_views=tuple(views))

    def _bind_packed_outputs(self, slot: _CudaGraphSlot, produced: list[np.ndarray]) -> None:
        """Bind every output of the slot's shape inside one device buffer (what the graph will write)."""
        offsets, total = _packed_offsets([array.nbytes for array in produced])
        slot.device_outputs = ort.OrtValue.ortvalue_from_shape_and_type([total], np.uint8, "cuda",
                                                                        self._route.device_id)
        for name, array, offset in zip(self._output_names, produced, offsets):
            slot.binding.bind_output(name, "cuda", self._route.device_id, array.dtype.type, list(array.shape),
                                     slot.device_outputs.data_ptr() + offset)
        slot.output_layout = tuple((offset, offset + array.nbytes, array.dtype, array.shape)
                                   for array, offset in zip(produced, offsets))


# ----------------------------------------------------------------------------------------------
# Loading


def _session_options(loaded: LoadedBundle, route: WorkerRoute, profile_prefix: str | None, *,
                     disable_cpu_fallback: bool) -> ort.SessionOptions:
    """Options whose external initializers are the verified bytes (ORT copies them while it builds
    the session; the options keep pointers into `loaded`, so they must not outlive it)."""
    options = ort.SessionOptions()
    if loaded.external_data:
        locations = list(loaded.external_data)
        options.add_external_initializers_from_files_in_memory(
            locations, [np.frombuffer(loaded.external_data[name], np.uint8) for name in locations],
            [len(loaded.external_data[name]) for name in locations])
    options.log_severity_level = 3  # errors only: the worker's stderr is its log
    if route.intra_op_num_threads is not None:
        options.intra_op_num_threads = route.intra_op_num_threads
    if loaded.custom_ops_library is not None:
        with _private_file(loaded.custom_ops_library) as library:
            options.register_custom_ops_library(library)  # loaded now: the descriptor may close
    if disable_cpu_fallback:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


@contextlib.contextmanager
def _private_file(content: bytes) -> Iterator[str]:
    """A path to `content` in an anonymous in-memory file of this process (memfd), so a library
    loaded from it is the verified bytes, whatever happens to the bundle's file meanwhile."""
    fd = os.memfd_create("omnigraph-verified", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as stream:
            stream.write(content)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _create_session(loaded: LoadedBundle, route: WorkerRoute, profile_prefix: str | None, *,
                    disable_cpu_fallback: bool, notes: list[str]) -> ort.InferenceSession:
    """A session built from the verified bytes in `loaded`, never from the files by path: a file
    changed after verification cannot be what runs."""
    options = _session_options(loaded, route, profile_prefix, disable_cpu_fallback=disable_cpu_fallback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = ort.InferenceSession(loaded.graph, options, providers=_providers(loaded.bundle, route))
    notes.extend(str(w.message) for w in caught)
    return session


def _providers(bundle: VerifiedBundle, route: WorkerRoute) -> list[tuple[str, dict[str, str]]]:
    """The route's providers. An fp32 bundle computes in float32 on CUDA too: the CUDA provider's
    default TF32 matrix products (10-bit mantissa) moved the tiny Laya bundle's probabilities by
    3e-4 against the CPU on the H200; a route's own `use_tf32` option still wins."""
    providers = route.ort_providers()
    if bundle.manifest.metadata.precision == "fp32":
        providers = [(name, {"use_tf32": "0", **options}) if name == "CUDAExecutionProvider" else (name, options)
                     for name, options in providers]
    return providers


def _example_inputs(loaded: LoadedBundle) -> dict[str, np.ndarray] | None:
    if loaded.example_inputs is None:
        return None
    with np.load(io.BytesIO(loaded.example_inputs), allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def describe(arrays: Mapping[str, np.ndarray]) -> tuple[TensorDescriptor, ...]:
    """The wire's descriptors of ``arrays``, each as its own array's wire dtype (for GraphSession.run
    on arrays that did not come off the wire)."""
    return tuple(TensorDescriptor(name, wire_dtype_of(array), array.shape, array.nbytes, None, None)
                 for name, array in arrays.items())


def _run_example(graph: GraphSession, example: dict[str, np.ndarray]) -> None:
    """One call on the bundle's example inputs, each sent as its own array's wire dtype."""
    graph.run(example, describe(example))


def _warmup_placement(session: ort.InferenceSession, graph: GraphSession, example: dict[str, np.ndarray] | None,
                      target: str) -> PlacementReport:
    """Run the example inputs once under the profiler; the profile file is deleted afterwards."""
    try:
        if example is not None:
            _run_example(graph, example)
    finally:
        profile = session.end_profiling()
    try:
        if example is None:
            return PlacementReport.unavailable(target, "the bundle has no example inputs, so no warmup ran")
        return placement_from_profile(profile, target)
    finally:
        if profile:
            Path(profile).unlink(missing_ok=True)


def load_session(manifest_path: str, route: WorkerRoute) -> tuple[GraphSession, LoadReport]:
    """Verify the bundle again, build the session, warm up, and check the real placement; the
    session returned is the one whose placement was read, built from the bytes verification
    hashed (bundles/loading.py).

    Raises LoadRefused (bundle_invalid, load_failed) or PlacementRefused. When the route forbids
    CPU, the session disables CPU fallback; if ORT then refuses to build it, a second, diagnostic
    session with fallback allowed is profiled so the refusal names the nodes that would fall back.
    """
    try:
        loaded = load_bundle(manifest_path)
        bundle = loaded.bundle
        custom_ops_library(bundle)  # the library's ABI and domain are this worker's, not only its hash
    except BundleError as exc:
        raise LoadRefused("bundle_invalid", str(exc)) from None
    except OpsLibraryError as exc:
        raise LoadRefused("bundle_invalid", f"custom-op library: {exc}") from None
    try:
        example = _example_inputs(loaded)
    except (OSError, ValueError) as exc:
        raise LoadRefused("load_failed", f"example inputs {bundle.example_inputs_path}: {exc}") from None
    notes: list[str] = []
    if route.ep != "cpu" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA / cuDNN from the interpreter's nvidia-* packages (no torch here)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omnigraph-profile-") as profile_dir:
        prefix = os.path.join(profile_dir, "warmup")
        forbid_cpu = "CPUExecutionProvider" not in route.allowed_providers
        try:
            session = _create_session(loaded, route, prefix, disable_cpu_fallback=forbid_cpu, notes=notes)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/... classes
            if not (forbid_cpu and _FALLBACK_DISABLED in str(exc)):
                raise LoadRefused("load_failed", f"onnxruntime could not build the session: {exc}") from None
            _refuse_cpu_fallback(loaded, route, prefix, example, str(exc))
        graph = GraphSession(session, route)
        try:
            placement = _warmup_placement(session, graph, example, route.target_provider)
        except RemoteError as exc:
            raise LoadRefused("load_failed", f"warmup on the example inputs failed: {exc}") from None
    if placement.fraction_on_target is None:
        notes.append(f"placement unavailable: {placement.note}")
    check_placement(placement, route.allowed_providers, route.min_fraction_on_target)
    # The profiled session serves: once end_profiling has run it is as fast per call as a session
    # built without the profiler (ORT 1.32, 4 KB identity and a 200-node graph, 40,000 calls each:
    # equal medians), so no second session is built.
    del loaded  # the verified bytes: ORT holds its own copy of the weights
    report = LoadReport(
        manifest_path=str(bundle.manifest_path),
        manifest_sha256=bundle.manifest_sha256,
        component=bundle.manifest.component,
        session_providers=graph.providers,
        inputs=graph.inputs,
        outputs=graph.outputs,
        placement=placement,
        custom_ops_library=str(bundle.custom_ops_path) if bundle.custom_ops_path else None,
        warmup_ms=(time.perf_counter() - started) * 1000.0,
        notes=tuple(notes),
    )
    return graph, report


def _refuse_cpu_fallback(loaded: LoadedBundle, route: WorkerRoute, prefix: str, example: dict[str, np.ndarray] | None,
                         ort_message: str) -> NoReturn:
    """ORT refused to build the session because nodes would fall back to CPU: find and name them."""
    diagnostic = _create_session(loaded, route, prefix + "-diagnostic", disable_cpu_fallback=False, notes=[])
    placement = _warmup_placement(diagnostic, GraphSession(diagnostic, route), example, route.target_provider)
    check_placement(placement, route.allowed_providers, route.min_fraction_on_target)
    raise PlacementRefused("placement_refused", f"{ort_message} (the diagnostic run placed no node outside "
                                                f"{list(route.allowed_providers)})", placement)
