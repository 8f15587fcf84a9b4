"""Starting engine hosts: the controller's side of ``python -m engines.host``.

``HostProcess`` starts one engine-host process and reads its ``READY`` line; ``LocalHosts``
starts, supervises and stops a run's hosts as local subprocesses (``flows/hosts.py`` starts them
as flow runs on a GPU work pool instead, each of which starts a ``HostProcess``). Nothing here
imports an engine: a controller that starts hosts loads no model.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from engines.config.layout import Layout
from engines.wire.channel import HostError, connect, disconnect


# What a host's engine libraries write goes to the run's console (the host's stderr is the command's), so
# by default they say little (the environment overrides each): vLLM's INFO lines flooded it, and each C++
# warning of torch prints its whole stack, e.g. 14 frames for every bad message a stranger sends to rank 0's
# rendezvous port (TCPStore: "Error processing client message"; 90 lines seen). C++ errors still print.
QUIET_ENGINES = {"VLLM_LOGGING_LEVEL": "WARNING", "TORCH_CPP_LOG_LEVEL": "ERROR"}
# The variables the engine libraries a fork server imported read as they were imported, and PYTHONPATH (a
# sitecustomize on it runs as the interpreter starts): a change starts a new one.
IMPORT_TIME = ("PREFECT_", "HF_", "TRANSFORMERS_", "TORCH", "OMP_", "MKL_", "CUDA_", "VLLM_", "ARROW_", "PYTHONPATH")


def host_environment(secret: bytes, threads: int, devices: str | None = None) -> dict[str, str]:
    """The environment of an engine host (or node controller) that this process starts."""
    env = QUIET_ENGINES | dict(os.environ, YATTFLOW_HOST_SECRET=secret.hex(), OMP_NUM_THREADS=str(threads),
                               YATTFLOW_PARENT_PID=str(os.getpid()))  # engines/host/lifeline.py: the host goes when we do
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    project_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [project_root, env.get("PYTHONPATH")]))
    return env


class HostProcess:
    """One engine-host process, started and read up to its ``READY`` line."""

    def __init__(self, rank: int, world: int, threads: int, secret: bytes, bind: str = "127.0.0.1",
                 devices: str | None = None, module: str = "engines.host", forkserver=None):
        env = host_environment(secret, threads, devices)
        # module: the engine host, or a node controller (flows/node_controller.py: the same arguments and READY line)
        cmd = [sys.executable, "-m", module, "--rank", str(rank), "--world", str(world),
               "--threads", str(threads), "--bind", bind]
        # Its own process group: engines start processes of their own (vLLM's engine core,
        # checkpoint workers) that ``stop`` sweeps with it.
        self.rank = rank
        if forkserver is not None:  # forked from one process that imported the engines once (engines/wire/forkserver.py)
            self.proc = forkserver.spawn(module, cmd[3:], env)
        else:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.address: tuple[str, int] | None = None
        self.dist_port: int | None = None

    def wait_ready(self) -> "HostProcess":
        """Block until the host listens: its first line is ``READY host:port dist_port``
        (``dist_port``: rank 0's rendezvous port when world > 1, else 0)."""
        line = self.proc.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            raise HostError(f"dp-{self.rank}: engine host failed to start (exit code {self.proc.poll()})")
        host, port = line[1].rsplit(":", 1)
        self.address, self.dist_port = (host, int(port)), int(line[2])
        return self

    def stop(self, grace_s: float = 10) -> int:
        """Wait up to ``grace_s`` for it to exit, then kill its whole process group; its exit code."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait()


def gpu_count() -> int:
    """The GPUs this process may use: 0 where no NVIDIA driver is loaded (a CPU machine's controller imports
    no torch to learn it), else torch's count (CUDA_VISIBLE_DEVICES applied)."""
    if not Path("/proc/driver/nvidia").exists():
        return 0
    import torch

    return torch.cuda.device_count()


def local_devices(world: int, devices: list[str] | None, gpus: int, visible: str | None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of ``world`` local hosts on a machine with ``gpus`` GPUs
    (``visible``: the parent's CUDA_VISIBLE_DEVICES). ``devices`` (``hosts.devices``) when given;
    else one GPU per host (per rank of a DP group too), since NCCL refuses two ranks of one group on
    one GPU; on the CPU, or with one host, each inherits the parent's (None)."""
    if devices is not None:
        return list(devices)
    if world == 1 or gpus == 0:
        return [None] * world
    if gpus < world:
        raise HostError(f"{world} local hosts need one GPU each and this machine shows {gpus}: lower dp (or "
                        "train.tensor_parallel), or set hosts.devices (one CUDA_VISIBLE_DEVICES entry per host)")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return ids[:world]


def with_replica_devices(layout: Layout, devices: list[str | None]) -> list[str | None]:
    """Each host's devices, where a rank that holds a rollout engine or judge over several ranks
    (vLLM's tensor parallelism: ``rollout.tensor_parallel``) also sees the devices of the replica's
    other ranks, its own first (its trainer's ``cuda:0``; vLLM's workers take the first ones)."""
    out = list(devices)
    for rank, own in enumerate(devices):
        local = layout.local(rank)
        span = max([tp for role, tp in (("rollout", layout.rollout_tp), ("judge", layout.judge_tp))
                    if local in layout.serving(role)], default=1)
        if span > 1 and own is not None:
            out[rank] = ",".join(devices[rank + i] for i in range(span))
    return out


_forkserver: dict = {}  # this process's fork server ("server") and the environment it was started with ("imported")


def shared_forkserver(node_controllers: bool = False):
    """This process's fork server (``hosts.fork``), started for its first run's hosts and kept for the run's heals
    and any later run of the process: a host then starts in ~0.1 s instead of importing the engines again. A
    new one replaces it when it is gone, lacks the node controllers' imports a run needs, or the engine libraries'
    environment changed (what they read as they were imported)."""
    from engines.wire.forkserver import HOST_MODULES, NODE_CONTROLLER_MODULES, ForkServer

    env = QUIET_ENGINES | dict(os.environ)
    imported = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}
    preload = HOST_MODULES + (NODE_CONTROLLER_MODULES if node_controllers else ())
    server = _forkserver.get("server")
    if server is not None and (_forkserver["imported"] != imported or server.proc.poll() is not None
                               or not set(preload) <= set(server.preload)):
        stop_forkserver()
    if "server" not in _forkserver:
        _forkserver.update(server=ForkServer(env, preload), imported=imported)  # (its children run the torch it imported)
    return _forkserver["server"]


@atexit.register
def stop_forkserver() -> None:
    """Stop this process's fork server, if it has one (at exit, or before a replacement)."""
    server = _forkserver.pop("server", None)
    _forkserver.clear()
    if server is not None:
        server.stop()


class LocalHosts:
    """Start, supervise and stop the engine hosts of one run as local subprocesses: one per rank of
    ``layout`` (a number: that many groups of one rank)."""

    def __init__(self, run: str, layout: Layout | int, threads: int, timeout_s: float, devices: list[str] | None = None,
                 stage_s: float | None = None, fork: bool = False, node_controllers: bool = False):
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.run, self.world, self.threads = run, self.layout.world, threads
        self.timeout_s, self.stage_s = timeout_s, stage_s or timeout_s  # stage_s: the progress watchdog (channel.py)
        self.devices = with_replica_devices(self.layout, local_devices(self.world, devices, gpu_count(),
                                                                       os.environ.get("CUDA_VISIBLE_DEVICES")))
        self.hosts: list[HostProcess] = []
        self.master: str | None = None  # rank 0's torch.distributed rendezvous, "host:port"
        # hosts.fork: the node controllers (flows/nodes.py) are forked from it too
        self.forkserver = shared_forkserver(node_controllers) if fork else None

    def __enter__(self) -> "LocalHosts":
        self.secret = secret = secrets.token_bytes(32)  # node controllers (flows/nodes.py) connect with it too
        try:
            self.hosts = [HostProcess(rank, self.world, self.threads, secret, devices=self.devices[rank],
                                      forkserver=self.forkserver)
                          for rank in range(self.world)]
            for h in self.hosts:
                connect(self.run, h.rank, h.wait_ready().address, secret, self.timeout_s, self.stage_s, self.layout)
            self.master = f"{self.hosts[0].address[0]}:{self.hosts[0].dist_port}"
            self.addresses = [h.address for h in self.hosts]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type=None, *exc) -> None:
        if exc_type is not None:  # a failed run: hosts may be hung or mid-collective, so no polite shutdown
            for h in self.hosts:
                h.stop(grace_s=0)
        disconnect(self.run, self.world)
        for h in self.hosts:
            h.stop()

    async def __aenter__(self) -> "LocalHosts":
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__(*exc)

    async def lost(self, grace_s: float = 2.0) -> list[str]:
        """The hosts that died (waiting up to ``grace_s`` for one that is on its way out), as
        ``dp-1 (exit code -9)`` (``dp-1.1``: the group's second rank); [] when all live."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [f"{self.layout.name(h.rank)} (exit code {h.proc.poll()})" for h in self.hosts if h.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                return dead
            await asyncio.sleep(0.1)
