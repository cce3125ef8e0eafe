"""The `omnigraph` command: one entry point, one subcommand per job.

Each subcommand is a thin adapter over a public function of the room that owns the work; the
adapters import lazily so `omnigraph --help` stays fast and a missing optional dependency only
affects the subcommand that needs it. Errors are one line on stderr (exit 1) unless `--debug`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _bundle_pack(args: argparse.Namespace) -> int:
    from omnigraph.bundles import pack_bundle

    bundle = pack_bundle(
        Path(args.directory),
        component=args.component,
        graph_file=args.graph,
        example_inputs_file=args.example_inputs,
        progress=not args.quiet,
    )
    print(f"packed {bundle.manifest_path} (sha256 {bundle.manifest_sha256})")
    return 0


def _bundle_verify(args: argparse.Namespace) -> int:
    from omnigraph.bundles import verify_bundle

    bundle = verify_bundle(Path(args.directory))
    print(f"ok {bundle.manifest_path} ({len(bundle.manifest.files)} files, sha256 {bundle.manifest_sha256})")
    return 0


def _bundle_inspect(args: argparse.Namespace) -> int:
    from omnigraph.bundles import format_inspection, inspect_bundle

    report = inspect_bundle(Path(args.directory))
    print(json.dumps(report, indent=2) if args.json else format_inspection(report))
    return 0


def _bundle_build(args: argparse.Namespace) -> int:
    from omnigraph.pipelines.registry import get_pipeline, resolve_dotted

    builder = get_pipeline(args.model).bundle_builder
    if builder is None:
        raise ValueError(f"pipeline {args.model!r} declares no bundle_builder")
    build = resolve_dotted(builder)
    bundle = build(Path(args.checkpoint), Path(args.out), precision=args.precision, fast=args.fast)
    print(f"built {bundle.manifest_path} (sha256 {bundle.manifest_sha256})")
    return 0


def _bundle_synth(args: argparse.Namespace) -> int:
    from omnigraph.pipelines.registry import get_pipeline, resolve_dotted

    synthesizer = get_pipeline(args.model).checkpoint_synthesizer
    if synthesizer is None:
        raise ValueError(f"pipeline {args.model!r} declares no checkpoint_synthesizer")
    synthesize = resolve_dotted(synthesizer)
    out = synthesize(args.size, seed=args.seed, out=Path(args.out))
    print(f"synthesised {args.model} checkpoint ({args.size}, seed {args.seed}) at {out}")
    return 0


def _ops_build(args: argparse.Namespace) -> int:
    from omnigraph.workers.ops.build import build_library

    built = build_library(Path(args.out), arch=args.arch)
    print(f"built {built.library_path} (sha256 {built.library_sha256})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from omnigraph.plugin.server import serve

    serve(args.model, bundle=args.bundle, deploy_config=args.deploy_config, host=args.host, port=args.port)
    return 0


def _deploy_check(args: argparse.Namespace) -> int:
    from omnigraph.pipelines.deploy_check import check_deploy_plan

    report = check_deploy_plan(Path(args.plan), verify_bundles=not args.skip_hashes)
    print(report.format())
    if report.ok:
        return 0
    count = len(report.problems)
    print(f"omnigraph: error: {args.plan}: {count} problem{'s' * (count != 1)}; nothing was served", file=sys.stderr)
    return 1


def _conformance_run(args: argparse.Namespace) -> int:
    from omnigraph.conformance.runner import run_suite_cli

    return run_suite_cli(suite=args.suite, target=args.target, group=args.group, report=args.report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnigraph", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve a pipeline over HTTP")
    serve.add_argument("model", nargs="?", default=None, help="pipeline name (default: the embedded demo Laya)")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--bundle", help="bundle directory or manifest.json")
    source.add_argument("--deploy-config", help="deploy YAML")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(handler=_serve)

    bundle = commands.add_parser("bundle", help="pack, verify, inspect, build or synthesise bundles")
    bundle_commands = bundle.add_subparsers(dest="bundle_command", required=True, metavar="ACTION")
    pack = bundle_commands.add_parser("pack", help="write DIR/manifest.json over the files in DIR")
    pack.add_argument("directory")
    pack.add_argument("--component", required=True, help="what the bundle is, e.g. laya.decision")
    pack.add_argument("--graph", default="graph.onnx", help="the ONNX graph, relative to DIR")
    pack.add_argument("--example-inputs", default=None, help="warmup inputs (.npz), relative to DIR")
    pack.add_argument("--quiet", action="store_true", help="no progress bar")
    pack.set_defaults(handler=_bundle_pack)
    verify = bundle_commands.add_parser("verify", help="check every hash and path of a bundle")
    verify.add_argument("directory")
    verify.set_defaults(handler=_bundle_verify)
    inspect = bundle_commands.add_parser("inspect", help="inputs, outputs, opset, size, custom ops")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_bundle_inspect)
    build = bundle_commands.add_parser("build", help="export a model checkpoint to a verified bundle")
    build.add_argument("model", help="pipeline name, e.g. laya")
    build.add_argument("--checkpoint", required=True)
    build.add_argument("--out", required=True)
    build.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32")
    build.add_argument("--fast", action="store_true", help="use the omnigraph custom-op library (BF16)")
    build.set_defaults(handler=_bundle_build)
    synth = bundle_commands.add_parser("synth", help="write a synthetic checkpoint in the model's real format")
    synth.add_argument("model", help="pipeline name, e.g. laya")
    synth.add_argument("--size", choices=("tiny", "small", "full"), default="tiny")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", required=True)
    synth.set_defaults(handler=_bundle_synth)

    ops = commands.add_parser("ops", help="the CUDA custom-op library")
    ops_commands = ops.add_subparsers(dest="ops_command", required=True, metavar="ACTION")
    ops_build = ops_commands.add_parser("build", help="compile the custom-op library with nvcc")
    ops_build.add_argument("--arch", default="90a", help="compute capability, e.g. 90a")
    ops_build.add_argument("--out", default="build/ops", help="output folder")
    ops_build.set_defaults(handler=_ops_build)

    deploy = commands.add_parser("deploy", help="deploy plans (deploy YAML)")
    deploy_commands = deploy.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    deploy_check = deploy_commands.add_parser(
        "check", help="check a deploy YAML completely without serving it: every problem, one line each with its "
        "YAML path and a hint (exit 1), or a summary (exit 0)")
    deploy_check.add_argument("plan", help="the deploy YAML")
    deploy_check.add_argument("--skip-hashes", action="store_true",
                              help="read each bundle's manifest and file list without hashing its files")
    deploy_check.set_defaults(handler=_deploy_check)

    conformance = commands.add_parser("conformance", help="conformance fixtures")
    conformance_commands = conformance.add_subparsers(dest="conformance_command", required=True, metavar="ACTION")
    run = conformance_commands.add_parser("run", help="check a target against a fixture suite")
    run.add_argument("--suite", default="v1")
    run.add_argument("--target", required=True, help="inproc | worker:'<command>' | http://HOST:PORT")
    run.add_argument("--group", default=None)
    run.add_argument("--report", default=None, help="write the full report as JSON here")
    run.set_defaults(handler=_conformance_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one clear line; the traceback only when asked for
        if args.debug:
            raise
        print(f"omnigraph: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
