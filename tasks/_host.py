"""How a task talks to its DP group's engine host."""

from __future__ import annotations

import asyncio

from prefect import get_run_logger

from engines.host import client


async def call_host(run: str, group: int, command: str, **params) -> dict:
    """Send one command to the group's host without blocking the event loop, and replay the
    host's log lines into this task's log (so they show in the Prefect UI)."""
    result, logs = await asyncio.to_thread(client(run, group).call, command, **params)
    logger = get_run_logger()
    for line in logs:
        logger.info(line)
    return result
