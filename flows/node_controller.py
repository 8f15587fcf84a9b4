"""A node controller: ``python -m flows.node_controller`` runs one node's DP-group controllers.

Started by the training run (``flows/nodes.py``) with the engine hosts' arguments and READY
line (``engines.wire.launch.HostProcess``), it listens on ``controllers.bind`` for the run's
commands, authenticated with the run's secret, JSON only (``engines/wire/channel.py``):
``node_connect`` opens its own channels to its groups' hosts; each ``node_iteration`` runs those
groups' ``dp-group`` sub-flows concurrently on this process's event loop, as children of the
run's node task, and answers with their ``GroupStep`` records. It exits with the run: on
``shutdown`` (closing its host channels), or when the run's process or connection is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import threading

from engines.host import faults
from engines.host.lifeline import exit_with_parent
from engines.host.process import advertised_address
from engines.wire.channel import Door, answer, connect, disconnect, progress
from flows.nodes import NodeConnect, NodeConnectResult, NodeIteration, NodeIterationResult



@functools.cache
def _tracking_task():
    """The task an in-process sub-flow is tracked by in its parent flow run (as Prefect's flow engine makes it)."""
    from prefect import Task

    from flows.training import dp_group

    task = Task(name=dp_group.name, fn=dp_group.fn, version=dp_group.version)
    setattr(task, "_is_subflow_tracking_task", True)
    return task


_client: list = []  # the node's one Prefect client context, entered once on the node's loop


async def warm_client():
    """This node controller's one Prefect client, kept open across iterations and made current here so that
    every sub-flow engine started from this task uses it (``AsyncClientContext.get_or_create``). Each run of
    a sub-flow outside a client context makes its own client, and each new client builds an SSL context (it
    loads the CA bundle): that was half a node controller's CPU per group (py-spy at 256 groups). In one
    process the sub-flows share the training run's client the same way."""
    from prefect.context import AsyncClientContext

    if not _client:
        context = AsyncClientContext()
        await context.__aenter__()  # never left: it lives as long as this process and its loop
        _client.append(context)
    AsyncClientContext.__var__.set(_client[0])
    return _client[0].client


async def run_groups(request: NodeIteration) -> NodeIterationResult:
    """The groups' ``dp-group`` sub-flows, concurrently; a lost host is reported, not raised (the
    run heals from it), any other failure fails the node task with its traceback."""
    from prefect.flow_engine import run_flow_async
    from prefect.states import Pending

    from flows.training import _host_lost, dp_group

    r = request
    params = [dict(plan=r.plan, step=r.step, group=g, cursor=r.cursors[i], checkpoint=r.checkpoint, written=r.written,
                   sampling=r.sampling[i]) for i, g in enumerate(r.groups)]
    client = await warm_client()

    async def create(p: dict):
        # as an in-process sub-flow is linked: a tracking task run in the iteration flow run (made through the
        # API, so it exists before its child), so the UI shows the same tree as with one controller process
        name = f"iteration-{r.step:04d}-dp-{p['group']}"
        parent = await client.create_task_run(_tracking_task(), flow_run_id=r.parent, dynamic_key=name, name=name,
                                              state=Pending()) if r.parent else None
        return await client.create_flow_run(dp_group, name=name, parameters=dp_group.serialize_parameters(p),
                                            state=Pending(), parent_task_run_id=parent.id if parent else None)
    flow_runs = await asyncio.gather(*(create(p) for p in params))
    runs = [asyncio.ensure_future(run_flow_async(dp_group, flow_run=fr, parameters=p)) for fr, p in zip(flow_runs, params)]
    try:
        groups = await asyncio.gather(*runs)
    except Exception as e:
        for run in runs:  # a failed group fails the step (as in one process): the others stop
            run.cancel()
        if _host_lost(e):
            return NodeIterationResult(groups=[], lost=str(e).splitlines()[-1] if str(e) else type(e).__name__)
        raise
    return NodeIterationResult(groups=list(groups))


async def _beat(done: asyncio.Event) -> None:
    """Progress for the run's watchdog while the event loop turns (a blocked loop stops it)."""
    while not done.is_set():
        progress()
        await asyncio.sleep(0.5)


def _handle(loop: asyncio.AbstractEventLoop, connected: dict, request):
    if isinstance(request, NodeConnect):
        secret = bytes.fromhex(request.secret)
        for rank, address, port in request.hosts:
            connect(request.run, rank, (address, port), secret, request.timeout_s, request.stage_s, request.layout)
        connected["run"], connected["ranks"] = request.run, [r for r, _, _ in request.hosts]
        return NodeConnectResult(groups=sorted({request.layout.group(r) for r in connected["ranks"]}))
    if isinstance(request, NodeIteration):
        faults.inject("node_iteration", request.step, connected["node"])  # a node that dies, for tests (engines/host/faults.py)

        async def step():
            done = asyncio.Event()
            beat = asyncio.ensure_future(_beat(done))
            try:
                return await run_groups(request)
            finally:
                done.set()
                await beat
        return asyncio.run_coroutine_threadsafe(step(), loop).result()
    raise ValueError(f"a node controller does not run '{request.stage}'")


def main() -> None:
    parser = argparse.ArgumentParser(description="yattflow node controller (started by the training run)")
    parser.add_argument("--rank", type=int, required=True, help="this node's index")
    parser.add_argument("--world", type=int, required=True, help="node controllers in the run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args()
    secret = bytes.fromhex(os.environ.pop("YATTFLOW_HOST_SECRET"))
    exit_with_parent()
    loop = asyncio.new_event_loop()  # one loop for the run: Prefect's clients and the host calls live on it
    threading.Thread(target=loop.run_forever, name="node-loop", daemon=True).start()
    connected: dict = {"node": args.rank}
    door = Door(args.bind, secret)
    with contextlib.closing(door):
        print(f"READY {advertised_address(args.bind)}:{door.port} 0", flush=True)
        os.dup2(2, 1)
        answer(door.next(), functools.partial(_handle, loop, connected), args.rank)
    # the run said shutdown: end this node's host channels (their shutdown ends only this connection). A
    # connection that dropped instead (SystemExit above) leaves them to drop too: the hosts exit, a lost node.
    if "run" in connected:
        disconnect(connected["run"], max(connected["ranks"]) + 1)


if __name__ == "__main__":
    main()
