"""A time-out for a call of user code (a reward rule, an environment's ``reset``/``step`` in the pre-flight).

``call(timeout_s, function, *args)`` raises ``Expired`` once the call has run ``timeout_s`` seconds. On the
process's main thread (an engine host's commands, the CLI) the call runs in place and a watchdog thread
interrupts it with SIGALRM at its deadline, so that a sleep or a loop in it ends there (again every second
while it goes on: code that caught it; math-verify's own signal-based limits keep working and answer the
interruption as their own time-out). On another thread (the partial placement's judge) it runs on a worker
thread of its own, abandoned at the deadline (a Python function cannot be stopped from outside); the next
call gets a new worker.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from typing import Callable


class Expired(BaseException):
    """Raised in a call at its deadline: a BaseException, so that the user code's own ``except Exception`` lets it through."""


def call(timeout_s: float | None, function: Callable, *args):
    """``function(*args)``, interrupted (``Expired``) once it has run ``timeout_s`` seconds (None: never)."""
    if timeout_s is None:
        return function(*args)
    if threading.current_thread() is threading.main_thread():
        with _MAIN_DEADLINE.interrupting(timeout_s):
            return function(*args)
    worker = getattr(_workers, "worker", None)
    if worker is None:
        worker = _workers.worker = _Worker()
    try:
        return worker.call(timeout_s, function, *args)
    except Expired:
        _workers.worker = None  # it is stuck in the call: the next call gets a new one
        raise


_workers = threading.local()  # off the main thread: each calling thread's worker


class _Worker:
    """A daemon thread that runs one calling thread's calls, one at a time; abandoned when a call hangs."""

    def __init__(self):
        import queue

        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="timed-call", daemon=True).start()

    def call(self, timeout_s: float, function: Callable, *args):
        box: dict = {}
        done = threading.Event()
        self._calls.put((function, args, box, done))
        if not done.wait(timeout_s):
            raise Expired
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _serve(self) -> None:
        while True:
            function, args, box, done = self._calls.get()
            try:
                box["value"] = function(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                box["error"] = e
            done.set()


class _MainDeadline:
    """Interrupts the main thread's call at its deadline: a watchdog thread sends the main thread
    SIGALRM, whose handler (installed for the call) raises ``Expired``; again every second while the
    call goes on (a rule that caught it, or math-verify's handler that was in place and scored 0)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._deadline: float | None = None  # time.monotonic() at which the call is interrupted; None: no call
        self._watchdog: threading.Thread | None = None
        self._until = math.inf  # until when the watchdog waits (then it looks at the deadline again)

    @contextlib.contextmanager
    def interrupting(self, timeout_s: float):
        def expired(signum, frame):
            raise Expired

        previous = signal.signal(signal.SIGALRM, expired)
        outer = self._deadline  # a call within a call: the sooner deadline holds, the outer one after it
        try:
            with self._cond:
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, name="call-deadline", daemon=True)
                    self._watchdog.start()
                self._deadline = min(time.monotonic() + timeout_s, math.inf if outer is None else outer)
                if self._deadline < self._until:  # else it wakes before this deadline and sees it then
                    self._cond.notify()
            yield
        finally:
            try:
                with self._cond:
                    self._deadline = outer  # (None: no signal after this; the watchdog sends them holding the lock)
            finally:
                signal.signal(signal.SIGALRM, previous)

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._until = math.inf
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._until = self._deadline
                    self._cond.wait(left)
                    continue
                signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
                self._deadline += 1.0


_MAIN_DEADLINE = _MainDeadline()
