"""Per-request latency bookkeeping of a front end: time to first token, inter-token latency and
end-to-end latency into the server's metrics, and one INFO log line per ended request. Shared by the
single engine (``AsyncEngine``) and the data-parallel front end (``DataParallelEngine``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rawpaged.engine.outputs import RequestOutput

logger = logging.getLogger("rawpaged.server")


@dataclass
class _RequestInfo:
    arrival: float
    num_prompt_tokens: int
    log_label: str | None = None
    first_token_time: float | None = None
    last_output_time: float | None = None
    num_generated: int = 0


class RequestStatsTracker:
    """``metrics``: a ``rawpaged.entrypoints.server.metrics.ServerMetrics`` or None; ``log_requests``: write the
    INFO line. Times are ``time.monotonic()`` seconds."""

    def __init__(self, metrics=None, log_requests: bool = True):
        self.metrics = metrics
        self.log_requests = log_requests
        self._info: dict[str, _RequestInfo] = {}

    def arrived(self, rid: str, arrival: float, num_prompt_tokens: int, log_label: str | None = None) -> None:
        self._info[rid] = _RequestInfo(arrival, num_prompt_tokens, log_label)

    def output(self, out: RequestOutput, now: float) -> None:
        """A new cumulative output of a request: its first token or the next ones."""
        info = self._info.get(out.request_id)
        if info is None or not isinstance(out, RequestOutput):  # a pooling output generates no token
            return
        n = sum(len(c.token_ids) for c in out.outputs)
        if n <= info.num_generated:
            return
        if info.first_token_time is None:
            info.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - info.arrival)
        elif self.metrics is not None:
            self.metrics.observe_inter_token(now - info.last_output_time)
        info.last_output_time = now
        info.num_generated = n

    def finished(self, rid: str, reason, now: float) -> None:
        """The request ended: ``reason`` is its choices' finish reasons (a list, ``finish_reasons``),
        or "abort" or "error" for all of it."""
        reasons = [reason] if isinstance(reason, str) else list(reason)
        info = self._info.pop(rid, None)
        if info is None:
            return
        latency = now - info.arrival
        if self.metrics is not None:
            self.metrics.observe_finished(latency, reasons)
        if self.log_requests:
            ttft = f"{info.first_token_time - info.arrival:.3f}s" if info.first_token_time else "-"
            logger.info(
                "request %s: prompt_tokens=%d completion_tokens=%d finish_reason=%s latency=%.3fs ttft=%s",
                f"{rid} ({info.log_label})" if info.log_label else rid,
                info.num_prompt_tokens,
                info.num_generated,
                ",".join(sorted(set(reasons))),
                latency,
                ttft,
            )

    def discard(self, rid: str) -> None:
        """Forget a request without recording it (the engine failed under it)."""
        self._info.pop(rid, None)


def finish_reasons(out: RequestOutput) -> str:
    """A finished output's finish reason per choice (``"stop"`` for one not set)."""
    if not isinstance(out, RequestOutput):  # a pooling request: it ends when its prompt ran
        return ["stop"]
    return [c.finish_reason or "stop" for c in out.outputs] or ["stop"]
