"""Data parallelism on Ray: N engine replicas (``EngineReplica`` actors, one GPU each on CUDA, one CPU
each otherwise, in one placement group) behind one front end that routes each request
(``rawpaged.engine.router``) and streams its outputs back.

``DataParallelEngine`` offers what the server uses of ``AsyncEngine`` (``add_request`` returning a
``RequestStream``, ``abort``, ``stats``, ``close``, ``check_prompt``, ``tokenizer``, ``max_model_len``,
``default_sampling_params``), so the HTTP and websocket routes serve either.

Failure: a replica that dies fails only its in-flight requests (``ReplicaUnavailableError``, a 503 at
the server); Ray restarts the actor (``max_restarts``), and the router sends it nothing until it answers
again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import threading
import time
import uuid

from rawpaged.config import EngineConfig
from rawpaged.engine.engine_client import RequestStream
from rawpaged.engine.engine_parts import FrontEnd
from rawpaged.engine.replica import ACCEPTED, EngineReplica
from rawpaged.engine.request_stats import RequestStatsTracker, finish_reasons
from rawpaged.engine.router import Router
from rawpaged.errors import EngineDeadError, EngineError, InvalidRequestError, ReplicaUnavailableError, import_optional
from rawpaged.sampling_params import SamplingParams

logger = logging.getLogger("rawpaged.server")

#: seconds between two probes of a dead replica
PROBE_INTERVAL_S = 1.0
#: how long ``shutdown`` waits for Ray
SHUTDOWN_TIMEOUT_S = 5.0
#: how long ``init_ray`` waits for a cluster's address to accept a connection
CONNECT_TIMEOUT_S = 5.0
#: seconds between two health checks of each ready replica (a dead idle replica is noticed by them)
HEALTH_CHECK_INTERVAL_S = 2.0
#: a replica that has not answered a health check within this is taken out of routing
HEALTH_CHECK_TIMEOUT_S = 5.0


def init_ray(address: str | None, data_parallel_size: int) -> bool:
    """Connect to the Ray cluster at ``address``, or start a local instance with a CPU slot per replica
    at least (replicas then share cores). Call it on the main thread: with Ray initialised on another
    thread, every awaited result took ~0.2 s (Ray 2.60). Returns whether it initialised Ray (False when
    it already was).

    Raises:
        MissingDependencyError (a ValueError) naming the ``ray`` extra when Ray is not installed.
    """
    ray = import_optional("ray", "data-parallel replicas (--data-parallel-size > 1)", param="data_parallel_size")

    if ray.is_initialized():
        return False
    if address:
        check_ray_address(address)
    num_cpus = None if address else max(os.cpu_count() or 1, data_parallel_size)
    ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return True


def check_ray_address(address: str) -> None:
    """Raises ConnectionError unless ``HOST:PORT`` accepts a TCP connection within ``CONNECT_TIMEOUT_S``
    (``ray.init`` would retry an unreachable address without end). ``auto`` and ``ray://`` addresses
    are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or address, int(port or 6379)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"no Ray cluster answers at {address} ({e}); start one with 'ray start --head'") from None


