"""How a task talks to its DP group's engine host."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from prefect import get_run_logger

from engines.wire.channel import HostError, client
from engines.wire.commands import Request, Result

# The threads that wait for host answers. Not asyncio's default executor: it has cpu_count + 4
# threads (6 on 2 cores), and a collective command (setup's rendezvous, train_step's all-reduce)
# returns only once *every* group's command reached its host, so with more DP groups than threads
# the calls that got a thread wait forever for those that did not (found at dp=16 with timing-stub
# engines, bench/scale.py). One thread per call in flight; threads are made only when needed.
_CALLS = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="yattflow-host-call")


async def call_host(run: str, group: int, request: Request, lane: str | None = None) -> Result:
    """Send ``request`` to the group's host without blocking the event loop, replay the host's
    log lines into this task's log (so they show in the Prefect UI), and return its result.

    A failed command keeps its inputs: the task's log and the exception (the failed state's
    message in the UI) name the stage, the group and the request's fields — URIs, step, wave,
    cursor; never sample data — followed by the host's own error. ``lane``: the host's rollout lane
    (``engines.wire.channel.client``), for the stages that overlap a train step."""
    logger = get_run_logger()
    try:
        result, logs = await asyncio.get_running_loop().run_in_executor(_CALLS, client(run, group, lane).call, request)
    except HostError as e:
        inputs = describe_call(run, group, request)
        for line in e.logs:
            logger.info(line)
        logger.error("engine host command failed: %s\n%s\n%s", inputs, e, e.traceback)
        failed = type(e)(f"{inputs} failed: {e}")  # HostLost stays HostLost: the run heals from it
        failed.logs, failed.remote, failed.traceback = e.logs, e.remote, e.traceback
        raise failed from e
    for line in logs:
        logger.info(line)
    return result


def describe_call(run: str, group: int, request: Request) -> str:
    """``'rollout' on run 'demo' dp-0 with step=3, wave=0, cursor=12, count=4, out='file://…'``."""
    shown = ", ".join(f"{k}={_brief(k, v)}" for k, v in request.model_dump().items())
    return f"'{request.stage}' on run '{run}' dp-{group}" + (f" with {shown}" if shown else "")


def _brief(key: str, value, limit: int = 1000) -> str:
    """A field as a person reads it in a log; the run config is reduced to where its data lives."""
    if key == "config" and isinstance(value, dict):
        fields = {
            "name": value.get("name"), "dp": value.get("dp"),
            "storage.root": (value.get("storage") or {}).get("root"),
            "data.prompts": (value.get("data") or {}).get("prompts"),
            "model.policy": (value.get("model") or {}).get("policy"),
            "model.judge": (value.get("model") or {}).get("judge"),
        }
        return "{" + ", ".join(f"{k}: {v!r}" for k, v in fields.items() if v is not None) + "}"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"
