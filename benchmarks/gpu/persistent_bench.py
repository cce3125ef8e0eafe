"""The persistent weight-streaming layer kernel against today's path, on the GPU (issue 19).

For each row count M (batch-1 requests of 64 / 176 / 512 tokens) and Laya's 28 layers of
full-size projections (Wqkv [3072x1024], Wo [1024x1024], Wi [5248x1024], Wo_mlp [1024x2624], BF16,
28 distinct weights each so nothing stays in L2), GPU time per forward's projections by CUDA events
over CUDA-graph replays:

- `copy`: a 2 GiB device-to-device copy (bytes read + written): the measured HBM ceiling;
- `cublas gemms`: the 112 projection GEMMs alone, F.linear (cuBLAS), as ORT's MatMul runs them;
- `torch layer tail`: per layer Wo -> +residual -> LayerNorm -> Wi -> GeGLU -> Wo_mlp -> +residual ->
  LayerNorm -> next Wqkv, as separate kernels (cuBLAS + torch elementwise), the op path of the
  fast bundle without its attention;
- `persistent x28`: the same chain through `persistent_layer.cu`, one launch per layer (28 launches,
  the semantics an ORT op would have), for each plan (tiles / K splits per phase);
- `persistent 1 launch`: all 28 layers in one launch (attention replaced by a stand-in: the next
  layer's ctx is qkv[:, :1024]).

Numerics, before any timing of a plan and in the same process: the kernel's outputs (residual FP32,
qkv BF16) against a torch FP32 reference that rounds to BF16 where the kernel does (GEMM inputs),
||out - ref|| / ||ref||, for one layer (two fresh draws) and for the 28-layer chain; outputs are
poisoned with NaN first. A plan whose numerics fail is not timed. Every wait on the GPU has a
deadline: a kernel that does not finish (a dependency deadlock) ends the process with exit code 3.

    python3 benchmarks/gpu/persistent_bench.py --lib build/persistent/libpersistent.so [--kernel NAME] \
        [--rows 64 176 512] [--plans 128,164,128,128/1,1,1,1 ...] [--json PATH] [--experiments]

`--kernel` names the build in every row (`kernel`), so rows of two builds timed one after the other
(persistent_run.sh with BASE=...) stay apart when merged.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

D, F, QKV, LAYERS = 1024, 2624, 3072, 28
SHAPES = {"wo": (D, D), "wi": (2 * F, D), "wo_mlp": (D, F), "wqkv": (QKV, D)}
PHASES = ("wo", "wi_geglu", "wo_mlp", "wqkv")
WEIGHT_BYTES_PER_LAYER = 2 * sum(n * k for n, k in SHAPES.values())
DEFAULT_PLANS = ("64,132,64,128/2,1,2,1", "64,164,64,128/2,1,2,1", "64,132,64,132/2,1,2,1")
# the kernel's TraceMoment, in order (persistent_layer.cu); a trace record is flags, then these
MOMENTS = ("begin", "dependency", "weights", "gemm", "ticket", "epilogue", "met", "normalized", "signalled",
           "issued")
TRACE_FIELDS = 1 + len(MOMENTS)
FIRST_FINISHER_MOMENT = MOMENTS.index("epilogue")  # from here on only the tile's finisher does work
REL_LIMIT_X1 = {"resid": 1e-3, "qkv": 1e-2}
REL_LIMIT_28 = {"resid": 2e-2, "qkv": 3e-2}


def pack(w):  # [N, K] -> the kernel's n8-major layout (see persistent_layer.h)
    n, k = w.shape
    return w.reshape(n // 8, 8, k // 32, 4, 8).permute(0, 2, 1, 3, 4).contiguous()


def interleave_wi(wi):  # gate rows / up rows -> 8 gate rows, their 8 up rows, ...
    two_f, k = wi.shape
    return wi.reshape(2, two_f // 16, 8, k).permute(1, 0, 2, 3).reshape(two_f, k)


def sync(deadline_s: float = 20.0) -> None:
    """torch.cuda.synchronize with a deadline: a persistent kernel that deadlocks never returns."""
    import torch

    event = torch.cuda.Event()
    event.record()
    end = time.monotonic() + deadline_s
    while not event.query():
        if time.monotonic() > end:
            print(f"HANG: the GPU did not finish within {deadline_s} s", flush=True)
            os._exit(3)
        time.sleep(0.0005)
    torch.cuda.synchronize()


def timed_graph_us(run, replays: int = 20, repeats: int = 5) -> float:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    sync()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        sync()
        samples.append(start.elapsed_time(end) / replays * 1000.0)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 176, 512])
    parser.add_argument("--plans", nargs="+", default=list(DEFAULT_PLANS),
                        help="tiles per phase / K splits per phase, e.g. 128,164,128,128/1,1,1,1")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kernel", default="tree", help="label of the build, written into every row")
    parser.add_argument("--experiments", action="store_true",
                        help="also time the first plan's 1-launch kernel without A loads / without mma, and "
                             "trace its skeleton (debug 3) per phase (wrong results; where time goes)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as fn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    lib = ctypes.CDLL(str(args.lib))
    lib.omnigraph_persistent_workspace_bytes.restype = ctypes.c_size_t
    lib.omnigraph_persistent_workspace_bytes.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.omnigraph_persistent_error.restype = ctypes.c_char_p
    lib.omnigraph_persistent_launch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float] + [
        ctypes.c_void_p
    ] * 7 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    identity = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", *sys.argv]),
        "kernel": args.kernel,
    }
    rows_out: list[dict] = []

    def record(case: str, m: int | None, metric: str, value: float, unit: str, **extra) -> None:
        rows_out.append({"case": case, "rows": m, "metric": metric, "value": round(value, 4), "unit": unit,
                         **extra, **identity})
        print(f"[{args.kernel}] {case:<34} M={m!s:>4} {metric:<22} {value:>12.4f} {unit} {extra.get('variant', '')}",
              flush=True)

    def copy_bandwidth(label: str) -> float:  # the HBM ceiling: a 2 GiB copy, bytes read + written
        src = torch.randn(1 << 29, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(20):  # let the clocks rise
            dst.copy_(src)
        copy_us = timed_graph_us(lambda: dst.copy_(src), replays=10, repeats=5)
        tbs = 2 * src.numel() * 4 / (copy_us * 1e-6) / 1e12
        record(f"copy 2 GiB d2d ({label})", None, "bandwidth", tbs, "TB/s")
        return tbs

    copy_tbs = copy_bandwidth("first")

    weights = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * (k ** -0.5)
                for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
    norms = [{"mlp": 1 + 0.1 * torch.randn(D, device="cuda"), "attn": 1 + 0.1 * torch.randn(D, device="cuda")}
             for _ in range(LAYERS)]
    packed = [{name: pack(interleave_wi(w) if name == "wi" else w) for name, w in layer.items()}
              for layer in weights]
    pointer_table = (ctypes.c_uint64 * (6 * LAYERS))()
    for layer in range(LAYERS):
        for i, ptr in enumerate([packed[layer][n].data_ptr() for n in SHAPES]
                                + [norms[layer]["mlp"].data_ptr(), norms[layer]["attn"].data_ptr()]):
            pointer_table[6 * layer + i] = ptr

    def ref_layer(ctx, h, layer):
        w, nm = weights[layer], norms[layer]
        h1 = h + ctx.float() @ w["wo"].float().T
        x = (fn.layer_norm(h1, (D,), eps=1e-5) * nm["mlp"]).bfloat16()
        u = x.float() @ w["wi"].float().T
        g = (fn.gelu(u[:, :F]) * u[:, F:]).bfloat16()
        out = h1 + g.float() @ w["wo_mlp"].float().T
        y = (fn.layer_norm(out, (D,), eps=1e-5) * nm["attn"]).bfloat16()
        return out, y.float() @ w["wqkv"].float().T

    def rel(a, b) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count

    def phase_trace(m: int, tag: str, debug: int, stamps) -> None:
        """Per phase, mean over layers 1..27: the moment each CTA reached each TraceMoment, after
        the previous phase completed (us): the median CTA and the last CTA (finishers only from the
        epilogue on), and when the phase completed."""
        import numpy as np

        completed = stamps[: 1 + 4 * LAYERS]  # [q] = when global phase q - 1 completed
        rec = stamps[1 + 4 * LAYERS:].reshape(LAYERS, 4, sm_count, TRACE_FIELDS)
        steps = [(completed[i + 1] - completed[i]) / 1000.0 for i in range(4 * LAYERS)]
        label = "" if debug == 0 else f" (debug {debug})"
        print(f"phase trace M={m} plan {tag}{label}: us after the previous phase completed, median / last CTA")
        print(f"{'phase':<10}" + "".join(f"{name:>13}" for name in MOMENTS[1:]) + f"{'completed':>11}")
        for phase, name in enumerate(PHASES):
            median, last, done = [], [], []
            for layer in range(1, LAYERS):
                q = 4 * layer + phase
                r = rec[layer, phase]
                rel = (r[:, 1:] - completed[q]) / 1000.0
                recorded = (r[:, 0] & 1) == 1
                finisher = (r[:, 0] & 2) == 2
                med_row, last_row = [], []
                for k in range(len(MOMENTS)):
                    sel = rel[finisher if k >= FIRST_FINISHER_MOMENT else recorded, k]
                    med_row.append(float(np.median(sel)))
                    last_row.append(float(sel.max()))
                median.append(med_row)
                last.append(last_row)
                done.append((completed[q + 1] - completed[q]) / 1000.0)
            median_mean = np.mean(median, axis=0)
            last_mean = np.mean(last, axis=0)
            print(f"{name:<10}" + "".join(f"{a:>6.2f}/{b:<6.2f}" for a, b in zip(median_mean[1:], last_mean[1:]))
                  + f"{statistics.mean(done):>11.2f}")
            record("persistent phase trace", m, f"phase{phase}_{name}_us", statistics.mean(done), "us",
                   variant=tag, debug=debug, first_layer=round(steps[phase], 2),
                   median_cta={k: round(float(v), 3) for k, v in zip(MOMENTS, median_mean)},
                   last_cta={k: round(float(v), 3) for k, v in zip(MOMENTS, last_mean)})
        record("persistent phase trace", m, "traced_total_us", (completed[4 * LAYERS] - completed[0]) / 1000.0,
               "us", variant=tag, debug=debug)

    failures = 0
    for m in args.rows:
        ctx = torch.randn(m, D, device="cuda").bfloat16()
        h = torch.randn(m, D, device="cuda")
        h_out = torch.empty(m, D, device="cuda")
        qkv = torch.empty(m, QKV, device="cuda", dtype=torch.bfloat16)
        for plan_index, plan_text in enumerate(args.plans):
            tiles, splits = ([int(v) for v in part.split(",")] for part in plan_text.split("/"))
            plan8 = (ctypes.c_int * 8)(*tiles, *splits)
            tag = plan_text
            ws = torch.zeros(lib.omnigraph_persistent_workspace_bytes(m, plan8), dtype=torch.uint8, device="cuda")

            def launch(layers: int, first: int = 0, plan8=plan8, ws=ws, ctx=ctx, h=h, h_out=h_out, qkv=qkv, m=m,
                       trace=None, debug=0):
                table = ctypes.c_void_p(ctypes.addressof(pointer_table) + 8 * 6 * first)
                err = lib.omnigraph_persistent_launch(m, layers, plan8, 1e-5, ctx.data_ptr(), h.data_ptr(),
                                                      h_out.data_ptr(), qkv.data_ptr(), table, ws.data_ptr(),
                                                      torch.cuda.current_stream().cuda_stream, 0,
                                                      None if trace is None else trace.data_ptr(), debug)
                if err:
                    raise RuntimeError(f"launch failed: {lib.omnigraph_persistent_error(err).decode()}")

            # numerics: one layer (two fresh draws, twice each: the kernel must leave its state reset),
            # then the 28-layer chain (stand-in attention)
            ok = True
            try:
                for trial in range(2):
                    ctx.copy_(torch.randn(m, D, device="cuda").bfloat16())
                    h.copy_(torch.randn(m, D, device="cuda"))
                    ref_out, ref_qkv = ref_layer(ctx, h, trial)
                    for rep in range(2):
                        h_out.fill_(float("nan"))
                        qkv.fill_(float("nan"))
                        launch(1, first=trial)
                        sync()
                        finite = bool(torch.isfinite(h_out).all() and torch.isfinite(qkv).all())
                        er, eq = rel(h_out, ref_out), rel(qkv, ref_qkv)
                        ok &= finite and er < REL_LIMIT_X1["resid"] and eq < REL_LIMIT_X1["qkv"]
                        if rep == 0:
                            record("persistent x1 numerics", m, f"rel_err_resid_t{trial}", er, "ratio", variant=tag,
                                   all_written=finite)
                            record("persistent x1 numerics", m, f"rel_err_qkv_t{trial}", eq, "ratio", variant=tag)
                h_out.fill_(float("nan"))
                qkv.fill_(float("nan"))
                launch(LAYERS)
                sync()
                c, r = ctx, h
                for layer in range(LAYERS):
                    r, q = ref_layer(c, r, layer)
                    c = q.bfloat16()[:, :D].contiguous()
                finite = bool(torch.isfinite(h_out).all() and torch.isfinite(qkv).all())
                er, eq = rel(h_out, r), rel(qkv, q)
                ok &= finite and er < REL_LIMIT_28["resid"] and eq < REL_LIMIT_28["qkv"]
                record("persistent 1 launch numerics", m, "rel_err_resid_28", er, "ratio", variant=tag,
                       all_written=finite)
                record("persistent 1 launch numerics", m, "rel_err_qkv_28", eq, "ratio", variant=tag)
            except RuntimeError as exc:
                print(f"plan {tag} at M={m}: {exc}", flush=True)
                ok = False
            record("persistent numerics verdict", m, "passed", float(ok), "bool", variant=tag)
            if not ok:
                failures += 1
                print(f"NUMERICS FAILED for plan {tag} at M={m}: not timed", flush=True)
                continue

            # where the time goes: when each (layer, phase) completed and each task's moments, from
            # %globaltimer; with --experiments also for the skeleton (debug 3: no A loads, no mma)
            for debug in (0, 3) if args.experiments and plan_index == 0 else (0,):
                trace = torch.zeros(1 + 4 * LAYERS * (1 + sm_count * TRACE_FIELDS), dtype=torch.int64,
                                    device="cuda")
                launch(LAYERS, trace=trace, debug=debug)
                sync()
                phase_trace(m, tag, debug, trace.cpu().numpy())

            def chain28(launch=launch):
                for layer in range(LAYERS):
                    launch(1, first=layer)

            for case, run in (("persistent x28 (1 layer/launch)", chain28),
                              ("persistent 1 launch (28 layers)", lambda launch=launch: launch(LAYERS))):
                us = timed_graph_us(run)
                record(case, m, "forward_us", us, "us", variant=tag)
                tbs = WEIGHT_BYTES_PER_LAYER * LAYERS / (us * 1e-6) / 1e12
                record(case, m, "weight_stream", tbs, "TB/s", variant=tag, fraction_of_copy=round(tbs / copy_tbs, 3),
                       fraction_of_4p8=round(tbs / 4.8, 3))

            if args.experiments and plan_index == 0:
                for flags, what in ((1, "no A loads"), (2, "no mma"), (3, "no A loads, no mma")):
                    us = timed_graph_us(lambda launch=launch, flags=flags: launch(LAYERS, debug=flags), repeats=3)
                    record(f"experiment 1 launch, {what}", m, "forward_us", us, "us", variant=tag)

        # today's path: cuBLAS GEMMs, and the layer tail as separate kernels
        a_in = {D: ctx, F: torch.randn(m, F, device="cuda").bfloat16()}

        def gemms(a_in=a_in):
            for w in weights:
                fn.linear(a_in[D], w["wqkv"])
                fn.linear(a_in[D], w["wo"])
                fn.linear(a_in[D], w["wi"])
                fn.linear(a_in[F], w["wo_mlp"])

        def tail(h=h, ctx=ctx):
            for layer, w in enumerate(weights):
                h1 = h + fn.linear(ctx, w["wo"]).float()
                x = fn.layer_norm(h1, (D,), weight=norms[layer]["mlp"], eps=1e-5).bfloat16()
                u = fn.linear(x, w["wi"])
                g = fn.gelu(u[:, :F]) * u[:, F:]
                out = h1 + fn.linear(g, w["wo_mlp"]).float()
                y = fn.layer_norm(out, (D,), weight=norms[layer]["attn"], eps=1e-5).bfloat16()
                fn.linear(y, w["wqkv"])

        for case, run in (("cublas gemms (112)", gemms), ("torch layer tail (28 layers)", tail)):
            us = timed_graph_us(run)
            record(case, m, "forward_us", us, "us")
            tbs = WEIGHT_BYTES_PER_LAYER * LAYERS / (us * 1e-6) / 1e12
            record(case, m, "weight_stream", tbs, "TB/s", fraction_of_copy=round(tbs / copy_tbs, 3),
                   fraction_of_4p8=round(tbs / 4.8, 3))

    copy_bandwidth("last")
    print(f"\n{'case':<34} {'rows':>5} {'plan':>24} {'forward us':>11} {'TB/s':>7} {'of copy':>8} {'/cuBLAS':>8}")
    for row in rows_out:
        if row["metric"] == "weight_stream":
            us = next(r["value"] for r in rows_out if r["case"] == row["case"] and r["rows"] == row["rows"]
                      and r["metric"] == "forward_us" and r.get("variant") == row.get("variant"))
            cublas = next(r["value"] for r in rows_out if r["case"] == "cublas gemms (112)" and r["rows"] == row["rows"]
                          and r["metric"] == "forward_us")
            print(f"{row['case']:<34} {row['rows']:>5} {row.get('variant', '-'):>24} {us:>11.1f} {row['value']:>7.2f}"
                  f" {row['fraction_of_copy']:>8.3f} {us / cublas:>8.2f}")
    print(f"{identity['gpu']}, torch {identity['torch']}, CUDA {identity['cuda']}, {identity['date']}, "
          f"kernel {args.kernel} ({args.lib})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows_out, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
