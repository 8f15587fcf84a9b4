"""Engine hosts as flow runs on a GPU work pool.

With ``hosts.launch: deployment`` the training run does not start its engine hosts itself.
For each DP group (each rank of it, with ``train.tensor_parallel`` > 1: docs/parallelism.md) it
runs the ``engine-host`` deployment on that host's work queue, so a worker on the right node (a
process worker per GPU node, or a Kubernetes pool with ``nvidia.com/gpu`` requests) starts the
host there, pinned to its GPUs:

    train-demo ─┬─ demo-dp-0-host   (queue dp-0, CUDA_VISIBLE_DEVICES=0)  ← host flow runs,
                ├─ demo-dp-1-host   (queue dp-1, CUDA_VISIBLE_DEVICES=1)    alive for the run
                ├─ iteration-0000 ─┬─ iteration-0000-dp-0 ...            ← controllers; their
                │                  └─ iteration-0000-dp-1 ...              tasks call the hosts

Each host flow run registers where it listens in ``{run}/hosts/{session}/dp-{rank}.json``
on the run's object storage; the training run connects to it there. The channel's secret
travels in a Prefect ``Secret`` block made for this run and deleted after it — never in
flow-run parameters, which anyone with the UI can read. A host flow run ends with the
training run: on ``shutdown`` (Completed), or when the training run reaches a final state or
its connection drops (Failed, with the reason).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
import uuid

from prefect import flow, get_run_logger
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.states import Cancelled, Cancelling

from engines.wire.channel import HostError, connect, disconnect
from engines.wire.launch import HostProcess
from engines.config import RunConfig
from storage import objectstore


@flow(name="engine-host", flow_run_name="{run}-dp-{rank}-host")
def engine_host(run: str, rank: int, world: int, registry: str, secret_block: str, controller: str,
                threads: int = 1, bind: str = "0.0.0.0", node: int | None = None, nodes: int = 0, label: str | None = None) -> dict:
    """Serve one DP group's engines (rank ``rank`` of the run's ``world``; ``label``: its name, ``dp-1.1``
    for group 1's second rank) to the training run ``controller`` until it says shutdown.

    ``node``: this host's flow run also runs node controller ``node`` of ``nodes`` (flows/nodes.py:
    the first group of each node's). A worker whose node sets ``YATTFLOW_HOST_BIND`` binds both
    there: one address per node, whatever the run's ``hosts.bind`` says."""
    logger = get_run_logger()
    label = label or f"dp-{rank}"
    secret = bytes.fromhex(Secret.load(secret_block).get())
    bind = os.environ.get("YATTFLOW_HOST_BIND") or bind
    host = HostProcess(rank, world, threads, secret, bind).wait_ready()
    node_controller = None
    if node is not None:
        node_controller = HostProcess(node, nodes, 1, secret, bind, module="flows.node_controller").wait_ready()
        objectstore.write_json(objectstore.join(registry, f"node-{node}.json"),  # before dp-{rank}.json: read after it
                               {"address": node_controller.address[0], "port": node_controller.address[1]})
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = {"address": host.address[0], "port": host.address[1], "dist_port": host.dist_port,
             "hostname": socket.gethostname(), "pid": host.proc.pid, "cuda_visible_devices": devices,
             "flow_run_id": str(flow_run.get_id())}
    objectstore.write_json(objectstore.join(registry, f"dp-{rank}.json"), where)
    logger.info("engine host of run '%s' %s listening at %s:%d on %s, CUDA_VISIBLE_DEVICES=%s",
                run, label, *host.address, where["hostname"], devices)
    reason = None
    try:
        with get_client(sync_client=True) as client:
            while host.proc.poll() is None:
                time.sleep(2)
                state = client.read_flow_run(controller).state
                if state is not None and state.is_final():
                    reason = f"the training run ended ({state.name}) without shutting its hosts down"
                    break
    finally:
        if node_controller is not None:
            node_controller.stop(grace_s=0 if reason else 10)
        code = host.stop(grace_s=0 if reason else 10)
    if reason or code != 0:
        raise HostError(f"engine host {label}: {reason or f'exited with code {code} (its log is in the worker output)'}")
    logger.info("engine host %s shut down", label)
    return {"rank": rank, "hostname": where["hostname"], "cuda_visible_devices": devices}