def shutdown_ray(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """``ray.shutdown()``, given up after ``timeout_s`` (see ``DataParallelEngine.shutdown``)."""
    import ray  # deferred: an optional library (the "ray" extra), installed when replicas started

    thread = threading.Thread(target=ray.shutdown, name="rawpaged-ray-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)


class DataParallelEngine:
    """Args:
    config: every replica's engine configuration.
    data_parallel_size: number of replicas.
    ray_address: a running Ray cluster to join (``ray start --head`` gives it); None starts a local Ray
        instance. Either happens only if Ray is not initialised in this process yet (``init_ray``: on
        the main thread).
    max_restarts: how often Ray restarts a dead replica (-1: without limit).
    router: the routing policy (default ``Router(data_parallel_size, config.block_size)``).
    metrics, log_requests: as for ``AsyncEngine``.

    The constructor blocks until every replica has loaded its model (run it off the event loop).
    Raises MissingDependencyError (a ValueError) without ``ray``; ConnectionError when no cluster answers
    at ``ray_address``; RuntimeError when the cluster lacks the GPUs, the placement group cannot be placed within
    ``placement_timeout_s``, or a replica fails to start (with the replica's own exception).
    """

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        ray_address: str | None = None,
        max_restarts: int = -1,
        router: Router | None = None,
        metrics=None,
        log_requests: bool = True,
        placement_timeout_s: float = 120.0,
    ):
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        self.config = config
        self._started_ray = init_ray(ray_address, data_parallel_size)
        import ray  # deferred: an optional library (the "ray" extra); init_ray checked that it is installed

        self._ray = ray
        on_gpu = config.device == "cuda"
        gpus = ray.cluster_resources().get("GPU", 0)
        if on_gpu and gpus < data_parallel_size:
            raise RuntimeError(f"{data_parallel_size} replicas need a GPU each; the Ray cluster has {gpus:g}")
        bundle = {"CPU": 1, "GPU": 1} if on_gpu else {"CPU": 1}
        self.placement_group = _place(ray, bundle, data_parallel_size, placement_timeout_s)
        self.replicas, info = _start_replicas(ray, self.placement_group, config, data_parallel_size, max_restarts)
        front = FrontEnd.from_description(config, info)  # as each replica's own, so it refuses the same
        self.tokenizer, self.input_processor = front.tokenizer, front.input_processor
        self.max_model_len = info["max_model_len"]
        self.default_sampling_params = info["default_sampling_params"]
        self.block_size = info["block_size"]
        self.router = router or Router(data_parallel_size, block_size=info["block_size"])
        self.request_stats = RequestStatsTracker(metrics, log_requests)
        self._streams: dict[str, RequestStream] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self._probes: dict[int, asyncio.Task] = {}
        self._health_task: asyncio.Task | None = None
        self.replica_failures = [0] * data_parallel_size  # times each replica was found down
        self._closed = False

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def max_num_seqs(self) -> int:
        """Sequences all replicas run in one step at most."""
        return self.config.max_num_seqs * self.data_parallel_size

    def end_requests(self, error: BaseException) -> int:
        """End every request in flight with ``error`` (their streams raise it) and abort it on its
        replica; returns how many."""
        rids = list(self._streams)
        for rid in rids:
            self._end(rid, error)
        return len(rids)

    def check_prompt(self, ids: list) -> None:
        self.input_processor.check_prompt(ids)

    # ------------------------------------------------------------------ requests
    async def add_request(
        self, prompt, params: SamplingParams, request_id: str | None = None, log_label: str | None = None
    ) -> RequestStream:
        """Route a request to a replica, wait until it is queued there, and return its stream
        (``stream.replica`` says where). A replica found dead before it queued the request is taken out
        of routing and the next one is tried. Raises what the replica's ``add_request`` raises
        (InvalidRequestError, ValueError), or ReplicaUnavailableError when no replica can take it."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._ensure_health_checks()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        _, ids = self.input_processor.tokenize(prompt)
        arrival = time.monotonic()
        while True:
            try:
                replica = self.router.choose(ids)
            except RuntimeError as e:
                raise ReplicaUnavailableError(f"no replica can take the request: {e}") from None
            stream = RequestStream(request_id, replica)
            self._streams[request_id] = stream
            generator = (
                self.replicas[replica].generate.options(num_returns="streaming").remote(prompt, params, request_id)
            )
            try:
                accepted = await (await generator.__anext__())
                assert accepted == ACCEPTED, accepted
                if stream.aborted:  # aborted while the replica queued it: abort() told the replica
                    self._ray.cancel(generator)
                    return stream
                break
            except BaseException as e:
                self._streams.pop(request_id, None)
                self.router.finished(replica)
                self._ray.cancel(generator)
                if isinstance(e, asyncio.CancelledError):
                    self.replicas[replica].abort.remote(request_id)
                    raise
                error = self._replica_error(replica, e)
                if not isinstance(error, ReplicaUnavailableError):
                    raise error from None
        self.request_stats.arrived(request_id, arrival, len(ids), log_label)
        self._pumps[request_id] = asyncio.create_task(self._pump(stream, generator, replica))
        return stream

    async def _pump(self, stream: RequestStream, generator, replica: int) -> None:
        rid = stream.request_id
        try:
            async for ref in generator:
                out = await ref
                now = time.monotonic()
                self.request_stats.output(out, now)
                stream.put(out)
                if out.finished:
                    self.request_stats.finished(rid, finish_reasons(out), now)
                    break
        except asyncio.CancelledError:  # aborted
            return
        except Exception as e:  # noqa: BLE001 - the replica failed under this request
            error = self._replica_error(replica, e)
            if not isinstance(error, EngineError):  # RequestFailedError (this request alone) stays as it is
                error = ReplicaUnavailableError(f"replica {replica} failed: {error}")
            stream.close(error=error)
            self.request_stats.finished(rid, "error", time.monotonic())
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
                self.router.finished(replica)
            self._pumps.pop(rid, None)

    def abort(self, request_id: str) -> bool:
        """Abort a request: its stream ends now, and its replica drops it. False if unknown or done."""
        return self._end(request_id)

    def _end(self, request_id: str, error: BaseException | None = None) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.close(error=error, aborted=error is None)
        self.router.finished(stream.replica)
        pump = self._pumps.pop(request_id, None)
        if pump is not None:
            pump.cancel()
        self.replicas[stream.replica].abort.remote(request_id)
        self.request_stats.finished(request_id, "abort" if error is None else "error", time.monotonic())
        return True

    def _replica_error(self, replica: int, e: BaseException) -> BaseException:
        """The exception a caller should see for a replica's failure ``e``; a dead replica is taken out
        of routing until it answers again."""
        exceptions = self._ray.exceptions
        if isinstance(e, exceptions.RayTaskError) and not isinstance(e, exceptions.RayActorError):
            return e.cause if isinstance(e.cause, Exception) else EngineDeadError(str(e))
        if isinstance(e, exceptions.RayError):
            self._replica_down(replica)
            return ReplicaUnavailableError(f"replica {replica} is unavailable ({type(e).__name__})")
        return e

    def _replica_down(self, replica: int) -> None:
        """Take ``replica`` out of routing and probe it until it answers; a no-op while a probe of it runs
        on this event loop (one left by an earlier loop, in tests that run several, is replaced)."""
        probe = self._probes.get(replica)
        if not self.router.ready[replica] and probe is not None and probe.get_loop() is asyncio.get_running_loop():
            return
        logger.warning("replica %d is down; routing around it until it answers again", replica)
        self.replica_failures[replica] += 1
        self.router.set_ready(replica, False)
        self._probes[replica] = asyncio.get_running_loop().create_task(self._probe(replica))

    async def _probe(self, replica: int) -> None:
        while not self._closed:
            try:
                await self.replicas[replica].ping.remote()
            except self._ray.exceptions.RayError:
                await asyncio.sleep(PROBE_INTERVAL_S)
                continue
            logger.info("replica %d is back", replica)
            self.router.set_ready(replica, True)
            break
        self._probes.pop(replica, None)

    def _ensure_health_checks(self) -> None:
        """Start the health checks on the running event loop (again, if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        task = self._health_task
        if not self._closed and (task is None or task.done() or task.get_loop() is not loop):
            self._health_task = loop.create_task(self._health_checks())

    async def _health_checks(self) -> None:
        """Ping every ready replica every ``HEALTH_CHECK_INTERVAL_S``, so that one that dies while idle
        is taken out of routing (and probed until it is back) before a request finds it dead. No answer
        within ``HEALTH_CHECK_TIMEOUT_S`` counts as down too: Ray holds calls to an actor it is
        restarting until the restart is done, rather than fail them. (A busy replica still answers at
        once: its steps run on a thread of their own, and the kernels release the GIL.)"""

        async def ping(i):
            try:
                await asyncio.wait_for(self.replicas[i].ping.remote(), timeout=HEALTH_CHECK_TIMEOUT_S)
            except (self._ray.exceptions.RayError, asyncio.TimeoutError):
                self._replica_down(i)

        while not self._closed:
            await asyncio.gather(*(ping(i) for i, ready in enumerate(self.router.ready) if ready))
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)

    # ------------------------------------------------------------------ state
    def replica_health(self) -> list:
        """``[{"replica", "ready", "requests_in_flight"}]`` from the router's view (no call to the replicas)."""
        self._ensure_health_checks()
        return [
            {"replica": i, "ready": ready, "requests_in_flight": load}
            for i, (ready, load) in enumerate(zip(self.router.ready, self.router.load))
        ]

    async def replica_stats(self) -> list:
        """Each replica's ``stats()`` (with its ``replica`` index), or ``{"replica": i, "ready": False}``
        for one that does not answer."""

        async def one(i):
            if not self.router.ready[i]:
                return {"replica": i, "ready": False}
            try:
                return {**await self.replicas[i].stats.remote(), "ready": True}
            except self._ray.exceptions.RayError:
                self._replica_down(i)
                return {"replica": i, "ready": False}

        return list(await asyncio.gather(*(one(i) for i in range(len(self.replicas)))))

    async def kv_cache_snapshot(
        self, start: int = 0, count: int | None = None, since_event: int | None = None, replica: int | None = None
    ) -> dict:
        """The KV cache snapshot of ``replica`` (None: replica 0), with its ``replica`` index.

        Raises:
            ValueError: ``replica`` outside ``[0, data_parallel_size)`` or a bad block range.
            ReplicaUnavailableError: the replica is down.
        """
        replica = 0 if replica is None else replica
        if not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica must be in [0, {len(self.replicas)}), got {replica}")
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._ensure_health_checks()
        if not self.router.ready[replica]:
            raise ReplicaUnavailableError(f"replica {replica} is unavailable")
        try:
            return await self.replicas[replica].kv_cache_snapshot.remote(start, count, since_event)
        except Exception as e:  # noqa: BLE001 - a Ray error, or the replica's own ValueError
            raise self._replica_error(replica, e) from None

    async def add_lora(self, lora_request) -> bool:
        """Refused: LoRA adapters are not served over replicas yet (InvalidRequestError)."""
        raise InvalidRequestError("LoRA adapters are not supported with data-parallel replicas yet", "lora_request")

    async def remove_lora(self, lora_int_id: int) -> bool:
        """False: no replica has adapters."""
        return False

    def num_lora_requests(self, lora_int_id: int) -> int:
        """0: no request runs with an adapter here."""
        return 0

    async def stats(self) -> dict:
        """The replicas' counters summed (``kv_cache_usage``: used over total blocks), plus
        ``num_active_streams``, the router's counters and ``replicas`` (each replica's own)."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._ensure_health_checks()
        per_replica = await self.replica_stats()
        live = [s for s in per_replica if s["ready"]]
        total: dict = {}
        for s in live:
            for k, v in s.items():
                if (
                    isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and k not in ("replica", "block_size", "pid")
                ):
                    total[k] = total.get(k, 0) + v
        if live:
            total["block_size"] = live[0]["block_size"]
            total["kv_cache_usage"] = total["num_used_blocks"] / max(1, total["num_total_blocks"])
        total["num_active_streams"] = len(self._streams)
        total["router"] = {
            "prefix_hits": self.router.stats.prefix_hits,
            "spills": self.router.stats.spills,
            "least_loaded": self.router.stats.least_loaded,
            "load": list(self.router.load),
            "replica_failures": list(self.replica_failures),
        }
        total["replicas"] = per_replica
        return total

    async def close(self) -> None:
        """End every stream with EngineDeadError, stop the replicas and release the placement group (and
        the local Ray instance if this engine started it)."""
        if self._closed:
            return
        self._closed = True
        for task in [*self._pumps.values(), *self._probes.values(), self._health_task]:
            if task is not None:
                task.cancel()
        for rid in list(self._streams):
            self._streams.pop(rid).close(error=EngineDeadError("the server is shutting down"))
            self.request_stats.discard(rid)
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """The blocking part of ``close`` (also usable without an event loop): kill the replicas, release
        the placement group, stop Ray if this engine started it. Gives up after ``timeout_s``: when Ctrl-C
        has already stopped a local Ray instance (its processes share the terminal's process group), Ray's
        calls would wait for it forever."""
        from ray.util.placement_group import remove_placement_group  # deferred: the optional "ray" extra

        def work():
            for r in self.replicas:
                self._ray.kill(r, no_restart=True)
            remove_placement_group(self.placement_group)
            if self._started_ray:
                self._ray.shutdown()

        thread = threading.Thread(target=work, name="rawpaged-ray-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("Ray did not confirm the replicas' shutdown within %.0fs; leaving it", timeout_s)


def _place(ray, bundle: dict, count: int, timeout_s: float):
    """A placement group of ``count`` bundles ``bundle``, packed, once Ray placed it. Raises RuntimeError
    (the group removed) when it is not placed within ``timeout_s``."""
    from ray.util.placement_group import placement_group, remove_placement_group  # deferred: the "ray" extra

    group = placement_group([bundle] * count, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {count} replicas of {bundle} within {timeout_s:.0f}s "
            f"(cluster resources: {ray.cluster_resources()})"
        ) from None
    return group


def _start_replicas(ray, group, config: EngineConfig, count: int, max_restarts: int) -> tuple:
    """``(actors, the first one's info)``: ``count`` ``EngineReplica`` actors, one per bundle of ``group``,
    once each has loaded its model. Raises RuntimeError (the actors killed, the group removed) with the
    replica's own exception when one fails to start."""
    from ray.util.placement_group import remove_placement_group  # deferred: the "ray" extra
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor = ray.remote(EngineReplica)
    on_gpu = config.device == "cuda"
    replicas = [
        actor.options(
            num_cpus=1,
            num_gpus=1 if on_gpu else 0,
            max_restarts=max_restarts,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote(config, i)
        for i in range(count)
    ]
    try:
        return replicas, ray.get([r.info.remote() for r in replicas])[0]
    except ray.exceptions.RayActorError as e:
        for r in replicas:
            ray.kill(r, no_restart=True)
        remove_placement_group(group)
        raise RuntimeError(f"a replica failed to start: {_creation_error(e)}") from None


def _creation_error(e) -> str:
    """The exception a replica's constructor raised (``Type: message``), from Ray's error text (which
    holds the remote traceback, coloured); the text's first line if none is found."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line):
            return line
    return lines[0] if lines else type(e).__name__
