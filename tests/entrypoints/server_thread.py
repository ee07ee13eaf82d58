"""A server in a background thread for the HTTP and websocket tests, and small client helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import aiohttp

from rawpaged.entrypoints.api_server import create_app
from rawpaged.entrypoints.launcher import serve
from rawpaged.entrypoints.server.state import STATE


class ServerThread:
    """Runs ``server.serve(app)`` on 127.0.0.1:<free port> in a thread with its own event loop."""

    def __init__(self, app):
        self.app = app
        self.port = None
        self.exit_code = None
        self._started = threading.Event()
        self._loop = None
        self._stop = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def started(port):
                self.port = port
                self._started.set()

            return await serve(self.app, "127.0.0.1", 0, handle_signals=False, stop=self._stop, on_started=started)

        self.exit_code = asyncio.run(main())
        self._started.set()

    def start(self):
        self._thread.start()
        assert self._started.wait(30), "server did not start"
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app[STATE]

    def wait_healthy(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.engine is not None:
                return
            assert self.state.load_error is None, self.state.load_error
            time.sleep(0.05)
        raise AssertionError("model did not load")

    def stop(self, timeout=30):
        if self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        return self.exit_code


@contextlib.contextmanager
def served(config, **app_options):
    """A healthy ``ServerThread`` of ``create_app(config, **app_options)`` for the ``with`` body; stopped
    after it (also when the body fails), and its exit code checked (0)."""
    srv = ServerThread(create_app(config, **app_options)).start()
    try:
        srv.wait_healthy()
        yield srv
    except BaseException:
        srv.stop()  # the body's failure is the one to report
        raise
    assert srv.stop() == 0


def openai_client(server, timeout: float = 120):
    """The official ``openai`` client on ``server``'s ``/v1`` (no retries; the key is any string)."""
    import openai  # the tests that use it skip where it is missing

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


async def ws_generate(url: str, message: dict) -> tuple:
    """Send one websocket ``generate`` message to the server at ``url``; ``(its text, its last message)``
    once a choice is done (an ``error`` fails the assertion)."""
    async with aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/ws") as ws:
        await ws.send_json({"type": "generate", **message})
        text = ""
        while True:
            msg = json.loads((await ws.receive(timeout=60)).data)
            assert msg["type"] != "error", msg
            if msg["type"] == "delta":
                text += msg.get("text", "")
            if msg.get("finish_reason") or msg["type"] == "done":
                return text, msg


def run(coro):
    return asyncio.run(coro)


async def get_json(url):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


def stats(server):
    return run(get_json(server.url + "/v1/debug/stats"))[1]


def wait_pool_empty(server, timeout=10.0):
    """Poll /v1/debug/stats until nothing runs and every block is free; return the stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        if (
            s["num_free_blocks"] == s["num_total_blocks"]
            and s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["num_active_streams"] == 0
        ):
            return s
        assert time.monotonic() < deadline, f"blocks not returned: {s}"
        time.sleep(0.05)


async def sse(session, url, body):
    """POST a streaming request; return the parsed ``data:`` chunks (without [DONE]) and whether [DONE] came."""
    chunks, done = [], False
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    return chunks, done