class DeployedHosts:
    """The controller's side: start one ``engine-host`` flow run per host (per DP group, or per rank of
    each: ``config.layout``), connect to each."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.session = uuid.uuid4().hex[:12]
        self.block = f"yattflow-host-{self.session}"
        self.registry = objectstore.join(config.run_uri, "hosts", self.session)
        self.runs: list = []  # the host flow runs, by rank
        self.layout = config.layout
        self.master: str | None = None  # rank 0's torch.distributed rendezvous, "host:port"

    async def __aenter__(self) -> "DeployedHosts":
        cfg, h, layout = self.config, self.config.hosts, self.layout
        self.secret = secret = secrets.token_bytes(32)  # node controllers (flows/nodes.py) connect with it too
        await Secret(value=secret.hex()).asave(self.block)
        try:
            controller = str(flow_run.get_id())
            self.runs = await asyncio.gather(*(
                run_deployment(
                    h.deployment, timeout=0, flow_run_name=f"{cfg.name}-{layout.name(r)}-host",
                    work_queue_name=self._queue(r),
                    job_variables={"env": {"CUDA_VISIBLE_DEVICES": h.devices[r]}} if h.devices else None,
                    parameters={"run": cfg.name, "rank": r, "world": layout.world, "registry": self.registry,
                                "secret_block": self.block, "controller": controller, "threads": cfg.threads_per_host,
                                "bind": h.bind, "label": layout.name(r), **self._node_of(r)},
                ) for r in range(layout.world)))
            where = await self._registered()
            for r, w in enumerate(where):
                connect(cfg.name, r, (w["address"], w["port"]), secret, cfg.host_timeout_s, cfg.timeouts.stage_s, layout)
            self.master = f"{where[0]['address']}:{where[0]['dist_port']}"
            self.addresses = [(w["address"], w["port"]) for w in where]
            self.node_addresses = [(n["address"], n["port"]) for n in (
                objectstore.read_json(objectstore.join(self.registry, f"node-{k}.json"))
                for k in range(len(cfg.controllers.nodes(cfg.dp))))] if cfg.controllers.groups_per_node else None
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _queue(self, rank: int) -> str:
        return self.config.hosts.work_queue.format(group=self.layout.group(rank), rank=rank, local=self.layout.local(rank))

    def _node_of(self, rank: int) -> dict:
        """The node controller a host flow run starts beside it: the leader's of each node's first group."""
        per, group = self.config.controllers.groups_per_node, self.layout.group(rank)
        if not per or group % per or self.layout.local(rank):
            return {}
        return {"node": group // per, "nodes": len(self.config.controllers.nodes(self.config.dp))}

    async def _registered(self) -> list[dict]:
        """Wait for every host's registration; fail early if a host flow run ends first."""
        logger = get_run_logger()
        h = self.config.hosts
        name = self.layout.name
        files = [objectstore.join(self.registry, f"dp-{r}.json") for r in range(self.layout.world)]
        deadline = time.monotonic() + h.start_timeout_s
        next_note = time.monotonic() + 30
        async with get_client() as client:
            while True:
                waiting = [r for r, f in enumerate(files) if not objectstore.exists(f)]
                if not waiting:
                    return [objectstore.read_json(f) for f in files]
                for r in waiting:
                    state = (await client.read_flow_run(self.runs[r].id)).state
                    if state is not None and state.is_final():
                        raise HostError(f"{name(r)}: engine-host flow run '{self.runs[r].name}' ended {state.name} before "
                                        f"it registered: {state.message}")
                if time.monotonic() > deadline:
                    r = waiting[0]
                    state = (await client.read_flow_run(self.runs[r].id)).state
                    raise HostError(
                        f"{name(r)}: engine-host flow run '{self.runs[r].name}' not up within hosts.start_timeout_s="
                        f"{h.start_timeout_s:.0f}s (state {state.name if state else None}); is a worker polling work queue "
                        f"'{self._queue(r)}' of the pool that deployment '{h.deployment}' runs on?")
                if time.monotonic() > next_note:
                    next_note += 30
                    logger.info("waiting for engine hosts %s to start", ", ".join(name(r) for r in waiting))
                await asyncio.sleep(1)

    async def lost(self, grace_s: float = 5.0) -> list[str]:
        """The host flow runs that ended (a host flow run notices its process died within 2 s:
        ``engine_host`` polls it), as ``dp-1 (Failed: …)``; [] when all run."""
        deadline = time.monotonic() + grace_s
        async with get_client() as client:
            while True:
                states = [(await client.read_flow_run(r.id)).state for r in self.runs]
                ended = [f"{self.layout.name(r)} ({s.name}: {s.message})" for r, s in enumerate(states)
                         if s is not None and s.is_final()]
                if ended or time.monotonic() > deadline:
                    return ended
                await asyncio.sleep(0.5)

    async def __aexit__(self, *exc) -> None:
        disconnect(self.config.name, self.layout.world)  # each host answers 'shutdown' and exits
        async with get_client() as client:
            deadline = time.monotonic() + 60
            pending = list(self.runs)
            while pending:
                states = [(await client.read_flow_run(r.id)).state for r in pending]
                for r, s in zip(pending, states):
                    if s is None or s.is_scheduled():  # no worker took it: no process to wait for or to stop
                        await client.set_flow_run_state(r.id, Cancelled(message="the training run has ended"), force=True)
                pending = [r for r, s in zip(pending, states) if s is not None and not s.is_scheduled() and not s.is_final()]
                if not pending or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)  # started hosts end on their own after the shutdown
            for r in pending:  # stuck: cancel it (the worker kills its process)
                await client.set_flow_run_state(r.id, Cancelling(message="the training run has ended"), force=True)
        try:
            await Secret.adelete(self.block)
        except Exception:  # noqa: BLE001 - a leftover secret of an ended run is harmless; never mask the run's error
            get_run_logger().warning("could not delete secret block %s", self.block)
        objectstore.remove(self.registry)


def engine_hosts(config: RunConfig):
    """The engine hosts of this run, as an ``async with`` context: local subprocesses or deployed flow runs."""
    from engines.wire.launch import LocalHosts

    if config.hosts.launch == "deployment":
        return DeployedHosts(config)
    return LocalHosts(config.name, config.layout, config.threads_per_host, config.host_timeout_s, config.hosts.devices,
                      config.timeouts.stage_s, fork=config.hosts.fork,
                      node_controllers=bool(config.controllers.groups_per_node))
