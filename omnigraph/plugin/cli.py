"""The `omnigraph` command: one entry point, one subcommand per job.

Each subcommand is a thin adapter over a public function of the room that owns the work; the
adapters import lazily so `omnigraph --help` stays fast and a missing optional dependency only
affects the subcommand that needs it. Errors are one line on stderr (exit 1) unless `--debug`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omnigraph.plugin.logs import LOG_FORMAT


def _hashing_bar(path: Path, size: int) -> Any:
    """A tqdm bar on stderr for one big file being hashed (bundles/hashing.py's ProgressFactory)."""
    from tqdm import tqdm

    return tqdm(total=size, desc=f"hashing {path.name}", unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, mininterval=0.25)


def _bundle_pack(args: argparse.Namespace) -> int:
    from omnigraph.bundles import pack_bundle

    bundle = pack_bundle(
        Path(args.directory),
        component=args.component,
        graph_file=args.graph,
        example_inputs_file=args.example_inputs,
        progress=None if args.quiet else _hashing_bar,
    )
    print(f"packed {bundle.manifest_path} (sha256 {bundle.manifest_sha256})")
    return 0


def _bundle_verify(args: argparse.Namespace) -> int:
    from omnigraph.bundles import verify_bundle

    bundle = verify_bundle(Path(args.directory), progress=None if args.quiet else _hashing_bar)
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

    serve(args.model, bundle=args.bundle, deploy_config=args.deploy_config, host=args.host, port=args.port,
          api_key=args.api_key,
          served_model_names=args.served_model_name or ())
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

    return run_suite_cli(suite=args.suite, target=args.target, group=args.group, report=args.report,
                         listen_wait_s=args.listen_wait_s)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help shows its default; descriptions keep their lines."""


def _command(commands: argparse._SubParsersAction, name: str, help: str,
             handler: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    """A subcommand with the shared formatter; a leaf (with `handler`) also takes `--debug`, so it
    works after the subcommand as well as before it."""
    command = commands.add_parser(name, help=help, description=help, formatter_class=_Formatter)
    if handler is not None:
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks on errors")
        command.set_defaults(handler=handler)
    return command


def build_parser() -> argparse.ArgumentParser:
    from omnigraph import __version__

    parser = argparse.ArgumentParser(prog="omnigraph", description=__doc__.splitlines()[0], formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"omnigraph {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = _command(commands, "serve", "serve a pipeline over HTTP", _serve)
    serve.add_argument("model", nargs="?", default=None, help="pipeline name (none: the embedded demo Laya)")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--bundle", default=None, help="bundle directory or manifest.json")
    source.add_argument("--deploy-config", default=None, help="deploy YAML")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health, /ready and /metrics "
                            "(none: $OMNIGRAPH_API_KEY if set, else no key)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names clients may send as `model` (aliases, as vLLM's flag); answers carry the first "
                            "(none: the pipeline's name)")

    bundle = _command(commands, "bundle", "pack, verify, inspect, build or synthesise bundles")
    bundle_commands = bundle.add_subparsers(dest="bundle_command", required=True, metavar="ACTION")
    pack = _command(bundle_commands, "pack", "write DIR/manifest.json over the files in DIR", _bundle_pack)
    pack.add_argument("directory", help="the bundle's folder (DIR)")
    pack.add_argument("--component", required=True, help="what the bundle is, e.g. laya.decision")
    pack.add_argument("--graph", default="graph.onnx", help="the ONNX graph, relative to DIR")
    pack.add_argument("--example-inputs", default=None, help="warmup inputs (.npz), relative to DIR")
    pack.add_argument("--quiet", action="store_true", help="no progress bar")
    verify = _command(bundle_commands, "verify", "check every hash and path of a bundle", _bundle_verify)
    verify.add_argument("directory", help="bundle directory or manifest.json")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    inspect = _command(bundle_commands, "inspect", "inputs, outputs, opset, size, custom ops", _bundle_inspect)
    inspect.add_argument("directory", help="bundle directory or manifest.json")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    build = _command(bundle_commands, "build", "export a model checkpoint to a verified bundle", _bundle_build)
    build.add_argument("model", help="pipeline name, e.g. laya")
    build.add_argument("--checkpoint", required=True, help="the checkpoint folder")
    build.add_argument("--out", required=True, help="the bundle folder to write (must not exist)")
    build.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32", help="weights' precision")
    build.add_argument("--fast", action="store_true", help="use the omnigraph custom-op library (BF16)")
    synth = _command(bundle_commands, "synth", "write a synthetic checkpoint in the model's real format",
                     _bundle_synth)
    synth.add_argument("model", help="pipeline name, e.g. laya")
    synth.add_argument("--size", default="tiny",
                       help="a size the model's synthesiser has (laya: tiny, small, full; cua_s1: tiny, small, "
                            "qwen3-4b; open_jev: tiny, qwen3-1.7b); another is refused with the model's list")
    synth.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    synth.add_argument("--out", required=True, help="the checkpoint folder to write")

    ops = _command(commands, "ops", "the CUDA custom-op library")
    ops_commands = ops.add_subparsers(dest="ops_command", required=True, metavar="ACTION")
    ops_build = _command(ops_commands, "build", "compile the custom-op library with nvcc", _ops_build)
    ops_build.add_argument("--arch", default="90a", help="compute capability, e.g. 90a")
    ops_build.add_argument("--out", default="build/ops", help="output folder")

    deploy = _command(commands, "deploy", "deploy plans (deploy YAML)")
    deploy_commands = deploy.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    deploy_check = _command(
        deploy_commands, "check", "check a deploy YAML completely without serving it: every problem, one line each "
        "with its YAML path and a hint (exit 1), or a summary (exit 0)", _deploy_check)
    deploy_check.add_argument("plan", help="the deploy YAML")
    deploy_check.add_argument("--skip-hashes", action="store_true",
                              help="read each bundle's manifest and file list without hashing its files")

    conformance = _command(commands, "conformance", "conformance fixtures")
    conformance_commands = conformance.add_subparsers(dest="conformance_command", required=True, metavar="ACTION")
    run = _command(conformance_commands, "run", "check a target against a fixture suite", _conformance_run)
    run.add_argument("--suite", default="v1", help="the fixture suite")
    run.add_argument("--target", required=True, help="inproc | worker:'<command>' | http://HOST:PORT")
    run.add_argument("--group", default=None, help="one group of the suite (none: every group the target runs)")
    run.add_argument("--report", default=None, help="write the full report as JSON here")
    run.add_argument("--listen-wait-s", type=float, default=0.0,
                     help="http: retry refused connections this long (a server still binding its port); "
                          "0 fails a target where nothing listens at once")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    if args.command == "bundle":  # a build runs a minute or more: its phases go to stderr as they pass
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
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
