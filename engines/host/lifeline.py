"""A host never outlives the process that started it (no orphaned engines holding devices).

The starter names itself in ``YATTFLOW_PARENT_PID`` (``HostProcess``, the fork server): a forked
host's parent process is the fork server, not the run, and a run killed while its host was still
importing torch has already left the host to init, so the host's own parent pid at the time it
looks proves nothing. Armed first thing (``python -m engines.host`` before its imports), so a host
whose run died during its start goes within a second. Imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

PARENT_PID = "YATTFLOW_PARENT_PID"


def _alive(parent: psutil.Process) -> bool:
    try:
        return parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE  # is_running: not a reused pid
    except psutil.Error:
        return False


def exit_with_parent() -> None:
    """Kill this process group (this host and every process its engines started) once the
    process that started it is gone, whenever that was."""
    try:
        parent = psutil.Process(int(os.environ.get(PARENT_PID) or os.getppid()))
        started_before_us = parent.create_time() <= psutil.Process().create_time()
    except psutil.Error:
        parent, started_before_us = None, False

    def watch():
        while started_before_us and _alive(parent):
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
