"""The command line: ``python server.py`` / ``rawpaged serve`` options built from ``EngineConfig``, a clean
one-line failure without a GPU, sizes, and ``rawpaged generate``."""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rawpaged.config import EngineConfig
from rawpaged.entrypoints import cli as cli_mod

ROOT = Path(__file__).resolve().parents[2]
model = pytest.mark.model
parse_size = cli_mod.parse_size


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(ROOT / "server.py"), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0
    for opt in (
        "--model",
        "--host",
        "--port",
        "--device",
        "--block-size",
        "--num-kv-blocks",
        "--kv-cache-memory",
        "--max-num-seqs",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--no-prefix-caching",
        "--api-key",
        "--max-tokens-limit",
    ):
        assert opt in r.stdout, opt


@model
@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is present")
def test_cli_cuda_without_gpu_fails_cleanly(model_dir):
    r = _cli("--model", str(model_dir), "--device", "cuda", "--port", "0")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cuda" in errors[0].lower(), r.stderr


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4M") == 4 << 20
    assert parse_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        parse_size("0GiB")


def test_every_engine_config_field_is_an_option_with_its_docstring():
    parser = cli_mod.build_serve_parser()
    by_dest = {a.dest: a for a in parser._actions if a.option_strings and a.default != "==SUPPRESS=="}
    docs = cli_mod.field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        action = by_dest[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help == docs[f.name] and len(docs[f.name]) > 10, f.name
        assert action.default == f.default, f.name


def test_every_server_config_field_is_an_option_and_builds_the_config():
    from rawpaged.entrypoints.server.config import ServerConfig

    parser = cli_mod.build_serve_parser()
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    docs = cli_mod.field_docs(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        action = by_dest[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help == docs[f.name] and len(docs[f.name]) > 10, f.name
    args = parser.parse_args(
        ["--timeout-keep-alive", "2.5", "--max-connections", "100", "--allowed-hosts", "A.example", "b.example"]
        + ["--reject-unknown-fields", "--shutdown-timeout", "0"]
    )
    cfg = cli_mod.config_from_args(ServerConfig, args)
    assert cfg == ServerConfig(
        timeout_keep_alive=2.5,
        max_connections=100,
        allowed_hosts=("a.example", "b.example"),
        reject_unknown_fields=True,
        shutdown_timeout=0,
    )
    assert cli_mod.config_from_args(ServerConfig, parser.parse_args([])) == ServerConfig()
    with pytest.raises(ValueError, match="timeout_body"):
        cli_mod.config_from_args(ServerConfig, parser.parse_args(["--timeout-body", "0"]))


def test_options_build_the_engine_config():
    parser = cli_mod.build_serve_parser()
    args = parser.parse_args(
        [
            "--model",
            "/m",
            "--device",
            "cpu",
            "--kv-cache-memory",
            "512MiB",
            "--max-num-seqs",
            "3",
            "--no-prefix-caching",
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    cfg = cli_mod.engine_config_from_args(args)
    assert cfg == EngineConfig(
        model="/m",
        device="cpu",
        kv_cache_memory=512 << 20,
        max_num_seqs=3,
        enable_prefix_caching=False,
        dtype="float32",
        gpu_memory_utilization=0.5,
    )
    assert cli_mod.engine_config_from_args(parser.parse_args([])) == EngineConfig()
    assert not cli_mod.engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])


def test_invalid_engine_option_is_one_error_line():
    r = _cli("--block-size", "3", "--device", "cpu")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        "error: block_size must be a power of two in [1, 128], got 3"
    ]
    r = _cli("--model", "/no/such/dir")
    assert r.returncode == 1 and "is neither a directory nor a .gguf file" in r.stderr
    r = _cli("--model", "/no/such/model.gguf")
    assert r.returncode == 1 and "error: --model '/no/such/model.gguf' does not exist" in r.stderr


def test_quantization_that_does_not_fit_the_model_fails_before_listening(tmp_path, tiny_dir):
    from rawpaged.entrypoints.cli import _check_model_arg

    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert "--model is not a .gguf file" in _check_model_arg(str(tiny_dir), "gguf")
    assert "--model is a .gguf file" in _check_model_arg(str(gguf_file), "q8_0")
    assert _check_model_arg(str(gguf_file), "gguf") is None and _check_model_arg(str(tiny_dir), "q8_0") is None
    r = _cli("--model", str(tiny_dir), "--quantization", "gguf", "--device", "cpu")
    assert r.returncode == 1 and "listening" not in r.stderr and "--quantization gguf" in r.stderr


def test_rawpaged_command_dispatches():
    r = subprocess.run(
        [sys.executable, "-m", "rawpaged", "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: rawpaged serve") and "--max-num-seqs" in r.stdout
    r = subprocess.run([sys.executable, "-m", "rawpaged", "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "serve" in r.stderr


def _generate(model_dir, *args):
    """``rawpaged generate`` on ``model_dir`` (greedy, 6 tokens of "hello", on the CPU) in a subprocess."""
    argv = ["--prompt", "hello", "--max-tokens", "6", "--model", str(model_dir), "--device", "cpu"]
    argv += ["--num-kv-blocks", "16", "--max-model-len", "64", *args]
    return subprocess.run(
        [sys.executable, "-m", "rawpaged", "generate", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.fixture(scope="module")
def greedy_text(tiny_dir):
    """The engine's own greedy 6 tokens of "hello" on the tiny model: what ``_generate`` must print."""
    from rawpaged import LLM, SamplingParams

    llm = LLM(model=str(tiny_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    return llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text


def test_generate_streams_the_engines_text_and_logs_each_start_up_phase_on_stderr(tiny_dir, greedy_text):
    from rawpaged.entrypoints.server.startup import PHASES

    r = _generate(tiny_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text + "\n"  # a script piping stdout gets the text alone
    tag = "INFO rawpaged.startup: "
    lines = [line.split(tag, 1)[1] for line in r.stderr.splitlines() if tag in line]
    assert len(lines) == 2 * len(PHASES), r.stderr
    for i, (phase, what) in enumerate(PHASES.items()):  # each phase's start, then its end with its seconds
        assert lines[2 * i] == f"start-up: {phase} ({what})...", r.stderr
        assert re.fullmatch(rf"start-up: {phase} took \d+\.\ds", lines[2 * i + 1]), r.stderr


def test_generate_log_level_warning_drops_the_phase_lines(tiny_dir, greedy_text):
    r = _generate(tiny_dir, "--log-level", "warning")
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text + "\n"
    assert "start-up" not in r.stderr and " INFO " not in r.stderr, r.stderr


def test_generate_log_level_has_serves_choices_and_default(capsys):
    def log_level(parser):
        return next(a for a in parser._actions if "--log-level" in a.option_strings)

    generate, serve = log_level(cli_mod.build_generate_parser()), log_level(cli_mod.build_serve_parser())
    assert (generate.default, tuple(generate.choices)) == (serve.default, tuple(serve.choices))
    assert (generate.default, tuple(generate.choices)) == ("info", ("debug", "info", "warning", "error"))
    with pytest.raises(SystemExit) as exit_info:
        cli_mod.generate_main(["--prompt", "hi", "--log-level", "loud"])
    assert exit_info.value.code == 2
    assert "argument --log-level: invalid choice: 'loud'" in capsys.readouterr().err


def test_generate_help_documents_every_option():
    parser = cli_mod.build_generate_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 5, action.option_strings
    temperature = next(a for a in parser._actions if "--temperature" in a.option_strings)
    assert temperature.default == 0.0 and "1.0" in temperature.help  # its default beside the API's
    assert "``" not in parser.format_help()  # plain text
