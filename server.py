"""rawpaged's HTTP server: OpenAI-compatible completions and chat (JSON or SSE streaming), a websocket
streaming protocol, health and Prometheus metrics.

    python server.py [--model PATH] [--host 127.0.0.1] [--port 8000] [--device auto|cpu|cuda] ...

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/ws (websocket),
GET /health (503 while the model loads, then 200), GET /metrics, GET /v1/debug/stats.
The protocol is described in README.md ("Server").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import logging
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aiohttp import web

from rawpaged import protocol
from rawpaged.async_engine import AsyncEngine, EngineDeadError
from rawpaged.config import EngineConfig
from rawpaged.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rawpaged.metrics import ServerMetrics
from rawpaged.protocol import GenerateRequest, Limits, ProtocolError

logger = logging.getLogger("rawpaged.server")

DEFAULT_MAX_BODY_SIZE = 4 << 20
DEFAULT_MAX_TOKENS_LIMIT = 4096
OPEN_PATHS = ("/health", "/metrics")


@dataclass
class ServerState:
    model_name: str
    model_aliases: set
    loader: Callable | None
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    engine: AsyncEngine | None = None
    owns_engine: bool = True
    load_error: str | None = None
    failed: asyncio.Event | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=protocol.now)
    load_started: float = 0.0


STATE = web.AppKey("rawpaged_state", ServerState)


# ------------------------------------------------------------------------------------------ helpers
def _json(obj, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def _error(state: ServerState, status: int, message: str, type: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> web.Response:
    state.metrics.count_error(status)
    return _json(protocol.error_body(message, type, param, code), status=status)


def _require_engine(state: ServerState) -> AsyncEngine:
    if state.engine is None:
        msg = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        raise ProtocolError(msg, status=503, type="service_unavailable_error")
    return state.engine


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_aliases:
        raise ProtocolError(f"The model `{model}` does not exist.", param="model", status=404,
                            type="invalid_request_error", code="model_not_found")


async def _read_json(request: web.Request) -> dict:
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"request body is larger than {request.app[STATE].max_body_size} bytes",
                            status=413) from None
    return protocol.parse_json(data)


@dataclass
class _Prompt:
    text: str | None
    ids: list
    params: object  # SamplingParams
    tokenizer: object

    @functools.cached_property
    def echo_text(self) -> str:
        return self.text if self.text is not None else self.tokenizer.decode(self.ids, skip_special_tokens=False)


async def _prepare(engine: AsyncEngine, req: GenerateRequest, limits: Limits) -> list:
    """Tokenize (in a worker thread) and validate the prompts; pick max_tokens; build SamplingParams."""
    tok = engine.tokenizer

    def work():
        if req.messages is not None:
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
            except ValueError as e:
                raise ProtocolError(str(e), param="messages") from None
            return [(text, tok.encode(text))]
        return [(p, tok.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts]

    items = await asyncio.to_thread(work)
    vocab = engine.engine.model_config.vocab_size
    max_len = engine.max_model_len
    param = req.prompt_param
    out = []
    for text, ids in items:
        if not ids:
            raise ProtocolError("prompt is empty (no tokens)", param=param)
        if text is None and any(not 0 <= t < vocab for t in ids):
            raise ProtocolError(f"prompt contains token ids outside [0, {vocab})", param=param)
        if len(ids) >= max_len:
            raise ProtocolError(f"this model's maximum context length is {max_len} tokens; the prompt has "
                                f"{len(ids)} tokens", param=param)
        room = max_len - len(ids)
        if req.max_tokens is None:
            default = protocol.DEFAULT_COMPLETION_MAX_TOKENS if req.kind == "completion" and req.messages is None \
                else limits.max_tokens
            max_tokens = min(default, room)
        else:
            max_tokens = req.max_tokens
            if max_tokens > room:
                raise ProtocolError(f"this model's maximum context length is {max_len} tokens; the prompt has "
                                    f"{len(ids)} tokens and {req.max_tokens_param} asks for {max_tokens} more",
                                    param=req.max_tokens_param)
        out.append(_Prompt(text, list(ids), req.sampling_params(max_tokens), tok))
    return out


async def _add_all(engine: AsyncEngine, prompts: list, base_id: str, param: str) -> list:
    streams = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            prompt = {"prompt_token_ids": p.ids, "prompt": p.text}
            streams.append(await engine.add_request(prompt, p.params, rid))
    except ValueError as e:
        for s in streams:
            engine.abort(s.request_id)
        raise ProtocolError(str(e), param=param) from None
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


async def _merge(streams: list):
    """Yield ``(prompt_index, RequestOutput)`` from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _check_complete(streams: list) -> None:
    for s in streams:
        if not s.finished:
            raise EngineDeadError("the request was aborted by the server")


