"""The worker ranks of a tensor-parallel group: processes 1..N-1, each with its own
runner, its slice of the weights and a KV pool of its heads, running every step that
rank 0 (the engine's own runner) prepares.

The seam is DESIGN.md's: the scheduler runs once, in the engine; rank 0's runner turns
its output into step tensors (`StepInputs`) and sends the same to every worker before
its own forward pass, so no worker has a scheduler, a KV manager or a sampler. Steps go
over one pipe per worker, pickled once with plain pickle (multiprocessing's own
pickler would move each tensor through a shared-memory file of its own); the ranks then
meet only at the collectives inside the forward pass.

Processes are `spawn`ed (the engine may run threads that fork would copy mid-state,
and a fresh interpreter starts its own OpenMP pool), daemonic (they die with the
engine's process), and a worker exits when its pipe closes. A worker that fails or
dies is found by rank 0 at the next collective (gloo's socket closes; the shm wait
asks `alive()`), which raises TensorParallelError instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from sluice import settings
from sluice.config import EngineConfig
from sluice.core.errors import TensorParallelError
from sluice.core.lora import LoRAAdapter
from sluice.loader import load_model
from sluice.parallel import GroupSpec, TPGroup, join_group, make_spec, remove_spec_files
from sluice.runner.factory import ModelVariant, RunnerOptions, build_runner
from sluice.runner.kv_layout import KVLayout
from sluice.runner.lora_table import LoRACapacity
from sluice.runner.model_runner import ModelRunner, StepInputs

logger = logging.getLogger("sluice")

START_TIMEOUT_S = 600.0  # a worker loads the whole checkpoint before it takes its slice


@dataclass(frozen=True)
class WorkerBuild:
    """What rank 0 decides after loading, and every worker builds its runner with:
    the same options (on the rank's own device) and KV layout as rank 0's runner."""

    options: RunnerOptions
    layout: KVLayout
    lora: LoRACapacity | None = None
    """Adapter slots beside every adaptable layer (with enable_lora): rank 0 sends each
    adapter it puts in a slot, and every rank holds its part of it there."""


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU for every rank on CPU; on CUDA, rank r takes the r-th GPU after rank 0's."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _worker_main(
    config: EngineConfig, spec: GroupSpec, rank: int, conn: Connection, log_level: int
) -> None:
    # Ctrl-C reaches the whole process group; the engine stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(config.rank_threads())
    try:
        loaded = load_model(config.model, config.revision)
        _send(conn, ("loaded", None))
        build = _recv(conn)
        if not isinstance(build, WorkerBuild):
            return  # rank 0 gave up starting
        group = join_group(spec, rank)
        runner = build_runner(
            config=loaded.config,
            tensors=loaded.tensors,
            options=dataclasses.replace(build.options, device=rank_device(config, rank)),
            layout=build.layout,
            variant=ModelVariant(lora=build.lora),
            tp=group,
        )
        del loaded
        _send(conn, ("ready", None))
    except (EOFError, OSError):
        return  # rank 0 is gone
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        raise SystemExit(1) from None
    _serve(runner, conn)
    group.close()


def _serve(runner: ModelRunner, conn: Connection) -> None:
    """Run what rank 0 sends until it says stop or its pipe closes. An exception ends
    the process: rank 0 sees a dead rank at its next collective."""
    while True:
        try:
            kind, payload = _recv(conn)
        except (EOFError, OSError):
            return
        if kind == "step":
            runner.run_step(payload.to(runner.device))
        elif kind == "copy":
            runner.copy_blocks(payload)
        elif kind == "lora":
            assert runner.lora is not None, "LoRA slots on rank 0 only"
            for slot, adapter in payload:
                runner.lora.load(slot, adapter)
        else:
            return


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1 (what its runner calls `followers`)."""

    def __init__(self, config: EngineConfig, spec: GroupSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        level = logging.getLogger("sluice").getEffectiveLevel()
        for rank in range(1, spec.world_size):
            conn, child = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main,
                args=(config, spec, rank, child, level),
                name=f"sluice-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            child.close()  # only the worker holds its end: its death is our EOF
            self.processes.append(process)
            self.conns.append(conn)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def expect(self, kind: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for every worker's `kind` message; a failure or death is an error."""
        deadline = time.monotonic() + timeout_s
        for rank, (conn, process) in enumerate(zip(self.conns, self.processes, strict=True), 1):
            while not conn.poll(0.1):
                if not process.is_alive():
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} exited (code {process.exitcode}) "
                        f"before it was {kind}"
                    )
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} not {kind} in time")
            try:
                got, detail = _recv(conn)
            except (EOFError, OSError) as exc:
                raise TensorParallelError(f"tensor-parallel rank {rank} died") from exc
            if got != kind:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed:\n{detail}")

    def _broadcast(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone") from exc

    def build(self, build: WorkerBuild) -> None:
        self._broadcast(build)

    def run_step(self, inputs: StepInputs) -> None:
        self._broadcast(("step", inputs))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._broadcast(("copy", copies))

    def load_lora(self, loads: list[tuple[int, LoRAAdapter]]) -> None:
        self._broadcast(("lora", loads))

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to stop and join them (killed if they do not exit)."""
        for conn in self.conns:
            try:
                _send(conn, ("stop", None))
            except OSError:
                pass  # already gone
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("tensor-parallel worker %s did not exit: killing it", process.pid)
                process.kill()
                process.join(5)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.processes = []


@dataclass(frozen=True)
class TensorParallelRanks:
    """Rank 0's side of a running group: the worker processes and the collectives."""

    workers: TensorParallelWorkers
    group: TPGroup

    def close(self) -> None:
        self.workers.close()
        self.group.close()


def start_tensor_parallel(config: EngineConfig, build: WorkerBuild) -> TensorParallelRanks:
    """Start ranks 1..N-1 (each loads the checkpoint and keeps its slice, then builds
    its runner from `build`) and join their group as rank 0. KV blocks: every rank has
    `build.layout.num_blocks`, of its own heads, so kv_cache_memory is the group's
    total. The caller builds rank 0's runner, then waits for the workers' "ready"."""
    if torch.distributed.is_initialized():
        raise TensorParallelError(
            "this process already runs a tensor-parallel group (one per process): "
            "shut the other engine down first (LLM.shutdown())"
        )
    spec = make_spec(config.tensor_parallel_size, build.options.device, settings.tp_allreduce())
    workers = TensorParallelWorkers(config, spec)
    try:
        workers.expect("loaded")
        workers.build(build)
        group = join_group(spec, 0, workers.alive)
    except BaseException:
        workers.close(timeout_s=2.0)
        remove_spec_files(spec)
        raise
    logger.info(
        "tensor parallel: %d ranks, all-reduce over %s, %d torch threads each",
        spec.world_size,
        spec.allreduce,
        config.rank_threads(),
    )
    return TensorParallelRanks(workers, group)
