"""The processes of a tensor-parallel engine: the engine process is rank 0 and starts ranks 1..N-1 as processes
of their own (`python -m specserve.engine.tp_worker`), then all join one torch.distributed group: NCCL on GPUs
(one device per rank), gloo on the CPU. Step descriptions travel over a gloo group in either case, host to host,
so a worker never waits on its device to learn the next step.

NVLink multicast (NVLS) stays off in every rank: it is set in the environment before any NCCL communicator exists.
A rank that dies takes the others down (`RankGroup.watch`, `exit_with_parent`) rather than leaving them blocked
in a collective.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Multicast objects and NVLS all-reduce are kept off on every rank (the machines this targets reject them).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Workers wait for the next step as long as the server is idle, so the description group cannot time out on
# an idle server; a dead rank is caught by the watchdogs instead.
IDLE_FOREVER = datetime.timedelta(days=365)
WORKER_MODULE = "specserve.engine.tp_worker"
WATCH_PERIOD_S = 0.2


@dataclass
class RankGroup:
    """This process's place in the tensor-parallel group. `steps` is the gloo group step descriptions travel
    over; `workers` (rank 0 only) the processes of ranks 1..N-1."""

    rank: int
    size: int
    device: torch.device
    steps: object = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    closing: bool = False
    threads: int = 0  # the process's CPU threads before it joined (restored on close)

    def watch(self) -> None:
        """Rank 0: a worker that exits while the group is open ends this process too (exit code 1), so the
        server sees its engine die (`/health` 503, requests in flight get an error) instead of a step that
        waits forever on a collective with a missing rank."""
        def run() -> None:
            while not self.closing:
                for rank, proc in enumerate(self.workers, start=1):
                    if proc.poll() is not None and not self.closing:
                        self.fail(f"tensor-parallel rank {rank} exited (code {proc.returncode})")
                time.sleep(WATCH_PERIOD_S)

        threading.Thread(target=run, daemon=True, name="tp-watchdog").start()

    def fail(self, reason: str) -> None:
        """Ends this process: a group with a missing rank can run no further step."""
        log.error("%s; the engine stops", reason)
        logging.shutdown()
        os._exit(1)

    def close(self, timeout: float = 30.0) -> None:
        """Rank 0, after telling the workers to stop: waits for them and leaves the process group."""
        self.closing = True
        for proc in self.workers:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads:
            torch.set_num_threads(self.threads)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank; on the CPU every rank shares the host."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def start_ranks(size: int, device: torch.device, worker_payload: object) -> RankGroup:
    """Rank 0: starts ranks 1..size-1 with `worker_payload` (pickled to their stdin: what they build from) and
    joins the group with them."""
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tp-size {size} needs {size} GPUs, one per rank; {torch.cuda.device_count()} are visible")
    init = f"tcp://127.0.0.1:{free_port()}"
    payload = pickle.dumps(worker_payload)
    env = {**os.environ, **NO_MULTICAST_ENV}
    workers = []
    for rank in range(1, size):
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(rank), str(size), init, str(os.getpid())],
                                stdin=subprocess.PIPE, env=env)
        proc.stdin.write(payload)
        proc.stdin.close()
        workers.append(proc)
    try:
        group = join_ranks(0, size, init, device)
    except Exception:
        for proc in workers:
            proc.kill()
        raise
    group.workers = workers
    group.watch()
    return group


def join_ranks(rank: int, size: int, init: str, device: torch.device) -> RankGroup:
    """Joins the process group (every rank calls this once); NCCL on a GPU, with a gloo group beside it for the
    step descriptions."""
    os.environ.update(NO_MULTICAST_ENV)
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size, device_id=device)
        steps = dist.new_group(backend="gloo", timeout=IDLE_FOREVER)
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=IDLE_FOREVER)
        steps = dist.group.WORLD
    group = RankGroup(rank, size, device, steps, threads=torch.get_num_threads())
    if device.type == "cpu":  # the ranks share the host's cores; more threads than that only contend
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return group


def agree_min(group: RankGroup, value: int) -> int:
    """The smallest of every rank's `value` (the KV pool's pages: each rank must hold every page rank 0 hands
    out, and free memory may differ between devices)."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.steps)
    return int(t.item())


def rank0_value(group: RankGroup, value: object) -> object:
    """Rank 0's `value` on every rank (startup decisions that must agree, such as kernel timings); a closed
    group's own value."""
    if group.closing or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group.steps)
    return box[0]


def exit_with_parent(parent: int) -> None:
    """Workers: end soon after the engine process (rank 0) is gone, whatever this process is blocked on."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_PERIOD_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def free_port() -> int:
    """A loopback port free now (for a rendezvous, a replica or a router to listen on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
