"""The `omnigraph` command as a user meets it: help with defaults, --version, --debug anywhere,
and arguments that cannot be served refused in one line before the port is bound."""

import socket
import subprocess
import sys

import pytest

from omnigraph import __version__
from omnigraph.plugin.cli import build_parser


def _omnigraph(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnigraph.plugin.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_version_and_help_with_every_default():
    assert _omnigraph("--version").stdout.strip() == f"omnigraph {__version__}"
    help_text = _omnigraph("serve", "--help").stdout
    assert "(default: 127.0.0.1)" in help_text and "(default: 8000)" in help_text
    assert "--debug" in help_text


@pytest.mark.parametrize("argv", [["--debug", "serve"], ["serve", "--debug"]])
def test_debug_is_taken_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).debug is True
    assert build_parser().parse_args(["serve"]).debug is False


@pytest.mark.parametrize("args, argument, reason", [
    (["nope"], "model 'nope'", "unknown pipeline 'nope'"),
    (["--bundle", "/no/such/bundle"], "--bundle /no/such/bundle", "/no/such/bundle"),
    (["--deploy-config", "/no/such/plan.yaml"], "--deploy-config /no/such/plan.yaml", "cannot read deploy YAML"),
])
def test_an_argument_that_cannot_be_served_is_one_line_naming_it_and_binds_nothing(args, argument, reason):
    port = _free_port()
    result = _omnigraph("serve", *args, "--port", str(port), timeout=60)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"omnigraph: error: ServerStartupError: {argument}: ") and reason in line
    assert "stages[0]" not in line


def test_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = _omnigraph("serve", "laya", "--port", str(port), timeout=60)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line == f"omnigraph: error: ServerStartupError: --port {port}: 127.0.0.1:{port} is already in use"


def test_synth_refuses_a_size_the_model_does_not_have_with_its_list(tmp_path):
    result = _omnigraph("bundle", "synth", "open_jev", "--size", "full", "--out", str(tmp_path / "ck"))
    assert result.returncode == 1
    assert "unknown Open-Jev checkpoint size 'full'; choose one of tiny" in result.stderr
    assert not (tmp_path / "ck").exists()


def test_bundle_build_shows_its_phases_and_verify_its_answer(tmp_path):
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    built = _omnigraph("bundle", "build", "laya", "--checkpoint", str(cached_checkpoint("tiny")),
                       "--out", str(tmp_path / "bundle"), timeout=600)
    assert built.returncode == 0, built.stderr
    phases = ["building a fp32 Laya bundle from", "checkpoint read and checked", "exporting the ONNX graph",
              "graph exported", "checking it against the checkpoint's own forward"]
    assert all(phase in built.stderr for phase in phases), built.stderr
    verified = _omnigraph("bundle", "verify", str(tmp_path / "bundle"))
    assert verified.returncode == 0 and verified.stdout.startswith("ok ")


def test_bundle_verify_shows_a_bar_while_a_big_file_is_hashed_unless_quiet(tmp_path, monkeypatch, capsys):
    import omnigraph.bundles.hashing as hashing
    from omnigraph.bundles import pack_bundle
    from omnigraph.plugin.cli import main

    (tmp_path / "graph.onnx").write_bytes(_tiny_graph())
    pack_bundle(tmp_path, component="test.identity")
    monkeypatch.setattr(hashing, "PROGRESS_MIN_BYTES", 10)
    assert main(["bundle", "verify", str(tmp_path)]) == 0
    assert "hashing graph.onnx: 100%" in capsys.readouterr().err
    assert main(["bundle", "verify", "--quiet", str(tmp_path)]) == 0
    assert "hashing" not in capsys.readouterr().err


def _tiny_graph() -> bytes:
    import onnx
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    result = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [value], [result])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
