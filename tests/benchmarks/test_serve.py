"""benchmarks/serve.py's client: retries a dropped keep-alive on a fresh connection, counts streamed
tokens without a usage chunk, and the side-by-side comparison with llama-server."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from benchmarks import serve


async def _run_against_fake(drop_first: int, tokens: int):
    calls = {"n": 0}

    async def completions(request):
        calls["n"] += 1
        if calls["n"] <= drop_first:  # the peer drops the connection before answering
            request.transport.close()
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):  # no usage chunk, as llama-server without stream_options
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await serve.one_request(session, f"http://127.0.0.1:{port}/v1/completions", "m", [1, 2], tokens, {})
    finally:
        await runner.cleanup()


def test_dropped_keep_alive_is_retried_and_tokens_counted_from_chunks():
    res = asyncio.run(_run_against_fake(drop_first=1, tokens=5))
    assert res.ok and res.retries == 1 and res.output_tokens == 5 and len(res.itl) == 4


def test_a_peer_that_keeps_dropping_fails_after_the_retries():
    res = asyncio.run(_run_against_fake(drop_first=10, tokens=5))
    assert not res.ok and res.retries == 2 and res.dropped_early
    summary = serve.summarize([res], 1.0, 1, float("inf"))
    assert summary["completed"] == 0 and summary["failed"] == 1 and summary["output_throughput_tok_s"] == 0


def _summary(conc, tpot, tps, ttft, itl50, itl99, failed=0):
    stats = lambda v: {"mean": v, "p50": v, "p99": v}  # noqa: E731
    return {
        "concurrency": conc,
        "tpot_ms": stats(tpot),
        "output_throughput_tok_s": tps,
        "ttft_ms": stats(ttft),
        "itl_ms": {"mean": itl50, "p50": itl50, "p99": itl99},
        "completed": 4 * conc - failed,
        "failed": failed,
    }


def test_comparison_ratios_favour_the_faster_server(capsys):
    ours = [_summary(1, 10.0, 100.0, 20.0, 10.0, 15.0), _summary(8, 40.0, 200.0, 50.0, 40.0, 90.0, failed=1)]
    theirs = [_summary(1, 13.0, 70.0, 30.0, 13.0, 18.0), _summary(8, 28.0, 224.0, 40.0, 28.0, 43.0)]
    rows = serve.compare_rows(ours, theirs)
    assert rows[0]["tpot_p50_ms"]["ratio"] == pytest.approx(1.3)  # 13 / 10: ours faster per stream
    assert rows[0]["output_tok_s"]["ratio"] == pytest.approx(100 / 70)
    assert rows[1]["tpot_p50_ms"]["ratio"] == pytest.approx(0.7)
    assert rows[1]["itl_p99_ms"]["ratio"] == pytest.approx(43 / 90)
    assert rows[1]["failed"] == {"rawpaged": 1, "llama_server": 0}
    text = serve.print_compare(rows)
    assert "40.0/28.0 (0.7x)" in text and text.strip() == capsys.readouterr().out.strip()


def test_compare_passes_server_args_but_keeps_its_own_device_and_model():
    from rawpaged.entrypoints.cli import build_serve_parser

    argv = serve.compare_server_args("--no-fused-decode --device cuda --block-size 8", "/m", 64)
    parsed = build_serve_parser().parse_args(argv)
    assert (parsed.fused_decode, parsed.block_size) == (False, 8)
    assert (parsed.device, parsed.model, parsed.max_num_seqs) == ("cpu", "/m", 64)
