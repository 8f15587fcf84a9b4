"""Node controllers: the DP groups' controllers spread over one process per node.

With ``controllers.groups_per_node: N`` the training run starts, beside its engine hosts, one
node-controller process per N groups (``flows/node_controller.py``). Each iteration then does one
task per node; the node controller runs its groups' ``dp-group`` sub-flows — the same flow,
waves, carry-over and stage tasks as in one process, each group its own controller — as children
of that task, and answers with the groups' small ``GroupStep`` records:

    train ─┬─ iteration-0000 ─┬─ node 0 (task) ─┬─ iteration-0000-dp-0 ─ rollout → … → sync_weights   ← node controller 0
           │                  │                 └─ iteration-0000-dp-1 …
           │                  └─ node 1 (task) ─┬─ iteration-0000-dp-2 …                               ← node controller 1

So the training run's own Prefect work per iteration grows with the nodes, not the groups; the
per-group work (a sub-flow and its stage tasks: ~0.3-0.5 s of CPU per group, ``bench/scale.py``)
runs on the nodes' CPUs. Sample data never passes through either: a node controller holds what
the training run held, URIs and metrics. The node controller talks to its groups' hosts on
connections of its own (a host answers its run and its node controller, one command at a time:
``engines/host/process.py``); the training run keeps its own for setup, evaluation, export and
checkpoint commits. A node controller that dies takes its hosts with it: a lost host, healed
from the last checkpoint (``retries.run``).
"""

from __future__ import annotations

import asyncio
import contextlib

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from engines.config import RunConfig
from engines.config.layout import Layout
from engines.wire.channel import HostClient, HostLost
from engines.wire.commands import Request, Result
from engines.wire.launch import HostProcess
from flows.metrics import GroupStep
from flows.plan import GroupPlan


class NodeConnectResult(Result):
    groups: list[int]


class NodeConnect(Request):
    """Open the node controller's own channels to its groups' engine hosts."""

    stage = "node_connect"
    result = NodeConnectResult
    run: str
    hosts: list[tuple[int, str, int]]  # (rank, address, port) of each rank of its groups
    layout: Layout  # the run's ranks (engines/config/layout.py)
    secret: str  # the hosts' channel secret, hex (this channel is authenticated with the node's own)
    timeout_s: float
    stage_s: float


class NodeIterationResult(Result):
    groups: list[GroupStep]
    lost: str | None = None  # a host of this node was lost (``HostLost``): the run heals from its checkpoint


class NodeIteration(Request):
    """Run these groups' ``dp-group`` sub-flows for one step, as children of task run ``parent``."""

    stage = "node_iteration"
    result = NodeIterationResult
    plan: GroupPlan
    step: int
    groups: list[int]
    cursors: list[int]
    checkpoint: str | None = None
    written: int | None = None
    sampling: list[dict | None]
    parent: str | None = None  # the iteration's flow run id: the sub-flows show under it in the UI, as in one process


_nodes: dict[tuple[str, int], HostClient] = {}


@contextlib.asynccontextmanager
async def node_controllers(config: RunConfig, hosts):
    """Start the run's node controllers and connect them to their groups' ``hosts`` (started ones:
    ``flows.hosts.engine_hosts``); nothing when ``controllers.groups_per_node`` is unset."""
    c = config.controllers
    if not c.groups_per_node:
        yield
        return
    if not PREFECT_API_URL.value():
        raise ValueError("controllers.groups_per_node: node controllers report to a Prefect server, and this run has none "
                         "(set PREFECT_API_URL, e.g. to `yattflow server`'s or `yattflow stack`'s API)")
    nodes = c.nodes(config.dp)
    # deployed hosts: each node's first host flow run started its node controller on that node (flows/hosts.py);
    # local hosts: the node controllers are this process's children, on controllers.bind
    deployed = getattr(hosts, "node_addresses", None)
    procs = [] if deployed else [HostProcess(k, len(nodes), 1, hosts.secret, c.bind, module="flows.node_controller",
                                             forkserver=getattr(hosts, "forkserver", None)) for k in range(len(nodes))]
    try:
        for k in range(len(nodes)):
            if not deployed:
                await asyncio.wait_for(asyncio.to_thread(procs[k].wait_ready), c.start_timeout_s)
            address = deployed[k] if deployed else procs[k].address
            _nodes[(config.name, k)] = HostClient(address, hosts.secret, k, float("inf"), config.timeouts.stage_s,
                                                  label=f"node-{k}")
        await asyncio.gather(*(asyncio.to_thread(_nodes[(config.name, k)].call, NodeConnect(
            run=config.name, hosts=[(r, *hosts.addresses[r]) for g in groups for r in config.layout.ranks(g)],
            layout=config.layout, secret=hosts.secret.hex(),
            timeout_s=config.host_timeout_s, stage_s=config.timeouts.stage_s)) for k, groups in enumerate(nodes)))
        get_run_logger().info("%d node controllers of %s DP groups each, at %s", len(nodes), c.groups_per_node,
                              ", ".join("{}:{}".format(*_nodes[(config.name, k)].address) for k in range(len(nodes))))
        yield
    finally:
        for k in range(len(nodes)):
            node = _nodes.pop((config.name, k), None)
            if node is not None:
                node.end()  # shutdown: the node controller closes its host channels and exits
        for proc in procs:
            proc.stop(grace_s=10)


@task(name="node-controller", task_run_name="node {node}: dp {groups}", cache_policy=NO_CACHE, persist_result=False)
async def node_step(plan: GroupPlan, step: int, node: int, groups: list[int], cursors: list[int], checkpoint: str | None,
                    written: int | None, sampling: list[dict | None]) -> list[GroupStep]:
    """One step of ``groups`` on node controller ``node``; their ``GroupStep`` records."""
    request = NodeIteration(plan=plan, step=step, groups=groups, cursors=cursors, checkpoint=checkpoint, written=written,
                            sampling=sampling, parent=flow_run.id)
    from tasks._host import _CALLS

    result, logs = await asyncio.get_running_loop().run_in_executor(_CALLS, _nodes[(plan.run.name, node)].call, request)
    logger = get_run_logger()
    for line in logs:
        logger.info(line)
    if result.lost:
        raise HostLost(f"node-{node}: {result.lost}")
    return result.groups


async def run_on_nodes(config: RunConfig, plan: GroupPlan, step: int, cursors: list[int], checkpoint: str | None,
                       written: int | None, sampling: list[dict | None] | None) -> list[GroupStep]:
    """Every group's step, one node task per node controller; the groups' records in group order."""
    sampling = sampling or [None] * config.dp
    runs = [asyncio.ensure_future(node_step(plan, step, k, g, [cursors[i] for i in g], checkpoint, written,
                                            [sampling[i] for i in g]))
            for k, g in enumerate(config.controllers.nodes(config.dp))]
    try:
        parts = await asyncio.gather(*runs)
    except BaseException:
        for r in runs:
            r.cancel()
        raise
    return sorted((g for part in parts for g in part), key=lambda g: g.group)
