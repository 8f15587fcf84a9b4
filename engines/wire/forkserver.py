"""A fork server for local engine hosts and node controllers (``hosts.fork``).

Every engine host is a Python process that imports torch, pyarrow and transformers before it
serves (~260 MB of private memory, ~4-8 s of CPU each, even as a timing stub: its ``Worker``
keeps the real gloo group). 256 of them do not fit a 24 GB machine. The fork server imports all
of that once, freezes the heap (``gc.freeze``: the collector then never writes to those objects'
pages) and forks each host from itself: the children share the imported pages copy-on-write and
start in milliseconds. Each child is then what ``python -m MODULE --rank …`` would be — the same
``main``, arguments, environment, working directory and stderr (the launcher's, sent per child: a
server outlives a run, engines/wire/launch.py), its own session, its own READY line, a root logger
without handlers — so nothing the host does differs; only how its process came to be.

Protocol (the launcher is ``ForkServer``, in the training run's process): one JSON line per child
on the server's stdin (module, argv, env, a FIFO path for the child's stdout), answered with
``PID n``. The child writes its READY line into the FIFO, which the launcher reads as it reads a
subprocess's stdout. Forking is safe here because nothing started a thread that holds a lock
the children need: the server forks from its only Python thread before any engine, event loop or
CUDA context exists (``ARROW_DEFAULT_MEMORY_POOL=system``: no jemalloc background thread either).
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# what an engine host and a node controller import before they serve (engines/host/process.py, flows/node_controller.py);
# a server imports the second only for a run that forks node controllers (Prefect's import: ~3 s of CPU more)
HOST_MODULES = ("engines.host.process", "engines.host.worker", "engines.backends.stub.engines")
NODE_CONTROLLER_MODULES = ("flows.node_controller", "flows.training", "prefect.flow_engine", "fastapi.encoders")


class Forked:
    """A forked child, as much of ``subprocess.Popen`` as ``HostProcess`` uses. Its exit code is not
    known here (the fork server's kernel reaped it): ``poll``/``wait`` answer -1 once it is gone."""

    def __init__(self, pid: int, fifo: Path):
        import psutil

        self.pid, self._fifo = pid, fifo
        self._proc = psutil.Process(pid)  # remembers the start time: a reused pid is not this child
        self._stdout = None

    @property
    def stdout(self):
        if self._stdout is None:
            # a blocking open would wait forever for a child that died before opening its end: open without
            # blocking and wait until the child wrote (or closed its end: Linux reports no hang-up before a writer
            # ever opened) or died, then read as from a pipe
            fd = os.open(self._fifo, os.O_RDONLY | os.O_NONBLOCK)
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLHUP)
            while not poller.poll(100) and self.poll() is None:
                pass
            os.set_blocking(fd, True)
            self._stdout = os.fdopen(fd, "r")
        return self._stdout

    def poll(self) -> int | None:
        import psutil

        try:
            return None if self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE else -1
        except psutil.Error:
            return -1

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        try:
            os.unlink(self._fifo)
        except OSError:
            pass
        return -1


class ForkServer:
    """The launcher's side: starts ``python -m engines.wire.forkserver`` and asks it for children."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = HOST_MODULES):
        self.folder, self.preload = Path(tempfile.mkdtemp(prefix="yattflow-fork-")), preload
        env = dict(env, ARROW_DEFAULT_MEMORY_POOL="system", YATTFLOW_PARENT_PID=str(os.getpid()))
        self.proc = subprocess.Popen([sys.executable, "-m", "engines.wire.forkserver", *preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lock = threading.Lock()
        self.count = 0
        if self.proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the engine hosts' fork server failed to start (exit code {self.proc.poll()})")

    def spawn(self, module: str, argv: list[str], env: dict[str, str]) -> Forked:
        with self.lock:
            self.count += 1
            fifo = self.folder / f"out-{self.count}"
            os.mkfifo(fifo, 0o600)
            # the child's working directory and stderr are the launcher's now (the server may be older than this run)
            request = {"module": module, "argv": argv, "env": env, "stdout": str(fifo), "cwd": os.getcwd(),
                       "stderr": f"/proc/{os.getpid()}/fd/2"}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().split()
            if len(answer) != 2 or answer[0] != "PID":
                raise RuntimeError(f"the engine hosts' fork server did not fork {module} (exit code {self.proc.poll()})")
            return Forked(int(answer[1]), fifo)

    def stop(self) -> None:
        """End the server (its children stay: each exits with its own run's connection, or when this process goes)."""
        if not self.folder.exists():
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        for f in self.folder.glob("*"):
            f.unlink(missing_ok=True)
        self.folder.rmdir()


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` and run it; never returns."""
    code = 0
    try:
        os.setsid()  # its own session, as HostProcess's start_new_session: stop() sweeps its process group
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's SIG_IGN would break the child's own waits
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # the module search path python would start with under this environment (a rule module on PYTHONPATH)
        sys.path[0] = request["cwd"]  # (python -m's first entry)
        sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["stdout"], os.O_WRONLY)
        os.dup2(out, 1)
        os.close(null), os.close(out)
        try:
            err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
            os.dup2(err, 2)
            os.close(err)
        except OSError:  # (a socket cannot be opened by its /proc path: the server's own stderr then)
            pass
        sys.stdin, sys.stdout = open(0, closefd=False), open(1, "w", closefd=False)
        # no gc.unfreeze(): the collector's full passes would then write to every imported object's header and
        # copy every page of the shared heap into the child (seen: 256 hosts at ~330 MB each, the OOM killer)
        sys.argv = [request["module"], *request["argv"]]
        try:  # the title an unforked one has (ps, psutil's cmdline: bench/nodes.py finds hosts by it)
            import setproctitle

            setproctitle.setproctitle(" ".join([sys.executable, "-m", request["module"], *request["argv"]]))
        except ImportError:
            pass
        module = sys.modules.get(request["module"])
        if module is not None and hasattr(module, "main"):  # preloaded (a node controller): run it, not a second copy
            module.main()
        else:  # a package's __main__ (the engine host's), which imports no Prefect: its root logger as a fresh
            logging.root.handlers.clear()  # interpreter's, not the one Prefect's import gave the server (INFO lines shown)
            logging.root.setLevel(logging.WARNING)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's traceback goes to its stderr, as an unforked one's would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    from engines.host.lifeline import exit_with_parent

    for module in sys.argv[1:]:  # what ForkServer asked it to preload
        importlib.import_module(module)
    from engines.host.process import ENGINE_LIBRARIES  # what a host imports before READY (transformers' Auto classes)

    for module in ENGINE_LIBRARIES:
        importlib.import_module(module)
    try:  # set up here, while the environment is this process's own: a child that clears it first cannot set its title
        import setproctitle

        setproctitle.setproctitle(setproctitle.getproctitle())
    except ImportError:
        pass
    gc.collect()
    gc.freeze()  # what is imported now stays untouched by the collector: its pages stay shared with the children
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children: no zombies
    exit_with_parent()  # a thread, but one that holds no lock a child needs (it only sleeps and reads /proc)
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":
    main()
