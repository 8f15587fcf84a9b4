"""The fork server (``hosts.fork``, engines/wire/forkserver.py): hosts forked from one process that
imported the engines share those pages, start as an unforked host does (READY line, own session,
its title), and a child that dies before READY fails its start instead of hanging it; a host, forked
or not, never outlives the process that started it."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engines.wire.channel import HostError
from engines.wire.forkserver import ForkServer
from engines.wire.launch import HostProcess

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_forked_hosts_share_the_imports_and_start_like_started_ones():
    server = ForkServer(dict(os.environ))
    hosts = []
    try:
        secret = secrets.token_bytes(32)
        hosts = [HostProcess(rank, 2, 1, secret, forkserver=server).wait_ready() for rank in range(2)]
        for h in hosts:
            p = psutil.Process(h.proc.pid)
            assert p.ppid() == server.proc.pid and os.getpgid(p.pid) == p.pid  # forked, in a session of its own
            assert f"-m engines.host --rank {h.rank} --world 2" in " ".join(p.cmdline())  # what bench/ps find it by
            assert h.address[0] == "127.0.0.1" and h.address[1] > 0
            mem = p.memory_full_info()
            # torch, pyarrow and transformers are imported (RSS counts the shared pages); the child's own part is small
            assert mem.rss > 200 * 2**20 and mem.uss < 60 * 2**20, (mem.rss >> 20, mem.uss >> 20)
        assert hosts[0].dist_port > 0 and hosts[1].dist_port == 0  # rank 0 serves the rendezvous
        os.killpg(hosts[0].proc.pid, signal.SIGKILL)
        assert hosts[0].proc.wait(timeout=10) == -1 and hosts[0].proc.poll() == -1  # gone (its code: the server's)
        assert hosts[1].proc.poll() is None
        # a child that dies before its READY line (here: a module with no such name) fails its start, not hangs it
        bad = HostProcess(0, 1, 1, secret, module="engines.no_such_module", forkserver=server)
        with pytest.raises(HostError, match="failed to start"):
            bad.wait_ready()
    finally:
        for h in hosts:
            h.stop(grace_s=0)
        server.stop()


@pytest.mark.integration
def test_a_host_whose_starter_died_during_its_start_goes_too():
    """A run killed while its host still imports torch (the GPU check's part limit does this) has
    already left the host to init when the host would look at its parent: the host is killed by its
    lifeline anyway (engines/host/lifeline.py), its own session notwithstanding, rather than live on
    until it fails to print READY into a closed pipe, or, past READY, forever."""
    starter = ("import secrets; from engines.wire.launch import HostProcess; "
               "print(HostProcess(0, 1, 1, secrets.token_bytes(32)).proc.pid, flush=True)")  # and exits at once
    adopter = ("import ctypes, os, subprocess, sys\n"
               "ctypes.CDLL('libc.so.6').prctl(36, 1)\n"  # PR_SET_CHILD_SUBREAPER: the orphaned host is ours to wait for
               f"pid = int(subprocess.run([sys.executable, '-c', {starter!r}], capture_output=True, text=True).stdout)\n"
               "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    out = subprocess.run([sys.executable, "-c", adopter], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == str(-signal.SIGKILL), (out.stdout, out.stderr[-2000:])


@pytest.mark.integration
def test_a_process_keeps_its_fork_server_and_a_child_takes_the_launchers_directory_and_stderr(tmp_path, monkeypatch):
    """``hosts.fork``'s server is the process's (engines/wire/launch.py): a later run and a heal fork from the
    one the first run started, which may be older than the launcher's working directory and stderr; a child
    takes the launcher's. Another import-time environment (``PYTHONPATH`` too: a sitecustomize on it runs as the
    server starts), or a run that forks node controllers, gets a new server."""
    from engines.wire.launch import shared_forkserver, stop_forkserver

    first = shared_forkserver()
    try:
        assert shared_forkserver() is first
        (tmp_path / "probe_module.py").write_text(  # found only in the launcher's directory, run as python -m would
            "import os, sys\nprint('probe on stderr', file=sys.stderr, flush=True)\nprint('READY', os.getcwd(), flush=True)\n")
        monkeypatch.chdir(tmp_path)
        stderr, saved = tmp_path / "stderr", os.dup(2)
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT), 2)  # the launcher's stderr, now other than the server's
        try:
            child = first.spawn("probe_module", [], dict(os.environ))
            assert child.stdout.readline().split() == ["READY", str(tmp_path)]
            child.wait(timeout=30)
        finally:
            os.dup2(saved, 2)
        assert stderr.read_text() == "probe on stderr\n"
        assert shared_forkserver() is first  # (the directory and stderr are per child)

        controllers = shared_forkserver(node_controllers=True)  # Prefect's modules too: a new server
        assert controllers is not first and first.proc.poll() is not None and shared_forkserver() is controllers
        monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")  # read by torch as it is imported
        path = shared_forkserver()
        assert path is not controllers and controllers.proc.poll() is not None
        monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")
        assert shared_forkserver() is not path and path.proc.poll() is not None
    finally:
        stop_forkserver()  # (the next test's leftover-host check would see none anyway: a server is no host)
