"""The channel between a DP group's controller and its engine host.

The host is a way into a process that holds the model and the devices, so the channel binds
where the host is told to (loopback unless it serves other nodes: ``flows/hosts.py``),
authenticates the connection with a per-run secret (``multiprocessing.connection``'s HMAC
challenge), serves one controller, and exchanges JSON only — never pickles. A message is one
``engines.commands`` request (``{"stage": ..., "fields": {...}}``); the answer is its result,
the seconds the host spent and the log lines the host wrote meanwhile (so they show in the
task's log in the Prefect UI).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection
from typing import Callable

from engines.commands import REQUESTS, Request, Result, Shutdown

log = logging.getLogger("yattflow.host")


class HostError(RuntimeError):
    """A command failed inside an engine host, or the host is gone; the message says which."""

    logs: list[str] = []  # what the host logged before it failed


# --------------------------------------------------------------------------- controller side


class HostClient:
    """The controller's end of one host's channel: ``call(request) -> (result, host log lines)``."""

    def __init__(self, address: tuple[str, int], secret: bytes, group: int, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self._conn: Connection = Client(address, authkey=secret)
        self._lock = threading.Lock()

    def call(self, request: Request) -> tuple[Result, list[str]]:
        stage = request.stage
        with self._lock:
            try:
                self._conn.send_bytes(json.dumps({"stage": stage, "fields": request.model_dump(mode="json")}).encode())
                if not self._conn.poll(self.timeout_s):
                    raise HostError(f"dp-{self.group}: '{stage}' got no answer within {self.timeout_s:.0f}s")
                reply = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise HostError(f"dp-{self.group}: engine host is gone ({type(e).__name__}) during '{stage}'") from e
        if "error" in reply:
            error = HostError(f"dp-{self.group}: '{stage}' failed in the engine host:\n{reply['error']}")
            error.logs = reply["logs"]
            raise error
        return request.result.model_validate(reply["result"] | {"host_s": reply["host_s"]}), reply["logs"]

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


_clients: dict[tuple[str, int], HostClient] = {}


def client(run: str, group: int) -> HostClient:
    """The open channel to the host of ``group`` in ``run`` (opened by ``connect``)."""
    try:
        return _clients[(run, group)]
    except KeyError:
        raise HostError(f"no engine host for run '{run}' dp-{group} in this process") from None


def connect(run: str, group: int, address: tuple[str, int], secret: bytes, timeout_s: float) -> None:
    """Open the channel to a started host; tasks of ``run`` then reach it through ``client``."""
    _clients[(run, group)] = HostClient(address, secret, group, timeout_s)


def disconnect(run: str, world: int) -> None:
    """Ask every connected host of ``run`` to shut down, and close the channels."""
    for group in range(world):
        c = _clients.pop((run, group), None)
        if c is not None:
            try:
                c.call(Shutdown())
            except HostError:
                pass
            c.close()


# --------------------------------------------------------------------------- host side


class _Capture(logging.Handler):
    """Collects a command's log lines so they travel back with its answer."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def answer(conn: Connection, handle: Callable[[Request], Result], rank: int) -> None:
    """Answer the controller's requests with ``handle`` until ``Shutdown``; every failure goes
    back to the task that sent the request, with the host's traceback. A connection that ends
    without ``Shutdown`` (the run crashed or was cancelled) raises ``SystemExit(3)``: a host
    never holds its devices for a controller that is gone."""
    capture = _Capture()
    logging.getLogger("yattflow").addHandler(capture)
    logging.getLogger("yattflow").setLevel(logging.INFO)
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            log.error("dp-%d: the controller's connection closed without 'shutdown'; exiting", rank)
            raise SystemExit(3) from None
        capture.lines = []
        start = time.perf_counter()
        try:
            kind = REQUESTS.get(message.get("stage"))
            if kind is None:
                raise ValueError(f"unknown stage {message.get('stage')!r} (known: {sorted(REQUESTS)})")
            request = kind.model_validate(message.get("fields", {}))
            reply = {"result": {} if isinstance(request, Shutdown) else handle(request).model_dump(mode="json")}
        except Exception:  # noqa: BLE001 - every failure goes back to the task
            request, reply = None, {"error": traceback.format_exc()}
        reply["logs"] = capture.lines
        reply["host_s"] = time.perf_counter() - start  # engine-side time: the rest is orchestration
        conn.send_bytes(json.dumps(reply).encode())
        if isinstance(request, Shutdown):
            return
