"""The engine-host process: ``python -m engines.host`` serves one DP group.

The DP-group sub-flow is the controller; the host is the muscle. Each Prefect task sends one
request (``engines/wire/commands.py``) over the host's channel (``engines/wire/channel.py``); the
host's ``Worker`` (``engines/host/worker.py``) reads the inputs from object storage, computes,
writes its outputs atomically and answers with a typed result. ``engines/wire/launch.py`` starts
hosts. The hosts of one run form a ``torch.distributed`` group (NCCL when the trainer is on CUDA,
gloo on CPU), so the train step is a real collective (``engines/backends/distributed.py``).
"""


from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import signal
import socket
import threading

import psutil

from engines.host import faults
from engines.wire.channel import Door, HostError, answer, progress


EVERY_INTERFACE = ("0.0.0.0", "::", "")

# What every rank's first request reaches for (rank 0's input check, the other ranks' engine loading):
# transformers' Auto classes, 2.5-3 s to import on a 2-core CPU. Imported before READY, a run's hosts import
# them side by side; left to the first request, the other ranks' imports came after rank 0's check
# (a deployment's dp=2 run on the torch engines reached its first step in 7.3 s instead of 11.4 s: docs/benchmarks.md).
ENGINE_LIBRARIES = ("transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto",
                    "transformers.models.auto.modeling_auto")


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
    from engines.backends.base import on_progress
    from engines.host.worker import Worker  # torch and the engines' imports: after the parent watch is up

    for module in ENGINE_LIBRARIES:
        importlib.import_module(module)

    secret = bytes.fromhex(os.environ.pop("YATTFLOW_HOST_SECRET"))
    on_progress(progress)  # the engines' progress beats the channel's heartbeat
    pin_interface(bind)
    # Rank 0 serves the DP group's rendezvous. Its socket is bound and listening from now on, so
    # the port READY announces stays ours until the setup hands the socket to the store.
    rendezvous = socket.create_server((bind, 0)) if rank == 0 and world > 1 else None
    worker = Worker(rank, world, threads, rendezvous)
    door = Door(bind, secret)
    with contextlib.closing(door):
        address = advertised_address(bind)
        dist_port = rendezvous.getsockname()[1] if rendezvous else 0
        print(f"READY {address}:{door.port} {dist_port}", flush=True)
        # Nobody reads our stdout after READY: send whatever comes later (engine libraries and
        # the processes they spawn write there) to stderr, so a full pipe can never block us.
        os.dup2(2, 1)
        handle = functools.partial(_handle, worker, {}, threading.Lock())
        first = door.next()
        # later connections: a node controller's (controllers.groups_per_node), or the rollout lane
        # (rollout.max_staleness >= 1: rollout, scoring and filtering beside the run's train step)
        threading.Thread(target=_more_connections, args=(door, worker, handle, rank), name="more-connections",
                         daemon=True).start()
        answer(first, handle, rank)


def _more_connections(door: Door, worker, handle, rank: int) -> None:
    """After the run's own connection: its node controller's (``controllers.groups_per_node``) or
    its rollout lane (``rollout.max_staleness``), authenticated with the same secret, each answered
    on a thread of its own. Its ``shutdown`` ends only that connection. A node controller that goes
    away without one is a lost node, so the host exits as it does when the run's connection drops
    (the run heals from its checkpoint); a rollout lane that closes leaves the host to the run's
    connection."""
    while True:  # until the process exits
        threading.Thread(target=_answer_more, args=(door.next(), worker, handle, rank), daemon=True).start()


def _answer_more(conn, worker, handle, rank: int) -> None:
    try:
        answer(conn, handle, rank)
    except SystemExit:
        if worker.config is not None and worker.config.controllers.groups_per_node:
            os.killpg(0, signal.SIGKILL)  # this host and its engines' processes, as ``lifeline.exit_with_parent`` does


def _handle(worker, seen: dict, lock: threading.Lock, request):
    """``worker.handle``, after the fault ``YATTFLOW_FAULTS`` plans for this point, if any (engines/host/faults.py).
    A request without a step (``sync_weights``, ``checkpoint``) belongs to the step of the last one with
    on the same connection: with overlapping steps the rollout lane is already a step ahead, and a
    fault planned for step n's sync must fire there, not wherever the lanes' race leaves it.
    One command at a time, whichever connection sent it, unless the run overlaps steps
    (``rollout.max_staleness``): then the rollout lane's commands run beside the train step, the
    worker's own locks keeping each chunk on one policy version (docs/off-policy.md)."""
    overlapping = worker.config is not None and worker.config.rollout.max_staleness > 0
    with contextlib.nullcontext() if overlapping else lock:
        lane = threading.get_ident()  # each connection is answered on a thread of its own
        if getattr(request, "step", None) is not None:
            seen[lane] = request.step
        faults.inject(request.stage, seen.get(lane), worker.name)
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
