"""One writer per run: a lease on the run's name, beside its ``state.json``.

``{run}/lease.json`` says who trains the run: the holder (an id of its own, the Prefect flow
run, host, pid), since when, and until when the lease holds (``expires_at``). The holder renews
it on a thread every third of ``run.lease_s``; a run that finds a live lease held by another
refuses at once, naming the holder (``run.on_conflict: fail``) or waits for it to end
(``wait``). A holder that died stops renewing, so its lease expires after ``run.lease_s`` and
the next run takes it over: a crash never blocks the run for good (on the holder's own machine
at once, when its process is gone). Every change of the lease
is a compare-and-swap (``objectstore.update_json``), so of two runs started together exactly one
takes it. Expiry compares wall clocks: keep ``run.lease_s`` well above the clock skew between
the machines that may train a run.

A holder that could not renew (storage unreachable for longer than the lease, or a process
paused that long) may have been taken over: it reads the lease again before it commits a
checkpoint and stops with ``LeaseLost`` if it is no longer the holder. One that nobody took over
meanwhile still holds it, and extends it: a taker's write is conditional on the very lease it read,
so of a late renewal and a take-over exactly one wins. So an object store that stops answering for
longer than the lease, but less than its retries (``YATTFLOW_STORAGE_RETRY_S``), stops no run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from storage import objectstore


class RunInUse(RuntimeError):
    """Another live run holds the lease on this run's name."""


class LeaseLost(RuntimeError):
    """This run's lease expired and another run took it: it must not write any more."""


_held: dict[str, "Lease"] = {}  # run URI -> the lease this process holds on it


class Lease:
    """The lease on one run (``{run_uri}/lease.json``), taken with ``acquire`` and given back with ``release``."""

    def __init__(self, run_uri: str, ttl_s: float, flow_run_id: str | None = None):
        self.uri = objectstore.join(run_uri, "lease.json")
        self.run_uri, self.ttl_s = run_uri, ttl_s
        self.me = {"id": uuid.uuid4().hex, "flow_run_id": flow_run_id, "hostname": socket.gethostname(), "pid": os.getpid()}
        self.lost: str | None = None  # why this process no longer holds it
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self, wait: bool = False, on_wait: Callable[[str], None] | None = None, poll_s: float = 2.0) -> None:
        """Take the lease, or raise ``RunInUse`` naming the live holder (``wait``: poll until it is free)."""
        next_note = 0.0
        while True:
            now = time.time()
            lease = objectstore.update_json(self.uri, lambda current: self._taken(current, now) if _free(current, now) else None)
            if lease["holder"]["id"] == self.me["id"]:
                break
            if not wait:
                raise RunInUse(f"{self.uri}: {describe(lease)}; it trains this run until it ends. Wait for it, stop it, "
                               "or set run.on_conflict=wait to start when it ends")
            if on_wait and now >= next_note:
                on_wait(f"waiting for {describe(lease)}")
                next_note = now + 30
            if self._stop.wait(min(poll_s, self.ttl_s / 4)):  # released while it waited: its run was stopped
                raise RunInUse(f"{self.uri}: stopped while waiting for {describe(lease)}")
        _held[self.run_uri] = self
        self._renewer = threading.Thread(target=self._renew_until_released, name="run-lease", daemon=True)
        self._renewer.start()

    def _taken(self, previous: dict | None, now: float) -> dict:
        since = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")
        return {"holder": self.me, "since": since, "expires_at": now + self.ttl_s, "released": False,
                "took_over": describe(previous) if previous and not previous.get("released") else None}

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except LeaseLost as e:
                self.lost = str(e)
                return
            except Exception:  # noqa: BLE001 - storage hiccup: try again at the next beat; verify() catches a real loss
                pass

    def renew(self) -> None:
        """Push ``expires_at`` to ``ttl_s`` from when storage answered (not from when the call began: an
        outage the object store's retries rode out would leave a lease that ran out meanwhile); ``LeaseLost``
        when another run holds it now. A lease of this run that expired unrenewed (storage did not answer,
        the process was paused) is extended too: nobody took it, and a taker's conditional write on the
        lease it read now fails."""

        def extend(current: dict | None) -> dict | None:
            return current | {"expires_at": time.time() + self.ttl_s} if self._mine(current) else None

        lease = objectstore.update_json(self.uri, extend)
        if not self._mine(lease):
            raise LeaseLost(f"{self.uri}: this run's lease ran out and {describe(lease) if lease else 'nobody'} holds it now")

    def verify(self) -> None:
        """Raise ``LeaseLost`` unless this process still holds the lease (read from storage; one that ran out
        unrenewed and nobody took is this run's still, and renewed here)."""
        if self.lost:
            raise LeaseLost(self.lost)
        lease = objectstore.read_json(self.uri) if objectstore.exists(self.uri) else None
        if not self._mine(lease):
            raise LeaseLost(f"{self.uri}: this run no longer holds the lease ({describe(lease) if lease else 'none'})")
        if lease["expires_at"] < time.time():
            self.renew()

    def release(self) -> None:
        """Give the lease back (a later run takes it at once); nothing happens if it was lost."""
        self._stop.set()
        if self._renewer is not None:  # (a renewal still waiting on the store finds the lease released, or expires)
            self._renewer.join(timeout=objectstore.ON_THE_WAY_OUT_S)
        _held.pop(self.run_uri, None)
        try:  # on the way out, perhaps of a run that failed on storage: a short wait, then it expires by itself
            with objectstore.retry_at_most(objectstore.ON_THE_WAY_OUT_S):
                objectstore.update_json(self.uri, lambda current: current | {"released": True} if self._mine(current) else None)
        except objectstore.StorageError as e:
            objectstore.log.warning("%s: not released (%s); it expires %gs after its last renewal", self.uri,
                                    " ".join(str(e).split()), self.ttl_s)

    def _mine(self, lease: dict | None) -> bool:
        return bool(lease) and lease["holder"]["id"] == self.me["id"] and not lease.get("released")


def _free(lease: dict | None, now: float) -> bool:
    """No lease, a released or expired one, or one held by a process of this machine that is gone
    (a run killed with SIGKILL: the same command again need not wait for the lease to expire)."""
    if lease is None or lease.get("released", False) or lease["expires_at"] < now:
        return True
    holder = lease["holder"]
    return holder["hostname"] == socket.gethostname() and not _alive(holder["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe(lease: dict) -> str:
    """``run held by flow run 1b2c… on host gpu-3 (pid 4242) since 2026-11-25T01:02:03+00:00``."""
    h = lease["holder"]
    who = f"flow run {h['flow_run_id']}" if h.get("flow_run_id") else "a process"
    left = lease["expires_at"] - time.time()
    state = "released" if lease.get("released") else (f"lease expires in {left:.0f}s unless renewed" if left >= 0 else "lease expired")
    return f"run held by {who} on host {h['hostname']} (pid {h['pid']}) since {lease['since']} ({state})"


def verify_held(run_uri: str) -> None:
    """Before a commit: if this process holds ``run_uri``'s lease, make sure it still does."""
    lease = _held.get(run_uri)
    if lease is not None:
        lease.verify()


def read(run_uri: str) -> dict | None:
    """The run's lease as ``lease.json`` holds it (None: never taken), with ``held``: whether a live
    run holds it now (neither released, expired, nor left by a process of this machine that is gone)."""
    uri = objectstore.join(run_uri, "lease.json")
    if not objectstore.exists(uri):
        return None
    lease = objectstore.read_json(uri)
    return lease | {"held": not _free(lease, time.time())}
