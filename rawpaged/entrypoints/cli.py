"""The command line: ``rawpaged serve [options]`` (also ``python server.py [options]``) and
``rawpaged generate --prompt ...``.

Engine options are built from ``EngineConfig``'s fields: one ``--flag`` per field, its type, choices
and default from the annotation, its help from the field's docstring, so a new engine option needs no
CLI code.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
import logging
import re
import sys
import textwrap
import typing
from pathlib import Path

from rawpaged.config import EngineConfig, SpeculativeConfig
from rawpaged.engine.data_parallel import init_ray, shutdown_ray
from rawpaged.engine.outputs import DeltaTracker
from rawpaged.entrypoints.server.config import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_TOKENS_LIMIT, ServerConfig
from rawpaged.entrypoints.server.lora_registry import parse_lora_module
from rawpaged.entrypoints.server.startup import load_engine
from rawpaged.errors import import_optional
from rawpaged.pooling_params import PoolerConfig
from rawpaged.sampling_params import SamplingParams
from rawpaged.weights import MODEL_NAMES
from rawpaged.weights.hub import is_repo_id

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5GB', '4M' (single letters are binary), '1000000'."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB, 1000000)")
    num, unit, i, b = m.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1000 if (unit and b and not i) else 1024
    value = int(float(num) * base**power)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _pooler_config(text: str):
    """``--pooler-config``'s JSON object, checked as ``PoolerConfig`` (an error names the key)."""
    try:
        return PoolerConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str):
    """``--speculative-config``'s JSON object, checked as ``SpeculativeConfig`` (an error names the key)."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None or empty (those options describe their default in words) and where the
    help already gives one."""

    def _get_help_string(self, action):
        if action.default in (None, argparse.SUPPRESS, ()) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# ------------------------------------------------------------------------------------------ engine options
def field_docs(cls) -> dict:
    """``{field: docstring}`` from the string literal that follows each annotated field of ``cls`` (empty
    where the source is not installed)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


#: Other spellings of a field's option (vLLM's older names).
_ALIASES = {"kv_offloading_size": ("--swap-space",)}
#: Command-line parsing that differs from the field's type: (type, metavar).
_ARG_TYPES = {
    "kv_cache_memory": (parse_size, "SIZE"),
    "kv_offloading_size": (float, "GIB"),
    "num_kv_blocks": (_positive_int, None),
    "speculative_config": (_speculative_config, "JSON"),
    "pooler_config": (_pooler_config, "JSON"),
    "max_prefill_tokens_while_decoding": (_positive_int, None),
}


def add_config_args(parser: argparse.ArgumentParser, cls, title: str, exclude=(), exclusive=(), arg_types=None) -> None:
    """One option per field of the dataclass ``cls`` but ``exclude``, in a group named ``title``, its help
    the field's docstring: a bool is ``--x/--no-x``, a Literal gives choices, a tuple takes one or more
    values; ``exclusive`` fields are mutually exclusive; ``arg_types`` maps a field to ``(type, metavar)``
    where the command line parses differently from the field's type."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    arg_types = arg_types or {}
    group = parser.add_argument_group(title)
    pool = group.add_mutually_exclusive_group() if exclusive else None
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        target = pool if f.name in exclusive else group
        hint = hints[f.name]
        kw = dict(default=f.default, help=docs.get(f.name, ""))
        if hint is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            if f.name == "enable_prefix_caching":
                target.add_argument(
                    "--no-prefix-caching",
                    dest=f.name,
                    action="store_false",
                    default=argparse.SUPPRESS,
                    help="same as --no-enable-prefix-caching",
                )
            continue
        literal = [a for a in (hint, *typing.get_args(hint)) if typing.get_origin(a) is typing.Literal]
        if literal:  # a Literal, or an optional one
            kw["choices"] = typing.get_args(literal[0])
        elif hint is tuple or typing.get_origin(hint) is tuple:
            kw["nargs"], kw["metavar"] = "+", f.name.upper().removesuffix("S")
        else:
            base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kw["type"], metavar = arg_types.get(f.name, (base[0], None))
            if metavar:
                kw["metavar"] = metavar
        target.add_argument(flag, *_ALIASES.get(f.name, ()), **kw)


