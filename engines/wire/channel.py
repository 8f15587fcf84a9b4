"""The channel between a DP group's controller and its engine host.

The host is a way into a process that holds the model and the devices, so the channel binds
where the host is told to (loopback unless it serves other nodes: ``flows/hosts.py``),
authenticates the connection with a per-run secret (``multiprocessing.connection``'s HMAC
challenge), serves one controller, and exchanges JSON only — never pickles. A message is one
``engines.wire.commands`` request (``{"stage": ..., "fields": {...}}``); the answer is its result,
the seconds the host spent and the log lines the host wrote meanwhile (so they show in the
task's log in the Prefect UI).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import traceback
from concurrent import futures
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Callable

from engines.config.layout import Layout
from engines.wire.commands import REQUESTS, Request, Result, Shutdown

log = logging.getLogger("yattflow.host")


class HostError(RuntimeError):
    """A command failed inside an engine host, or the host is gone; the message says which."""

    logs: list[str] = []  # what the host logged before it failed
    remote: tuple[str | None, str | None] = (None, None)  # the host exception's type name and message
    traceback: str = ""  # the host's traceback (the task's log and the log file show it; the message does not)


class HostLost(HostError):
    """The host itself failed, not the work: its process is gone, or a stage made no progress for
    ``timeouts.stage_s``. A run heals from this by restarting its hosts (``retries.run``)."""


BEAT_S = 1.0  # while a command runs, the host reports its progress counter this often


# --------------------------------------------------------------------------- controller side


class HostClient:
    """The controller's end of one host's channel: ``call(request) -> (result, host log lines)``."""

    def __init__(self, address: tuple[str, int], secret: bytes, group: int, timeout_s: float, stage_s: float,
                 label: str | None = None):
        self.group = group
        self.label = label or f"dp-{group}"  # in messages: the group, or a node controller (flows/nodes.py)
        self.address = address
        self.timeout_s, self.stage_s = timeout_s, stage_s
        self._conn: Connection = Client(address, authkey=secret)
        self._lock = threading.Lock()
        # Why the channel is out of step, once a command gave up waiting for its answer: that
        # answer may still arrive, and the next command would read it as its own.
        self._abandoned: str | None = None
        self.in_flight: str | None = None  # the stage whose answer a call waits for (a cancelled task's call goes on)

    def call(self, request: Request) -> tuple[Result, list[str]]:
        stage = request.stage
        with self._lock:
            if self._abandoned is not None:
                raise HostLost(f"{self.label}: channel unusable for '{stage}': {self._abandoned}")
            self.in_flight = stage
            try:
                self._conn.send_bytes(json.dumps({"stage": stage, "fields": request.model_dump(mode="json")}).encode())
                reply = self._reply(stage, getattr(request, "timeout_s", None))
            except (EOFError, OSError) as e:
                raise HostLost(f"{self.label}: engine host is gone ({type(e).__name__}) during '{stage}'") from e
            finally:
                self.in_flight = None
        if "error" in reply:
            error = HostError(f"{self.label}: '{stage}' failed in the engine host: {reply['error']}")
            error.logs, error.remote, error.traceback = reply["logs"], (reply.get("type"), reply.get("message")), reply.get("traceback", "")
            raise error
        return request.result.model_validate(reply["result"] | {"host_s": reply["host_s"]}), reply["logs"]

    def _reply(self, stage: str, deadline_s: float | None = None) -> dict:
        """The answer to the command just sent, watching its heartbeats: a command whose progress
        counter stands still for ``stage_s`` (or whose host stops beating) is hung. A command
        with its own deadline (a weight sync's ``timeout_s``) not answered by then is a lost host
        too, however its heartbeats go: a transfer that does not finish must never be waited on."""
        start = moved = time.monotonic()
        progress = None
        while True:
            now = time.monotonic()
            if deadline_s is not None and now - start > deadline_s:
                self._abandoned = f"'{stage}' did not finish within its time-out of {deadline_s:g}s"
                raise HostLost(f"{self.label}: {self._abandoned}")
            if now - moved > self.stage_s:
                self._abandoned = f"'{stage}' hung: no progress for {now - moved:.0f}s (timeouts.stage_s={self.stage_s:g})"
                raise HostLost(f"{self.label}: {self._abandoned}")
            if now - start > self.timeout_s:
                self._abandoned = f"'{stage}' got no answer within {self.timeout_s:.0f}s (host_timeout_s)"
                raise HostError(f"{self.label}: {self._abandoned}")
            if not self._conn.poll(BEAT_S):
                continue
            message = json.loads(self._conn.recv_bytes())
            if "beat" not in message:
                return message
            if message["beat"] != progress:
                progress, moved = message["beat"], time.monotonic()

    def end(self) -> None:
        """Ask the host to shut down and close the channel. A channel still busy with a command
        (a failed run's other groups, waiting in a collective) is cut instead: the waiting call
        wakes and fails with ``HostLost``. A channel whose last command was abandoned is cut too."""
        if self._abandoned is None and self._lock.acquire(timeout=1.0):
            self._lock.release()
            try:
                self.call(Shutdown())
            except HostError:
                pass
        else:
            try:
                socket.socket(fileno=os.dup(self._conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class GroupClient:
    """The controller's end of a DP group of several ranks (engines/config/layout.py): a request
    goes to the ranks its stage names (``Request.ranks``), to each over that rank's own channel, so
    every rank keeps its own heartbeat watchdog and a rank that dies is a lost host at once; the
    answers come back as one (``Result.merge``), its log lines the leader's then the others'. The
    first rank to fail fails the call: the others may wait in a collective for it, and the run's
    hosts are stopped or restarted after it (a relay through the leader would hide a dead rank
    behind a collective that hangs)."""

    def __init__(self, members: dict[int, HostClient], layout: Layout):
        self.members, self.layout = members, layout  # by place in the group (a rollout lane's: the replicas' first ranks)
        self.label = members[0].label

    @property
    def in_flight(self) -> str | None:
        return self.members[0].in_flight

    def call(self, request: Request) -> tuple[Result, list[str]]:
        try:
            serving = [self.members[local] for local in self.layout.serving(request.ranks)]
        except KeyError:  # a rollout lane carries the replicas' stages only
            raise HostError(f"{self.label}: '{request.stage}' needs ranks {self.layout.serving(request.ranks)} of the "
                            f"group; this channel reaches {sorted(self.members)}") from None
        if len(serving) == 1:
            return serving[0].call(request)
        calls = [_FAN_OUT.submit(member.call, request) for member in serving]
        futures.wait(calls, return_when=futures.FIRST_EXCEPTION)
        failed = [c.exception() for c in calls if c.done() and c.exception() is not None]
        if failed:  # a rank that is gone first: the run heals from that
            raise next((e for e in failed if isinstance(e, HostLost)), failed[0])
        answers = [c.result() for c in calls]
        try:
            result = request.result.merge([r for r, _ in answers])
        except ValueError as e:
            raise HostError(f"{self.label}: '{request.stage}': {e}") from e
        return result, [line for _, lines in answers for line in lines]


_FAN_OUT = futures.ThreadPoolExecutor(max_workers=1024, thread_name_prefix="yattflow-rank-call")
_clients: dict[tuple[str, int] | tuple[str, int, str], HostClient] = {}  # (run, rank[, lane])
_opened: dict[tuple[str, int], tuple] = {}  # how each host was reached: a second lane connects the same way
_layouts: dict[str, Layout] = {}  # each connected run's ranks
_lanes = threading.Lock()
ROLLOUT_LANE = "rollout"


def client(run: str, group: int, lane: str | None = None) -> HostClient | GroupClient:
    """The open channel to the hosts of ``group`` in ``run`` (opened by ``connect``): its one host's,
    or a ``GroupClient`` over its ranks.

    ``lane="rollout"`` (``rollout.max_staleness`` >= 1): a second connection to the same hosts (those
    of the group's ranks that hold a rollout engine or judge), opened on first use, whose commands
    the hosts answer on a thread of their own, so that the next step's rollout runs while this
    step's train step holds the first (docs/off-policy.md)."""
    layout = _layouts.get(run, Layout(group + 1))
    ranks = layout.ranks(group)
    try:
        members = [_clients[(run, rank)] for rank in ranks]
    except KeyError:
        raise HostError(f"no engine host for run '{run}' dp-{group} in this process") from None
    if lane is None:
        return members[0] if len(members) == 1 else GroupClient(dict(enumerate(members)), layout)
    with _lanes:  # the lane's stages are the rollout engines' and judges': their ranks' second connections
        places = sorted(set(layout.serving("rollout")) | set(layout.serving("judge")))
        for local in places:
            if (run, ranks[local], lane) not in _clients:
                _clients[(run, ranks[local], lane)] = HostClient(*_opened[(run, ranks[local])])
        lanes = {local: _clients[(run, ranks[local], lane)] for local in places}
    return lanes[0] if len(lanes) == 1 else GroupClient(lanes, layout)


def in_flight(run: str, world: int) -> dict[int, str]:
    """The stage each of ``run``'s ``world`` groups waits on over the channel of this process
    (groups with none in flight left out); a rollout lane's commands are not counted."""
    busy = {}
    for group in range(world):
        try:
            stage = client(run, group).in_flight
        except HostError:
            continue
        if stage is not None:
            busy[group] = stage
    return busy


def connect(run: str, rank: int, address: tuple[str, int], secret: bytes, timeout_s: float, stage_s: float,
            layout: Layout | None = None) -> None:
    """Open the channel to a started host (rank ``rank`` of ``layout``, default one rank per group);
    tasks of ``run`` then reach it through ``client``."""
    if layout is not None:
        _layouts[run] = layout
    label = layout.name(rank) if layout is not None else None
    _clients[(run, rank)] = HostClient(address, secret, rank, timeout_s, stage_s, label)
    _opened[(run, rank)] = (address, secret, rank, timeout_s, stage_s, label)


def disconnect(run: str, world: int) -> None:
    """End every connected host channel of ``run``'s ``world`` ranks (``HostClient.end``): a rollout
    lane first, then the channel whose 'shutdown' ends the host."""
    _layouts.pop(run, None)
    for rank in range(world):
        _opened.pop((run, rank), None)
        for key in ((run, rank, ROLLOUT_LANE), (run, rank)):
            c = _clients.pop(key, None)
            if c is not None:
                c.end()


# --------------------------------------------------------------------------- host side


HANDSHAKE_S = 10.0  # a connection not authenticated by then is dropped


class Door:
    """The host's listening socket. Every connection authenticates (``multiprocessing.connection``'s
    HMAC challenge both ways, the per-run secret) on a thread of its own, within ``HANDSHAKE_S``; so a
    client that sends garbage, half a handshake or nothing at all costs only its own connection, and
    the host keeps accepting. ``next()`` hands out the authenticated connections in order."""

    def __init__(self, bind: str, secret: bytes):
        self._secret = secret
        self._server = socket.create_server((bind, 0))
        self.port = self._server.getsockname()[1]
        self._ready: queue.Queue[Connection] = queue.Queue()
        threading.Thread(target=self._accept, name="door", daemon=True).start()

    def next(self) -> Connection:
        """The next authenticated connection (waits for one)."""
        return self._ready.get()

    def close(self) -> None:
        """Stop accepting. Threads waiting in ``next`` are not woken: a daemon thread that wakes while the
        interpreter exits aborted deployed hosts ("terminate called without an active exception", exit -6)."""
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:  # closed: the host is exiting
                return
            threading.Thread(target=self._handshake, args=(sock, peer), name="handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        conn = Connection(os.dup(sock.fileno()))
        timer = threading.Timer(HANDSHAKE_S, _cut, args=(sock,))  # a silent or slow client: its reads end
        timer.start()
        try:
            deliver_challenge(conn, self._secret)
            answer_challenge(conn, self._secret)
        except Exception as e:  # noqa: BLE001 - garbage, a wrong secret, a half or late handshake: that connection only
            log.warning("engine host: refused a connection from %s:%s (%s: %s)", peer[0], peer[1], type(e).__name__, e)
            conn.close()
            return
        finally:
            timer.cancel()
            sock.close()  # ``conn`` holds its own descriptor
        self._ready.put(conn)


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Capture(logging.Handler):
    """Collects a command's log lines so they travel back with its answer."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.lines: list[str] = []
        self.thread = threading.get_ident()  # the lane this capture answers on

    def emit(self, record):
        if record.thread != self.thread and record.thread in _lane_threads:
            return  # another lane's command: its own answer carries it
        self.lines.append(self.format(record))
        progress()


_lane_threads: set[int] = set()  # the threads answering a connection (one per lane)


_progress = 0  # the command in hand's progress counter, sent with every heartbeat


def progress() -> None:
    """Host side: the command in hand made progress (a chunk generated, a micro-batch trained).
    Engines call it where they finish a piece of work; a log line counts too."""
    global _progress
    _progress += 1


def answer(conn: Connection, handle: Callable[[Request], Result], rank: int) -> None:
    """Answer the controller's requests with ``handle`` until ``Shutdown``; every failure goes
    back to the task that sent the request, with the host's traceback. While a command runs, a
    thread sends its progress counter every ``BEAT_S`` (the controller's watchdog). A connection
    that ends without ``Shutdown`` (the run crashed or was cancelled), also while an answer is on
    its way (a broken pipe), raises ``SystemExit(3)``: a host never holds its devices for a
    controller that is gone."""
    capture = _Capture()
    _lane_threads.add(capture.thread)
    logging.getLogger("yattflow").addHandler(capture)
    logging.getLogger("yattflow").setLevel(logging.INFO)
    sending, busy = threading.Lock(), threading.Event()

    def send(message: dict) -> None:
        with sending:
            conn.send_bytes(json.dumps(message).encode())

    def beat() -> None:
        while True:
            busy.wait()
            time.sleep(BEAT_S)
            if busy.is_set():
                try:
                    send({"beat": _progress})
                except OSError:
                    return

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            log.error("dp-%d: the controller's connection closed without 'shutdown'; exiting", rank)
            raise SystemExit(3) from None
        capture.lines = []
        start = time.perf_counter()
        busy.set()
        try:
            kind = REQUESTS.get(message.get("stage"))
            if kind is None:
                raise ValueError(f"unknown stage {message.get('stage')!r} (known: {sorted(REQUESTS)})")
            request = kind.model_validate(message.get("fields", {}))
            reply = {"result": {} if isinstance(request, Shutdown) else handle(request).model_dump(mode="json")}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the task
            request = None
            reply = {"error": "".join(traceback.format_exception_only(e)).strip(), "type": type(e).__name__, "message": str(e),
                     "traceback": traceback.format_exc()}
        busy.clear()
        reply["logs"] = capture.lines
        reply["host_s"] = time.perf_counter() - start  # engine-side time: the rest is orchestration
        try:
            send(reply)
        except OSError:  # gone while the command ran (a cancelled run): as a connection closed before one
            log.error("dp-%d: the controller's connection closed before its answer; exiting", rank)
            raise SystemExit(3) from None
        if isinstance(request, Shutdown):
            return
