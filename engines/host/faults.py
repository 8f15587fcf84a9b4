"""Fault injection: kill or hang an engine host at a chosen point, to prove that runs heal.

``YATTFLOW_FAULTS`` lists faults as ``point@step:dp-rank:action``, comma-separated (a DP group's
second tensor-parallel rank is ``dp-1.1``: engines/config/layout.py), e.g.::

    YATTFLOW_FAULTS="rollout@2:dp-1:kill,checkpoint_write@3:dp-0:kill,train_step@5:dp-0:hang,genrm_score@6:dp-0:kill-run"

``point`` is a stage (``rollout``, ``train_step``, ... as the request arrives at the host),
``checkpoint_write`` (the background writer, after its first file), or ``node_iteration``: node
controller ``rank`` (flows/node_controller.py) as a step's groups arrive there (``kill``: the node dies). ``kill`` SIGKILLs the host
(its engines' processes die with it), ``hang`` stops it answering or making progress for good,
``kill-run`` SIGKILLs the process that started the host: the training run itself. Each fault
fires once: it leaves a marker in ``YATTFLOW_FAULTS_FIRED`` (a folder) first, so the hosts a
healed or re-run run starts go past that point. Nothing happens unless ``YATTFLOW_FAULTS`` is
set; it is for tests (``tests/test_recovery.py``) and for trying recovery by hand.
"""

from __future__ import annotations

import os
import signal
import time


def inject(point: str, step: int | None, rank: int | str) -> None:
    """Fire the fault planned for ``point`` at ``step`` on ``rank`` (a number, or a name as ``dp-1.1``), if any
    and not fired yet."""
    planned = os.environ.get("YATTFLOW_FAULTS")
    if not planned or step is None:
        return
    for fault in planned.split(","):
        where, action = fault.rsplit(":", 1)
        if where != f"{point}@{step}:{rank if isinstance(rank, str) else f'dp-{rank}'}" or not _first_time(fault):
            continue
        print(f"yattflow fault injection: {fault}", flush=True)
        if action == "kill":
            os.killpg(0, signal.SIGKILL)  # the host and its engines' processes
        elif action == "kill-run":
            # the process that started the host (a forked host's parent is the fork server: engines/host/lifeline.py)
            os.kill(int(os.environ.get("YATTFLOW_PARENT_PID") or os.getppid()), signal.SIGKILL)
        elif action == "hang":
            while True:
                time.sleep(3600)
        else:
            raise ValueError(f"YATTFLOW_FAULTS: unknown action {action!r} in {fault!r} (kill, kill-run, hang)")


def _first_time(fault: str) -> bool:
    folder = os.environ.get("YATTFLOW_FAULTS_FIRED")
    if not folder:
        raise ValueError("YATTFLOW_FAULTS is set without YATTFLOW_FAULTS_FIRED (the folder that records fired faults)")
    try:
        os.close(os.open(os.path.join(folder, fault.replace("/", "_")), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
