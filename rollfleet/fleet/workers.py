"""Ray actors of the rollout side: one RolloutWorker per GPU.

The worker with tp_rank 0 and pp_rank 0 (the engine head) starts the engine server with all of its
engine's GPUs visible (CUDA_VISIBLE_DEVICES set in the server's environment only; the worker's own
stays as Ray set it) and base_gpu_id 0 relative to that list. Workers with tp_rank > 0 are shells:
they hold their GPU in the placement group, open no port, start no process, and every rollout
verb returns at once.

An embedded engine head keeps a zygote (rollfleet.engine.process.zygote: torch, transformers and the engine
imported once) from its creation on, and starts its engine from it, first start, restarts and
standbys alike; when the zygote is gone the engine is spawned (the log says why) and a new zygote
is started once the engine is up. The zygote ends with its worker (its stdin is the worker's pipe).
Where ROLLFLEET_ZYGOTE_SOCKET names a shared zygote's socket (zygote.py, --listen), the worker takes a
sub-zygote of it instead: no imports to wait for (the test suite starts one for all its fleets).
"""

from __future__ import annotations

import os
from pathlib import Path

import ray

from rollfleet.config import RolloutConfig
from rollfleet.engine.process.launch import EngineLaunch, EngineProcess, PortInUse, RemoteSeed, engine_argv, engine_env
from rollfleet.engine.process.zygote_client import Zygote
from rollfleet.fleet.placement import warn_if_deprioritized
from rollfleet.layout import RankInfo
from rollfleet.wire.net import free_port

PORT_ATTEMPTS = 3


class RolloutWorker:
    def __init__(self, rank: RankInfo, rollout: RolloutConfig, log_dir: str):
        warn_if_deprioritized(f"rollout worker of engine {rank.engine_id} (its engine inherits the priority)")
        self.rank, self.rollout, self.log_dir = rank, rollout, Path(log_dir)
        self.engine: EngineProcess | None = None
        self.zygote = self._new_zygote()

    def _new_zygote(self) -> Zygote | None:
        """A zygote for this worker's engine: heads of embedded engines, when the config asks for one.
        Where a shared zygote of this host listens (ROLLFLEET_ZYGOTE_SOCKET), one of its sub-zygotes."""
        wanted = self.rollout.backend == "embedded" and self.rollout.engine_launcher == "zygote"
        if not (self.rank.is_engine_head and wanted):
            return None
        log_path = self.log_dir / f"zygote-{self.rank.engine_id}.log"
        shared = Zygote.shared(log_path, preload_model=self.rollout.model_path)
        return shared or Zygote(log_path, preload_model=self.rollout.model_path)

    def placement(self) -> dict:
        """Where Ray put this worker: node and GPU ids (as the worker sees them)."""
        return {
            "rank": self.rank.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def start_engine(
        self, engine_gpu_ids: list[str], load_format: str = "auto", seed: RemoteSeed | None = None
    ) -> dict | None:
        """Start this engine's server (heads only) and wait until it answers /health; with `seed`, it
        loads its weights from that engine (R-Fork) instead of `load_format`."""
        if not self.rank.is_engine_head:
            return None
        for attempt in range(PORT_ATTEMPTS):
            port = free_port()
            log_path = self.log_dir / f"engine-{self.rank.engine_id}.log"
            argv = engine_argv(
                self.rollout, EngineLaunch(port=port, host=self.rollout.host, load_format=load_format, seed=seed)
            )
            self.engine = EngineProcess(
                argv,
                port=port,
                log_path=log_path,
                env=engine_env(engine_gpu_ids),
                host=self.rollout.host,
                zygote=self.zygote,
                zygote_wait_s=self.rollout.startup_timeout_s,
            )
            try:
                self.engine.wait_until_up(
                    self.rollout.startup_timeout_s,  # and silent while listening: as long as the health probes allow
                    answer_timeout=self.rollout.probe_timeout_s,
                    silent_polls=self.rollout.probe_failures,
                )
                break
            except PortInUse:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
        if self.zygote is not None and not self.zygote.is_alive():  # spawned this time; fork the next
            self.zygote = self._new_zygote()
        # up_after_s: spawn to the first /health answer, as this worker saw it (the engine's own
        # phases are in its /get_server_info "start_breakdown")
        return {
            "url": self._url(port),
            "pid": self.engine.pid,
            "log": str(log_path),
            "up_after_s": self.engine.up_after_s,
            "launch": self.engine.launch,  # "zygote" (forked) or "spawn"
        }

    def _url(self, port: int) -> str:
        host = self.rollout.host
        if host in ("0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"http://{host}:{port}"

    def free_ports(self, count: int) -> list[int]:
        """`count` distinct TCP ports free on this worker's node now: an R-Fork seed's ranks serve
        their groups' stores on them, so a destination asks the seed's worker, not its own."""
        ports: list[int] = []
        while len(ports) < count:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return ports

    def engine_argv(self) -> list[str] | None:
        return None if self.engine is None else list(self.engine.argv)

    def engine_pid(self) -> int | None:
        return None if self.engine is None else self.engine.pid

    def engine_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    def wait_engine_exit(self) -> int | None:
        """Block until this engine's current process exits; its exit code (the fleet's death watch)."""
        engine = self.engine
        return None if engine is None else engine.proc.wait()

    def kill_engine(self) -> None:
        """SIGKILL the engine's process group at once (a hung engine ignores a polite stop)."""
        if self.engine is not None:
            self.engine.kill()

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()


# threaded: the fleet's death watch blocks in wait_engine_exit while other verbs run
RemoteRolloutWorker = ray.remote(max_concurrency=4)(RolloutWorker)
