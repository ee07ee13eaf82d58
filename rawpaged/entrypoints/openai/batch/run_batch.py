"""An OpenAI Batch API file run through the server's own routes (``rawpaged run-batch -i requests.jsonl -o
results.jsonl``, vLLM's ``vllm run-batch``; its command line is in ``entrypoints.cli``).

The app of ``rawpaged serve`` (``api_server.create_app``, over one warmed-up engine) listens on a Unix
socket in a private temporary directory, and every line's body is POSTed to its ``url`` there, at most
``max_concurrency`` at once: the same request validation, limits, defaults and answers as the server, and
the engine batches the lines as it batches clients. Each line's result (``openai.batch.protocol``) is
written and flushed as it finishes, in the order lines finish (match them by ``custom_id``, as OpenAI's
output says), so an interrupted run keeps what it finished and ``resume`` skips the ``custom_id``s the
output holds. A bad line (not JSON, a missing field, an unknown ``url``, ``stream``, a duplicate
``custom_id``) gets its own error line and the rest run; a route's refusal (a 400, a 404 model) is written
with its status and error body. A 503 (the server's queue is full) is retried after its ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web
from tqdm import tqdm

from rawpaged.entrypoints.openai.batch.protocol import BatchRequestOutput, error_line, parse_line, response_line

logger = logging.getLogger("rawpaged.run_batch")
#: attempts of a line the server answers 503 (its queue full) before its 503 is written
MAX_ATTEMPTS = 20


@dataclasses.dataclass
class BatchSummary:
    """What one run did: lines written, of them answered 200, lines skipped as done (``resume``), tokens
    (completion tokens, or the prompt tokens of embeddings) and seconds."""

    written: int = 0
    succeeded: int = 0
    skipped: int = 0
    tokens: int = 0
    seconds: float = 0.0


def finished_ids(output_path: Path) -> set[str]:
    """The ``custom_id``s of the lines in an output file (none if it does not exist); a last line cut off
    by an interruption is ignored."""
    if not output_path.exists():
        return set()
    done = set()
    for line in output_path.read_text(encoding="utf-8").splitlines():
        try:
            custom_id = json.loads(line).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(custom_id, str):
            done.add(custom_id)
    return done


def _tokens(body) -> int:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0
    return int(usage.get("completion_tokens") or usage.get("total_tokens") or 0)


class _Writer:
    """Writes result lines as they come, flushed, and counts them; the progress bar shows tokens/s."""

    def __init__(self, out, bar: tqdm, summary: BatchSummary):
        self.out, self.bar, self.summary, self.t0 = out, bar, summary, time.monotonic()

    def write(self, result: BatchRequestOutput) -> None:
        self.out.write(result.model_dump_json() + "\n")
        self.out.flush()
        s = self.summary
        s.written += 1
        if result.response is not None and result.response.status_code == 200:
            s.succeeded += 1
            s.tokens += _tokens(result.response.body)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{s.tokens / max(time.monotonic() - self.t0, 1e-9):.1f} tok/s", refresh=False)


async def _post(session: aiohttp.ClientSession, req) -> BatchRequestOutput:
    for attempt in range(MAX_ATTEMPTS):
        async with session.post(req.url, json=req.body) as resp:
            try:
                body = await resp.json(content_type=None)
            except (json.JSONDecodeError, aiohttp.ContentTypeError):
                body = {"error": {"message": await resp.text(), "type": "server_error", "param": None, "code": None}}
            if resp.status != 503 or attempt == MAX_ATTEMPTS - 1:
                request_id = resp.headers.get("X-Request-Id") or (body.get("id") if isinstance(body, dict) else None)
                return response_line(req.custom_id, resp.status, body, request_id or f"batch-{uuid.uuid4().hex}")
            await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
    raise AssertionError("unreachable")


async def _run_lines(session, lines, writer: _Writer, done: set[str], max_concurrency: int) -> None:
    slots = asyncio.Semaphore(max_concurrency)
    tasks, seen = set(), set()

    async def one(req):
        try:
            writer.write(await _post(session, req))
        except aiohttp.ClientError as e:
            writer.write(error_line(req.custom_id, f"the request failed: {e}", "request_failed"))
        finally:
            slots.release()

    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        req, bad = parse_line(line)
        custom_id = req.custom_id if req is not None else bad.custom_id
        if custom_id in done:
            writer.summary.skipped += 1
            continue
        if bad is None and custom_id in seen:
            bad = error_line(custom_id, f"line {number}: custom_id {custom_id!r} is used twice", "duplicate_custom_id")
        if bad is not None:
            writer.write(bad)
            continue
        seen.add(custom_id)
        await slots.acquire()
        task = asyncio.create_task(one(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def run_batch(
    app: web.Application,
    input_path: Path,
    output_path: Path,
    *,
    resume: bool = False,
    max_concurrency: int = 64,
    progress: bool = True,
) -> BatchSummary:
    """Run every line of ``input_path`` through ``app``'s routes and write the results to ``output_path``
    (see the module's docstring); ``resume`` appends, skipping the ``custom_id``s the output holds.

    Raises:
        ValueError: ``max_concurrency`` below 1, or an input file that does not exist.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if not input_path.is_file():
        raise ValueError(f"input file {input_path} does not exist")
    done = finished_ids(output_path) if resume else set()
    total = sum(1 for line in input_path.open(encoding="utf-8") if line.strip())
    summary, t0 = BatchSummary(), time.monotonic()
    runner = web.AppRunner(app, handle_signals=False, access_log=None)  # the progress bar, not a line a request
    await runner.setup()
    try:
        with tempfile.TemporaryDirectory(prefix="rawpaged-batch-") as tmp:
            socket = os.path.join(tmp, "api.sock")
            await web.UnixSite(runner, socket).start()
            connector = aiohttp.UnixConnector(path=socket, limit=max_concurrency)
            timeout = aiohttp.ClientTimeout(total=None)
            async with aiohttp.ClientSession("http://localhost", connector=connector, timeout=timeout) as session:
                with (
                    output_path.open("a" if resume else "w", encoding="utf-8") as out,
                    input_path.open(encoding="utf-8") as lines,
                    tqdm(total=total, unit="req", desc="run-batch", disable=not progress, file=sys.stderr) as bar,
                ):
                    await _run_lines(session, lines, _Writer(out, bar, summary), done, max_concurrency)
    finally:
        await runner.cleanup()
    summary.seconds = time.monotonic() - t0
    return summary