# ------------------------------------------------------------------------------------------ OpenAI routes
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = protocol.parse_completion_request(await _read_json(request), state.limits)
    return await _generate(request, state, req)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = protocol.parse_chat_request(await _read_json(request), state.limits)
    return await _generate(request, state, req)


async def _generate(request: web.Request, state: ServerState, req: GenerateRequest) -> web.StreamResponse:
    _check_model(state, req.model)
    engine = _require_engine(state)
    prompts = await _prepare(engine, req, state.limits)
    base_id = protocol.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
    streams = await _add_all(engine, prompts, base_id, req.prompt_param)
    try:
        if req.stream:
            return await _stream_response(request, state, req, base_id, prompts, streams)
        return await _full_response(state, req, base_id, prompts, streams)
    finally:
        for s in streams:  # no-op for finished requests; frees blocks of a vanished client's
            engine.abort(s.request_id)


def _logprobs(req: GenerateRequest, tok, token_ids, entries, offset: int = 0):
    if req.logprobs is None:
        return None
    if req.kind == "chat":
        return protocol.chat_logprobs(tok, token_ids, entries, req.logprobs)
    return protocol.completion_logprobs(tok, token_ids, entries, offset)


async def _full_response(state, req, rid, prompts, streams) -> web.Response:
    final = {}
    async for i, out in _merge(streams):
        final[i] = out
    _check_complete(streams)
    n = req.sampling["n"]
    choices, completion_tokens = [], 0
    tok = prompts[0].tokenizer
    for i, p in enumerate(prompts):
        for c in sorted(final[i].outputs, key=lambda c: c.index):
            index = i * n + c.index
            completion_tokens += len(c.token_ids)
            if req.kind == "chat":
                choices.append(protocol.chat_choice(index, c.text, c.finish_reason,
                                                    _logprobs(req, tok, c.token_ids, c.logprobs or [])))
            else:
                prefix = p.echo_text if req.echo else ""
                choices.append(protocol.completion_choice(
                    index, prefix + c.text, c.finish_reason,
                    _logprobs(req, tok, c.token_ids, c.logprobs or [], len(prefix))))
    usage = protocol.usage(sum(len(p.ids) for p in prompts), completion_tokens)
    build = protocol.chat_response if req.kind == "chat" else protocol.completion_response
    return _json(build(rid, protocol.now(), state.model_name, choices, usage))


async def _stream_response(request, state, req, rid, prompts, streams) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    created = protocol.now()
    model = state.model_name
    chat = req.kind == "chat"
    n = req.sampling["n"]
    tok = prompts[0].tokenizer
    chunk = protocol.chat_chunk if chat else protocol.completion_chunk

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    sent: dict = {}  # global index -> [chars sent, tokens sent, finished]
    completion_tokens = 0
    try:
        if chat:  # first chunk: the role, for every choice
            await send(chunk(rid, created, model,
                             [protocol.chat_chunk_choice(i * n + j, {"role": "assistant", "content": ""}, None)
                              for i in range(len(prompts)) for j in range(n)], None, req.include_usage))
        async for i, out in _merge(streams):
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                st = sent.setdefault(index, [0, 0, False])
                if st[2]:
                    continue
                text, new_ids = c.text[st[0]:], c.token_ids[st[1]:]
                offset = st[0] + (len(prompts[i].echo_text) if req.echo else 0)
                lp = _logprobs(req, tok, new_ids, (c.logprobs or [])[st[1]:], offset) if new_ids else None
                if not text and not c.finish_reason and lp is None:
                    continue
                if chat:
                    choices.append(protocol.chat_chunk_choice(index, {"content": text} if text else {},
                                                              c.finish_reason, lp))
                else:
                    if req.echo and st[0] == 0 and st[1] == 0:
                        text = prompts[i].echo_text + text
                    choices.append(protocol.completion_choice(index, text, c.finish_reason, lp))
                st[0], st[1], st[2] = len(c.text), len(c.token_ids), c.finish_reason is not None
            if out.finished:
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            if choices:
                await send(chunk(rid, created, model, choices, None, req.include_usage))
        _check_complete(streams)
        if req.include_usage:
            usage = protocol.usage(sum(len(p.ids) for p in prompts), completion_tokens)
            await send(chunk(rid, created, model, [], usage, True))
    except EngineDeadError as e:
        error = protocol.error_body(str(e), "internal_server_error")
    except ConnectionError:
        return resp  # the client left; the caller aborts its requests
    else:
        error = None
    try:
        if error is not None:
            await send(error)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    max_len = state.engine.max_model_len if state.engine is not None else None
    return _json(protocol.models_response(state.model_name, state.created, max_len))