def add_engine_args(parser: argparse.ArgumentParser, exclude=()) -> None:
    """One option per ``EngineConfig`` field but ``exclude`` (``--num-kv-blocks`` and
    ``--kv-cache-memory`` exclusive); ``--no-prefix-caching`` is kept as a short form of
    ``--no-enable-prefix-caching``."""
    add_config_args(
        parser,
        EngineConfig,
        "engine options",
        exclude=exclude,
        exclusive=("num_kv_blocks", "kv_cache_memory"),
        arg_types=_ARG_TYPES,
    )


def config_from_args(cls, args: argparse.Namespace):
    """``cls`` (a dataclass) from parsed options; fields without an option keep their default. Raises
    ValueError naming the field for an invalid value."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """``EngineConfig`` from parsed options (fields without an option keep their default). Raises
    ValueError naming the field for an invalid value."""
    return config_from_args(EngineConfig, args)


def _check_model_arg(model: str | None, quantization: str | None = None) -> str | None:
    """An error line for a ``--model`` that is neither a directory, a .gguf file nor a prepared model's
    name (``MODEL_NAMES``), or a ``--quantization`` that does not fit it (caught before the server binds its port)."""
    path = Path(model).expanduser() if model is not None else None
    is_gguf = path is not None and (path.suffix == ".gguf" or (is_repo_id(model) and ":" in model))
    if path is not None and not path.is_dir() and model not in MODEL_NAMES and not is_repo_id(model):
        if is_gguf and not path.exists():
            return f"error: --model {model!r} does not exist"
        if not (path.is_file() and is_gguf):
            return f"error: --model {model!r} is neither a directory nor a .gguf file"
    if quantization == "gguf" and not is_gguf:
        return "error: --quantization gguf keeps a .gguf file's formats; --model is not a .gguf file"
    if quantization == "q8_0" and is_gguf:
        return "error: --quantization q8_0 quantizes safetensors checkpoints; --model is a .gguf file"
    return None


# ------------------------------------------------------------------------------------------ logging
def add_log_level_arg(parser: argparse.ArgumentParser, what_info_shows: str, default: str = "info") -> None:
    """``--log-level {debug,info,warning,error}`` (``warning`` hides the start-up phases), its help saying
    ``what_info_shows``."""
    parser.add_argument(
        "--log-level",
        default=default,
        choices=("debug", "info", "warning", "error"),
        help=f"logging level, on stderr ({what_info_shows})",
    )


def configure_logging(level: str) -> None:
    """Log records of ``level`` and above to stderr, each line with its time, level and logger."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# ------------------------------------------------------------------------------------------ serve
def parse_model_args(parser: argparse.ArgumentParser, argv: list | None) -> argparse.Namespace:
    """``parser``'s arguments, the positional model (``add_model_name_args``) moved to ``args.model``; a
    model given both ways differently is a usage error."""
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model not in (None, args.model_tag):
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return args


def has_pydantic(what: str) -> bool:
    """Whether pydantic imports; without it one ``error:`` line naming ``what`` needs it goes to stderr."""
    try:
        import_optional("pydantic", what)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    return True


def add_model_name_args(p: argparse.ArgumentParser) -> None:
    """The model (positional, as ``vllm serve`` takes it) and the names it is served as."""
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vllm serve takes it: a directory, a .gguf file or a Hub id (same as --model)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may send as 'model'; the first is the one reported (default: the model's name)",
    )


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """Where the server listens and what it lets in: host, port, key, sizes and origins."""
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind; use 0.0.0.0 to accept connections from other machines"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') on every route except /health, "
        "/metrics and the playground page (/ and /static/)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS_LIMIT,
        help="largest max_tokens a request may ask for (larger: HTTP 400); also the chat default (default: "
        "no cap beyond the context, as vLLM)",
    )
    p.add_argument(
        "--max-body-size",
        type=parse_size,
        default=DEFAULT_MAX_BODY_SIZE,
        metavar="SIZE",
        help="largest request body or websocket message, e.g. 4MiB (larger: HTTP 413)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="origins browsers may call the API from (e.g. https://example.com, or * for any); default: none",
    )


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    """Engine replicas as Ray actors, and the Ray cluster they join."""
    p.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=1,
        help="engine replicas, each a Ray actor (one GPU each on CUDA); requests are routed by prompt prefix "
        "and load (docs/distributed.md)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --data-parallel-size > 1: a running Ray cluster to join (e.g. 10.0.0.1:6379, from "
        "'ray start --head'); default: start a local Ray instance",
    )


