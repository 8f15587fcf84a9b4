"""Model-written Python, run where it can do no harm: a bubblewrap sandbox (Debian's ``bubblewrap``).

Each run is a fresh ``bwrap`` process tree, started under a user id of its own (when the host
runs as root; else the host's, in an unprivileged user namespace) in new user, PID, network,
IPC, UTS and cgroup namespaces and a session of its own. What it sees: ``/usr`` (and the
``/bin``, ``/lib`` links) read-only, its program read-only at ``/code/main.py``, a private
in-memory ``/work`` and ``/tmp`` (``disk_mb`` each), ``/proc`` of its own namespace and a
minimal ``/dev``; no environment variables, no network (a loopback of its own, nothing
listening), none of the host's files (no run state, no credentials, no checkpoint). Before the
program starts, hard resource limits: CPU seconds, address space, processes, file size, open
files. The host kills the whole tree at ``wall_s`` and reads at most ``output_bytes`` of what it
printed; when the program's process exits, every process it left behind dies with its PID
namespace.

What it does not protect against (docs/agents.md): kernel bugs (it shares the host's kernel;
a VM such as gVisor or Firecracker isolates more), CPU and memory bandwidth taken from the
host while it runs, and what the program prints being read by the model.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PYTHON = "/usr/bin/python3"  # Debian's: outside the host's virtual environment, its standard library only
_uids = itertools.count()

# Runs inside the sandbox before the program: hard limits (which the program cannot raise), then the program.
_LAUNCHER = """
import os, resource, sys
cpu, memory, processes, fsize = map(int, sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", sys.argv[5]])
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # killed after this long
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    processes: int = 16  # of its user id (its own, under root)
    output_bytes: int = 16384  # of what it printed, read back
    disk_mb: int = 16  # /work and /tmp each; also the largest file it may write


LIMITS = Limits()  # what the python tool runs under (rollout.tool_timeout_s sets wall_s: ``configure``)


def configure(**changes) -> None:
    """Change the limits every later run takes (the engine host sets ``wall_s`` from the config)."""
    global LIMITS
    LIMITS = Limits(**{**LIMITS.__dict__, **changes})


@dataclass
class Run:
    output: str  # stdout and stderr, interleaved, cut at output_bytes
    exit_code: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    limits: Limits


def unavailable() -> str | None:
    """Why a sandbox cannot run here (None: it can)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian: apt-get install bubblewrap; `make system` installs it)"
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is missing (Debian: apt-get install python3)"
    return None


def command(program: Path, limits: Limits) -> list[str]:
    """The bwrap command line that runs ``program`` (a file the sandbox's user can read)."""
    cmd = [shutil.which("bwrap"), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--hostname", "sandbox",
           "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    size = str(limits.disk_mb << 20)
    cmd += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", str(program), "/code/main.py",
            "--size", size, "--tmpfs", "/work", "--size", size, "--tmpfs", "/tmp", "--chdir", "/work",
            PYTHON, "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_mb << 20),
            str(_processes(limits)), size, "/code/main.py"]
    return cmd


def run_python(code: str, limits: Limits | None = None) -> Run:
    """Run ``code`` in a fresh sandbox; answers what it printed, its exit code, whether it was killed."""
    limits = limits or LIMITS
    why = unavailable()
    if why:
        raise RuntimeError(f"the python tool's sandbox cannot run: {why}")
    as_root = os.geteuid() == 0
    with tempfile.TemporaryDirectory(prefix="yattflow-sandbox-") as folder:
        folder_path = Path(folder)
        program = folder_path / "main.py"
        program.write_text(code)
        os.chmod(folder, 0o755)
        os.chmod(program, 0o644)
        with open(folder_path / "output", "wb+") as out:
            ids = {}
            if as_root:  # a user id of its own: its process limit counts its processes only
                uid = 200000 + next(_uids) % 50000
                ids = {"user": uid, "group": uid, "extra_groups": []}
            # bwrap itself gets no environment either: its own process is the sandbox's PID 1, whose
            # /proc/1/environ the program can read
            proc = subprocess.Popen(command(program, limits), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    env={"PATH": "/usr/bin:/bin"}, **ids)
            try:
                exit_code, timed_out = proc.wait(timeout=limits.wall_s), False
            except subprocess.TimeoutExpired:
                exit_code, timed_out = None, True
            finally:
                _kill_tree(proc)
                if as_root:
                    _reap(ids["user"])
            out.seek(0)
            data = out.read(limits.output_bytes + 1)
    text = data[: limits.output_bytes].decode("utf-8", errors="replace")
    if len(data) > limits.output_bytes:
        text += f"\n[output cut at {limits.output_bytes} bytes]"
    return Run(text, exit_code, timed_out, limits)


def _kill_tree(proc: subprocess.Popen) -> None:
    """bwrap and everything in its session, gone (its PID namespace dies with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _reap(uid: int, wait_s: float = 5.0) -> None:
    """Under root: return once no process of the sandbox's user id is alive. The kernel kills a PID
    namespace's processes when its first process dies, but not at once: on a loaded machine a fork
    bomb's children were still running a moment after bwrap had exited. Stragglers get SIGKILL;
    zombies (dead, not yet reaped by the host's PID 1) do not count."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid and not _dead(p)]
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _dead(path: Path) -> bool:
    """A zombie, or gone."""
    try:
        return path.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _processes(limits: Limits) -> int:
    """RLIMIT_NPROC counts every process of the user id: under root the sandbox has an id of its
    own; otherwise it shares the host's, which already runs some."""
    if os.geteuid() == 0:
        return limits.processes
    mine = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == os.geteuid())
    return mine + limits.processes


def _owner(path: Path) -> int | None:
    try:
        return path.stat().st_uid
    except OSError:
        return None