# ------------------------------------------------------------------------------------------ websocket
@dataclass
class _WsJob:
    id: str
    n: int
    task: asyncio.Task | None = None
    rid: str | None = None
    cancelled: bool = False


async def ws_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(max_msg_size=state.max_body_size)
    await ws.prepare(request)
    jobs: dict[str, _WsJob] = {}

    async def send(obj) -> None:
        if ws.closed:
            return
        try:
            await ws.send_str(json.dumps(obj))
        except (ConnectionError, RuntimeError):
            pass

    async def run(job: _WsJob, req: GenerateRequest) -> None:
        engine = None
        done = set()
        sent: dict = {}  # choice index -> (chars sent, tokens sent)
        prompt_tokens = 0
        try:
            _check_model(state, req.model)
            engine = _require_engine(state)
            prompts = await _prepare(engine, req, state.limits)
            prompt_tokens = len(prompts[0].ids)
            if job.cancelled:
                raise asyncio.CancelledError
            job.rid = protocol.new_id("ws")
            stream = (await _add_all(engine, prompts, job.rid, req.prompt_param))[0]
            if job.cancelled:  # cancelled while being added
                engine.abort(job.rid)
            async for out in stream:
                for c in out.outputs:
                    if c.index in done:
                        continue
                    chars, ntok = sent.get(c.index, (0, 0))
                    text, ids = c.text[chars:], c.token_ids[ntok:]
                    if text or ids:
                        msg = {"type": "delta", "id": job.id, "index": c.index, "text": text, "token_ids": ids}
                        if req.logprobs is not None:
                            msg["logprobs"] = [{str(t): lp for t, lp in e.items()} for e in (c.logprobs or [])[ntok:]]
                        await send(msg)
                    sent[c.index] = (len(c.text), len(c.token_ids))
                    if c.finish_reason:
                        done.add(c.index)
                        await send({"type": "done", "id": job.id, "index": c.index, "finish_reason": c.finish_reason,
                                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids)}})
            if stream.aborted:
                raise asyncio.CancelledError
        except ProtocolError as e:
            await send({"type": "error", "id": job.id, "message": e.message, "param": e.param, "status": e.status})
        except EngineDeadError as e:
            await send({"type": "error", "id": job.id, "message": str(e), "param": None, "status": 500})
        except asyncio.CancelledError:
            if job.cancelled:  # the client's cancel: close every choice
                for index in range(job.n):
                    if index not in done:
                        await send({"type": "done", "id": job.id, "index": index, "finish_reason": "abort",
                                    "usage": {"prompt_tokens": prompt_tokens,
                                              "completion_tokens": sent.get(index, (0, 0))[1]}})
            else:
                raise
        finally:
            if engine is not None and job.rid is not None:
                engine.abort(job.rid)
            if jobs.get(job.id) is job:
                del jobs[job.id]

    def on_message(data: str) -> None:
        try:
            msg = json.loads(data)
        except ValueError as e:
            raise ProtocolError(f"message is not valid JSON: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError("message must be a JSON object")
        mid = msg.get("id")
        if isinstance(mid, bool) or not isinstance(mid, (str, int)) or mid == "":
            raise ProtocolError("id must be a non-empty string", param="id")
        mid = str(mid)
        kind = msg.get("type")
        if kind == "generate":
            if mid in jobs:
                raise ProtocolError(f"id {mid!r} is already in use on this socket", param="id")
            try:
                req = protocol.parse_ws_generate(msg, state.limits)
            except ProtocolError as e:
                e.ws_id = mid
                raise
            job = _WsJob(mid, req.sampling["n"])
            jobs[mid] = job
            job.task = asyncio.create_task(run(job, req))
        elif kind == "cancel":
            job = jobs.get(mid)
            if job is None:
                e = ProtocolError(f"no active request with id {mid!r}", param="id")
                e.ws_id = mid
                raise e
            # run() sees the flag (or its stream ends as aborted) and sends a "done" per choice
            job.cancelled = True
            if job.rid is not None and state.engine is not None:
                state.engine.abort(job.rid)
        else:
            e = ProtocolError("type must be 'generate' or 'cancel'", param="type")
            e.ws_id = mid
            raise e

    try:
        async for msg in ws:
            if msg.type == web.WSMsgType.TEXT:
                try:
                    on_message(msg.data)
                except ProtocolError as e:
                    await send({"type": "error", "id": getattr(e, "ws_id", None), "message": e.message,
                                "param": e.param, "status": e.status})
            elif msg.type == web.WSMsgType.BINARY:
                await send({"type": "error", "id": None, "message": "binary messages are not supported",
                            "param": None, "status": 400})
            else:
                break
    finally:  # socket closed: abort everything it started
        tasks = [j.task for j in list(jobs.values()) if j.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return ws


# ------------------------------------------------------------------------------------------ health, metrics
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        return _json({"status": "ok", "model": state.model_name})
    if state.load_error:
        return _json({"status": "error", "message": state.load_error}, status=503)
    return _json({"status": "loading", "model": state.model_name,
                  "seconds": round(time.monotonic() - state.load_started, 1)}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = None
    if state.engine is not None:
        try:
            stats = await state.engine.stats()
        except EngineDeadError:
            pass
    return web.Response(body=state.metrics.render(stats), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def debug_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _json(await _require_engine(state).stats())


# ------------------------------------------------------------------------------------------ app
@web.middleware
async def _middleware(request: web.Request, handler):
    state = request.app[STATE]
    if state.api_key and request.path not in OPEN_PATHS:
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            return _error(state, 401, "invalid or missing API key (Authorization: Bearer <key>)",
                          type="authentication_error", code="invalid_api_key")
    try:
        return await handler(request)
    except ProtocolError as e:
        return _error(state, e.status, e.message, e.type, e.param, e.code)
    except EngineDeadError as e:
        return _error(state, 500, str(e), "internal_server_error")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            e.status, "invalid_request_error")
        return _error(state, e.status, e.reason if e.text is None else e.text.removeprefix(f"{e.status}: "), kind)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # noqa: BLE001
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error(state, 500, "internal server error", "internal_server_error")


def model_name_of(config: EngineConfig) -> str:
    from rawpaged import weights

    if config.model is None:
        return weights.DEFAULT_MODEL
    return Path(config.model).expanduser().name or str(config.model)


def create_app(config: EngineConfig | None = None, *, engine=None, loader: Callable | None = None,
               served_model_name: str | None = None, api_key: str | None = None,
               max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               max_n: int = 16) -> web.Application:
    """The aiohttp application.

    The model comes from ``engine`` (an ``LLMEngine`` or ``AsyncEngine``, ready now), ``loader`` (a
    callable returning an ``LLMEngine``, run in a thread at startup) or ``config`` (``LLMEngine(config)``
    in a thread). While loading, ``/health`` answers 503 and generation routes 503.
    """
    from rawpaged.engine import LLMEngine

    config = config or EngineConfig()
    if engine is None and loader is None:
        def loader():
            engine = LLMEngine(config)
            logger.info("warm-up run (kernels compiled or loaded from their cache) took %.1fs", engine.warmup())
            return engine
    name = served_model_name or model_name_of(config)
    aliases = {name, model_name_of(config)} | ({config.model} if config.model else set())
    state = ServerState(model_name=name, model_aliases=aliases, loader=loader, api_key=api_key or None,
                        limits=Limits(max_tokens=max_tokens_limit, max_n=max_n), max_body_size=max_body_size)
    app = web.Application(client_max_size=max_body_size, middlewares=[_middleware])
    app[STATE] = state

    async def on_startup(app):
        loop = asyncio.get_running_loop()
        state.failed = asyncio.Event()
        state.load_started = time.monotonic()
        if engine is not None:
            if isinstance(engine, AsyncEngine):
                state.engine, state.owns_engine = engine, False
            else:
                state.engine = AsyncEngine(engine, metrics=state.metrics)
            return

        def load():  # a daemon thread: a hung or slow load never blocks shutdown
            try:
                result, error = state.loader(), None
            except BaseException as e:  # noqa: BLE001
                logger.debug("model load failed", exc_info=True)
                lines = str(e).strip().splitlines()
                result, error = None, (lines[0] if lines else type(e).__name__)
            try:
                loop.call_soon_threadsafe(loaded, result, error)
            except RuntimeError:  # the loop is gone
                pass

        def loaded(result, error):
            if error is not None:
                state.load_error = error
                state.failed.set()
                return
            state.engine = AsyncEngine(result, metrics=state.metrics)
            logger.info("ready: model %s loaded and warmed up in %.1fs on %s (%s, KV cache %s: %d blocks of %d "
                        "tokens, max_model_len %d)", state.model_name, time.monotonic() - state.load_started,
                        result.backend.name, result.dtype, result.kv_cache_dtype, result.allocator.num_blocks,
                        result.config.block_size, result.max_model_len)

        threading.Thread(target=load, name="rawpaged-load", daemon=True).start()

    async def on_cleanup(app):
        if state.engine is not None and state.owns_engine:
            await state.engine.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/ws", ws_handler)
    app.router.add_get("/v1/debug/stats", debug_stats)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000, *, handle_signals: bool = True,
                stop: asyncio.Event | None = None, on_started: Callable | None = None) -> int:
    """Serve ``app`` until ``stop`` is set (or SIGINT/SIGTERM), or until the model fails to load.

    Returns the exit code: 0 after a stop, 1 if the port cannot be bound or the model failed to load
    (a one-line ``error: ...`` goes to stderr). ``on_started(port)`` is called once listening.
    """
    # A short grace period on shutdown: streams in flight get 5 s to finish, then are cancelled (aborted).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    state = app[STATE]
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        return 1
    bound = runner.addresses[0][1] if runner.addresses else port
    logger.info("listening on http://%s:%d (health: /health, OpenAI API: /v1, websocket: /v1/ws); %s %s", host,
                bound, "serving" if state.engine is not None else "loading", state.model_name)
    if on_started is not None:
        on_started(bound)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(state.failed.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        code = 1 if state.failed.is_set() else 0
        if code:
            print(f"error: {state.load_error}", file=sys.stderr)
        else:
            logger.info("shutting down")
        await runner.cleanup()
    return code


# ------------------------------------------------------------------------------------------ CLI
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5GB', '4M' (single letters are binary), '1000000'."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB, 1000000)")
    num, unit, i, b = m.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1000 if (unit and b and not i) else 1024
    value = int(float(num) * base ** power)
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those options describe their default in words)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python server.py",
        description="Serve a model with an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models), websocket streaming (/v1/ws), /health and Prometheus /metrics.",
        formatter_class=_HelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF-style model directory; default: SmolLM2-135M-Instruct, downloaded and prepared into "
                        "weights/ on first use")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; use 0.0.0.0 to accept connections from other machines")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto uses CUDA when a GPU is usable, else the CPU")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="weights and activations: auto is float32 on the CPU (its only dtype); on CUDA the "
                        "checkpoint's float16/bfloat16, else bfloat16")
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="KV-cache element type (auto: as --dtype; the CPU also takes bfloat16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (power of two <= 128)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="KV-cache pool size in blocks")
    pool.add_argument("--kv-cache-memory", type=parse_size, default=None,
                      help="KV-cache pool size in bytes, e.g. 2GiB or 512MiB (default: 1 GiB on CPU; on CUDA "
                           "what --gpu-memory-utilization leaves after the weights)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of the GPU's memory for weights plus KV cache")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="sequences per engine step at most")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="prompt + generated tokens per sequence at most (default: the model's context)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="token budget per engine step (prefill chunks + decodes)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable reuse of KV blocks of shared prefixes")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route except /health and /metrics")
    p.add_argument("--max-tokens-limit", type=_positive_int, default=DEFAULT_MAX_TOKENS_LIMIT,
                   help="largest max_tokens a request may ask for (larger: HTTP 400); also the chat default")
    p.add_argument("--max-body-size", type=parse_size, default=DEFAULT_MAX_BODY_SIZE,
                   help="largest request body or websocket message in bytes (larger: HTTP 413)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="logging level (info: one line per request)")
    return p


def main(argv: list | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                              kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                              block_size=args.block_size,
                              num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_prefix_caching=not args.no_prefix_caching, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        from rawpaged import weights

        if args.model != weights.DEFAULT_MODEL:
            print(f"error: --model {args.model!r} is not a directory", file=sys.stderr)
            return 1
    app = create_app(config, served_model_name=args.served_model_name, api_key=args.api_key,
                     max_tokens_limit=args.max_tokens_limit, max_body_size=args.max_body_size)
    try:
        return asyncio.run(serve(app, args.host, args.port))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