def _lora_module(text: str):
    """One ``--lora-modules`` value (``name=path`` or JSON), checked (an error names the entry)."""
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA adapters served (vLLM's ``--lora-modules``) and whether they may change at run time; the
    engine's ``--enable-lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` are engine options."""
    group = p.add_argument_group("LoRA adapters (docs/lora.md; with --enable-lora)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=(),
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served from the start, each picked by a request's model: "
        'name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...} (vLLM\'s forms)',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="switch on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; vLLM switches "
        "them on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); off, they answer 404",
    )


def _add_server_config_args(p: argparse.ArgumentParser) -> None:
    """``ServerConfig``'s timeouts and limits, one flag per field."""
    seconds = (float, "SECONDS")
    add_config_args(
        p,
        ServerConfig,
        "timeouts and limits (docs/server.md)",
        arg_types={
            "max_connections": (_positive_int, "N"),
            "max_queued_requests": (int, "N"),
            **dict.fromkeys(
                ("timeout_keep_alive", "timeout_body", "ws_ping_interval", "ws_idle_timeout", "shutdown_timeout"),
                seconds,
            ),
        },
    )


def build_serve_parser(prog: str = "rawpaged serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=HelpFormatter,
        description="Serve a model with an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/models, vLLM's /tokenize, /detokenize, /tokenizer_info), websocket streaming "
        "(/v1/ws), /health and Prometheus /metrics.",
    )
    add_model_name_args(p)
    _add_http_args(p)
    add_log_level_arg(p, "info: one line per request")
    _add_data_parallel_args(p)
    _add_server_config_args(p)
    _add_lora_args(p)
    add_engine_args(p)
    return p


def serve_main(argv: list | None = None, prog: str = "rawpaged serve") -> int:
    """``rawpaged serve``: exit code 0 after Ctrl-C/SIGTERM, 1 for a bad option, port or model, or a
    missing library the server needs (pydantic)."""
    if not has_pydantic("the HTTP server (its OpenAI request models)"):
        return 1
    from rawpaged.entrypoints.api_server import create_app  # deferred: pydantic, checked just above
    from rawpaged.entrypoints.launcher import serve  # deferred: pydantic, checked just above

    args = parse_model_args(build_serve_parser(prog), argv)
    configure_logging(args.log_level)
    try:
        config = engine_config_from_args(args)
        server_config = config_from_args(ServerConfig, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    error = _check_model_arg(config.model, config.quantization)
    if error:
        print(error, file=sys.stderr)
        return 1
    try:
        app = create_app(
            config,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_tokens_limit=args.max_tokens_limit,
            max_body_size=args.max_body_size,
            allowed_origins=args.allowed_origins,
            data_parallel_size=args.data_parallel_size,
            ray_address=args.ray_address,
            server_config=server_config,
            lora_modules=args.lora_modules,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
    except ValueError as e:  # --lora-modules without --enable-lora, a name given twice
        print(f"error: {e}", file=sys.stderr)
        return 1
    started_ray = False
    if args.ray_address and args.data_parallel_size == 1:
        print("error: --ray-address needs --data-parallel-size 2 or more", file=sys.stderr)
        return 1
    if args.data_parallel_size > 1:  # on the main thread, before the server (data_parallel.init_ray)
        try:
            started_ray = init_ray(args.ray_address, args.data_parallel_size)
        except (ValueError, ConnectionError) as e:  # MissingDependencyError without Ray
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        return asyncio.run(serve(app, args.host, args.port))
    except KeyboardInterrupt:
        return 130
    finally:
        if started_ray:
            shutdown_ray()


# ------------------------------------------------------------------------------------------ generate
def build_generate_parser(prog: str = "rawpaged generate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter, description="Generate from one prompt and stream the text to stdout."
    )
    p.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (the default here; the HTTP API's default is 1.0, as OpenAI's)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the probability mass kept")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    p.add_argument("--seed", type=int, default=None, help="the request's sampling seed")
    add_log_level_arg(p, "info: each start-up phase with its time; stdout carries only the text")
    add_engine_args(p, exclude=("seed",))
    return p


def generate_main(argv: list | None = None, prog: str = "rawpaged generate") -> int:
    """``rawpaged generate``: prints the text as it is generated, and nothing else, to stdout; the start-up
    phases (``startup.load_engine``) and other log lines go to stderr; exit code 1 with one ``error:``
    line."""
    args = build_generate_parser(prog).parse_args(argv)
    configure_logging(args.log_level)
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
        )
        config = engine_config_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "seed"}))
        engine = load_engine(config)
        prompt = args.prompt
        if args.chat:
            text, ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            prompt = {"prompt_token_ids": ids, "prompt": text}
        engine.add_request(prompt, params)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tracker = DeltaTracker()
    while engine.has_unfinished_requests():
        for out in engine.step():
            for delta in tracker.deltas(out):
                print(delta.text, end="", flush=True)
    print()
    return 0


