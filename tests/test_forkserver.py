"""The fork server (``hosts.fork``, engines/wire/forkserver.py): hosts forked from one process that
imported the engines share those pages, start as an unforked host does (READY line, own session,
its title), and a child that dies before READY fails its start instead of hanging it."""

from __future__ import annotations

import os
import secrets
import signal

import psutil
import pytest

from engines.wire.channel import HostError
from engines.wire.forkserver import ForkServer
from engines.wire.launch import HostProcess


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
