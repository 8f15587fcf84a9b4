"""Engine hosts: one long-lived process per DP group that keeps its engines resident.

The DP-group sub-flow is the controller; the host is the muscle. Each Prefect task sends one
request (``engines/commands.py``) over the host's channel (``engines/channel.py``); the host's
``Worker`` (``engines/worker.py``) reads the inputs from object storage, computes, writes its
outputs atomically and answers with a typed result.

This module is the process: ``python -m engines.host`` serves one DP group, and ``LocalHosts``
starts, supervises and stops a run's hosts as local subprocesses (``flows/hosts.py`` starts
them as flow runs on a GPU work pool instead). The hosts of one run form a
``torch.distributed`` group (NCCL when the trainer is on CUDA, gloo on CPU), so the train step
is a real collective (``engines/distributed.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

import psutil

from engines import faults
from engines.channel import HostError, answer, connect, disconnect


class HostProcess:
    """One engine-host process, started and read up to its ``READY`` line."""

    def __init__(self, rank: int, world: int, threads: int, secret: bytes, bind: str = "127.0.0.1",
                 devices: str | None = None):
        env = dict(os.environ, YATTFLOW_HOST_SECRET=secret.hex(), OMP_NUM_THREADS=str(threads))
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines flood the run's output
        project_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [project_root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "engines.host", "--rank", str(rank), "--world", str(world),
               "--threads", str(threads), "--bind", bind]
        # Its own process group: engines start processes of their own (vLLM's engine core,
        # checkpoint workers) that ``stop`` sweeps with it.
        self.rank = rank
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


def local_devices(world: int, devices: list[str] | None, gpus: int, visible: str | None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of ``world`` local hosts on a machine with ``gpus`` GPUs
    (``visible``: the parent's CUDA_VISIBLE_DEVICES). ``devices`` (``hosts.devices``) when given;
    else one GPU per host, since NCCL refuses two ranks of one group on one GPU; on the CPU, or
    with one host, each inherits the parent's (None)."""
    if devices is not None:
        return list(devices)
    if world == 1 or gpus == 0:
        return [None] * world
    if gpus < world:
        raise HostError(f"dp={world} local hosts need one GPU each and this machine shows {gpus}: lower dp, "
                        "or set hosts.devices (one CUDA_VISIBLE_DEVICES entry per group)")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return ids[:world]


class LocalHosts:
    """Start, supervise and stop the engine hosts of one run as local subprocesses."""

    def __init__(self, run: str, world: int, threads: int, timeout_s: float, devices: list[str] | None = None,
                 stage_s: float | None = None):
        import torch

        self.run, self.world, self.threads = run, world, threads
        self.timeout_s, self.stage_s = timeout_s, stage_s or timeout_s  # stage_s: the progress watchdog (channel.py)
        self.devices = local_devices(world, devices, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.hosts: list[HostProcess] = []
        self.master: str | None = None  # rank 0's torch.distributed rendezvous, "host:port"

    def __enter__(self) -> "LocalHosts":
        secret = secrets.token_bytes(32)
        try:
            self.hosts = [HostProcess(rank, self.world, self.threads, secret, devices=self.devices[rank])
                          for rank in range(self.world)]
            for h in self.hosts:
                connect(self.run, h.rank, h.wait_ready().address, secret, self.timeout_s, self.stage_s)
            self.master = f"{self.hosts[0].address[0]}:{self.hosts[0].dist_port}"
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
        ``dp-1 (exit code -9)``; [] when all live."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [f"dp-{h.rank} (exit code {h.proc.poll()})" for h in self.hosts if h.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                return dead
            await asyncio.sleep(0.1)


def _exit_with_parent() -> None:
    """A host never outlives the run that started it (no orphaned engines holding devices)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)  # this host and every process its engines started

    threading.Thread(target=watch, daemon=True).start()


EVERY_INTERFACE = ("0.0.0.0", "::", "")


def advertised_address(bind: str) -> str:
    """The address the controller and the other hosts reach this host at."""
    if bind not in EVERY_INTERFACE:
        return bind
    # YATTFLOW_HOST_ADDRESS: set it on nodes whose hostname does not resolve to a routable
    # address (e.g. a Kubernetes pod: the downward API's status.podIP).
    return os.environ.get("YATTFLOW_HOST_ADDRESS") or socket.gethostbyname(socket.gethostname())


def pin_interface(bind: str) -> None:
    """Have gloo's and NCCL's sockets use ``bind``'s network interface.

    Left alone, gloo listens on the address the hostname resolves to and NCCL on an interface of
    its choosing, whatever ``--bind`` says. Set here, before torch.distributed starts, so that the
    engines' own groups (Megatron-Core's, vLLM's processes) get it too; it wins over a value in
    the environment, since the bind address is the promise. Listening everywhere needs nothing."""
    if bind in EVERY_INTERFACE:
        return
    names = [name for name, addresses in psutil.net_if_addrs().items() if any(a.address == bind for a in addresses)]
    if not names:
        raise HostError(f"--bind {bind}: no network interface has this address")
    os.environ["GLOO_SOCKET_IFNAME"] = names[0]
    os.environ["NCCL_SOCKET_IFNAME"] = "=" + names[0]  # "=": this interface, not every name it is a prefix of


def serve(rank: int, world: int, threads: int, bind: str = "127.0.0.1") -> None:
    """Listen on ``bind``, answer one controller's commands until ``shutdown``.

    Nothing of the host listens beyond ``bind``: the channel, rank 0's torch.distributed
    rendezvous and gloo's (NCCL's) sockets all bind there (``pin_interface``).

    A host belongs to one run: if the controller's connection ends without ``shutdown`` (the
    run crashed or was cancelled), the host exits rather than hold its devices.
    """
    from engines.worker import Worker  # torch and the engines' imports: after the parent watch is up

    secret = bytes.fromhex(os.environ.pop("YATTFLOW_HOST_SECRET"))
    _exit_with_parent()
    pin_interface(bind)
    # Rank 0 serves the DP group's rendezvous. Its socket is bound and listening from now on, so
    # the port READY announces stays ours until the setup hands the socket to the store.
    rendezvous = socket.create_server((bind, 0)) if rank == 0 and world > 1 else None
    worker = Worker(rank, world, threads, rendezvous)
    with Listener((bind, 0), authkey=secret) as listener:
        address = advertised_address(bind)
        dist_port = rendezvous.getsockname()[1] if rendezvous else 0
        print(f"READY {address}:{listener.address[1]} {dist_port}", flush=True)
        # Nobody reads our stdout after READY: send whatever comes later (engine libraries and
        # the processes they spawn write there) to stderr, so a full pipe can never block us.
        os.dup2(2, 1)
        answer(listener.accept(), functools.partial(_handle, worker, {}), rank)


def _handle(worker, seen: dict, request):
    """``worker.handle``, after the fault ``YATTFLOW_FAULTS`` plans for this point, if any (engines/faults.py).
    A request without a step (``train_step``, ``sync_weights``) belongs to the step of the last one with."""
    seen["step"] = getattr(request, "step", seen.get("step"))
    faults.inject(request.stage, seen["step"], worker.rank)
    return worker.handle(request)


def main() -> None:
    parser = argparse.ArgumentParser(description="yattflow engine host (started by the training run)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bind", default="127.0.0.1", help="listen address (0.0.0.0: reachable from other nodes)")
    args = parser.parse_args()
    serve(args.rank, args.world, args.threads, args.bind)


if __name__ == "__main__":
    main()