# ------------------------------------------------------------------------------------------ run-batch
def build_run_batch_parser(prog: str = "rawpaged run-batch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=HelpFormatter,
        description="Run an OpenAI Batch API file (JSONL of custom_id/method/url/body) through the server's "
        "routes and write OpenAI's output lines.",
    )
    p.add_argument("-i", "--input-file", type=Path, required=True, help="the requests, one JSON object a line")
    p.add_argument("-o", "--output-file", type=Path, required=True, help="the results, written as lines finish")
    p.add_argument("--resume", action="store_true", help="append, skipping custom_ids already in the output")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="lines in flight at once (default: twice the engine's max_num_seqs, so its batch stays full)",
    )
    add_model_name_args(p)
    add_log_level_arg(p, "info: the start-up phases, a line per request; warning: the bar alone", "warning")
    add_engine_args(p)
    return p


def run_batch_main(argv: list | None = None, prog: str = "rawpaged run-batch") -> int:
    """``rawpaged run-batch`` (``openai.batch.run_batch``): exit code 0 when every line was written (bad
    lines included, as error lines), 1 for a bad option, input file or model, or without pydantic."""
    if not has_pydantic("run-batch (the server's OpenAI request models)"):
        return 1
    from rawpaged.entrypoints.api_server import create_app  # deferred: pydantic, checked just above
    from rawpaged.entrypoints.openai.batch.run_batch import run_batch  # deferred: pydantic, checked just above

    args = parse_model_args(build_run_batch_parser(prog), argv)
    configure_logging(args.log_level)
    try:
        config = engine_config_from_args(args)
        if not args.input_file.is_file():
            raise ValueError(f"input file {args.input_file} does not exist")
        engine = load_engine(config)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    app = create_app(config, engine=engine, served_model_name=args.served_model_name)
    concurrency = args.max_concurrency or 2 * engine.config.max_num_seqs
    try:
        run = run_batch(app, args.input_file, args.output_file, resume=args.resume, max_concurrency=concurrency)
        s = asyncio.run(run)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"run-batch: {s.written} lines written to {args.output_file} ({s.succeeded} succeeded, "
        f"{s.written - s.succeeded} failed, {s.skipped} skipped as done), {s.tokens} tokens in {s.seconds:.1f}s "
        f"({s.tokens / max(s.seconds, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


# ------------------------------------------------------------------------------------------ rawpaged
def main(argv: list | None = None) -> int:
    """``rawpaged serve|generate|run-batch [options]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"serve": serve_main, "generate": generate_main, "run-batch": run_batch_main}
    if not argv or argv[0] not in commands:
        print(
            "usage: rawpaged {serve,generate,run-batch} [options]   (rawpaged <command> --help for its options)",
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:], prog=f"rawpaged {argv[0]}")
