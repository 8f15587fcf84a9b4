"""Model-written Python, run where it can do no harm: a bubblewrap sandbox (Debian's ``bubblewrap``).

Each call is a fresh ``bwrap`` process tree in new user, PID, network, IPC, UTS and cgroup
namespaces and a session of its own, where the program is PID 1 (``--as-pid-1``: no bwrap process
inside to attack). What it sees, read-only: Debian's ``python3``, its standard library, the shared
libraries those link and the time zone data (nothing else of ``/usr``: no compiler, no shell, no
``/usr/local``), its program at ``/code/main.py``, ``/proc`` of its own namespace, a minimal
``/dev``; writable: ``/work``, ``/tmp`` and ``/dev/shm`` only, in memory, sized. No environment
variables but PATH and HOME, no network (a loopback of its own, nothing listening), none of the
host's files. Nested user namespaces are disabled (``--disable-userns``) and a seccomp filter
(``seccomp_filter``, x86_64) refuses what a contained program has no use for: ptrace, mount,
unshare/setns, namespaces in clone, kernel modules, bpf, keyrings, io_uring, sockets other than
Unix, IP and netlink, and the like. Before the program starts, hard rlimits per process: CPU
seconds, address space, processes, file size, open files.

When the host runs as root (a deployment): the call gets a user id of its own, unique across the
host's processes (``_take_uid``), and a cgroup of its own (v1 ``memory`` and ``pids``): one memory
and process budget for the whole call, whatever it forks. Its ``/work``, ``/tmp`` and ``/dev/shm``
share one ``disk_mb`` tmpfs mounted ``noexec`` by a root helper in a mount namespace of the call's
own (``_ROOT_SETUP``): nothing the program writes can be executed. At ``wall_s`` the host SIGKILLs
every process in the call's cgroup (without a writable cgroup v1: of its user id) and returns
within about a second; the cgroup is then removed, and those of dead hosts by the next call.

Without root it runs under the host's own user id in an unprivileged user namespace: memory and
processes are bounded per process by the rlimits only, and ``/work``, ``/tmp`` and ``/dev/shm`` are
bwrap's tmpfs, ``disk_mb`` each, which allow exec.

What it does not protect against (docs/agents.md): kernel bugs (it shares the host's kernel; a VM
such as gVisor or Firecracker isolates more), native code run inside the interpreter (ctypes can
make any system call the filter allows: the filter, namespaces and limits bound it, nothing else),
CPU, memory bandwidth and page cache taken from the host while it runs, and what the program
prints being read by the model.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PYTHON = "/usr/bin/python3"  # Debian's: outside the host's virtual environment, its standard library only
CGROUPS = Path("/sys/fs/cgroup")  # cgroup v1: the memory and pids controllers, each a directory here
UID_BASE, UIDS_PER_HOST = 1_000_000, 256  # a call's user id: UID_BASE + host pid * 256 + a free slot

# Runs inside the sandbox before the program: hard limits (which the program cannot raise), then the program.
_LAUNCHER = """
import os, resource, sys
cpu, memory, processes, fsize = map(int, sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", sys.argv[5]])
"""

# Runs on the host as root, in a mount namespace of the call's own (``unshare --mount``): joins the
# call's cgroups (bwrap and everything it starts stay in them), mounts its disk: one sized noexec
# tmpfs (bwrap's own --tmpfs cannot be noexec) with the call's /work, /tmp and /dev/shm, which only
# its user id can enter; then becomes that user id and starts bwrap. The disk vanishes with the
# mount namespace when the call ends.
_ROOT_SETUP = """set -e
uid=$1 size=$2 disk=$3; shift 3
while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift
mount -n -t tmpfs -o "size=$size,mode=0755,noexec,nosuid,nodev" sandbox "$disk"
install -d -m 0700 -o "$uid" -g "$uid" "$disk/work" "$disk/tmp" "$disk/shm"
exec setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs "$@"
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # killed after this long
    cpu_s: int = 5  # per process
    memory_mb: int = 512  # the whole call's (its cgroup), and each process's address space
    processes: int = 16  # the whole call's (its cgroup; without one, of its user id)
    output_bytes: int = 16384  # of what it printed, read back
    disk_mb: int = 16  # /work, /tmp and /dev/shm together (each, without root); also the largest file it may write


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
    if platform.machine() != "x86_64":
        return f"its seccomp filter knows x86_64's system call numbers only, not {platform.machine()}'s"
    if os.geteuid() == 0 and not all(shutil.which(tool) for tool in ("unshare", "mount", "setpriv")):
        return "unshare, mount or setpriv is missing (Debian: apt-get install util-linux mount)"
    return None


# -- seccomp: a classic BPF program (linux/filter.h, linux/seccomp.h) that bwrap installs before the launcher.
_LOAD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000  # SECCOMP_RET_*
_AUDIT_ARCH_X86_64, _X32_BIT = 0xC000003E, 0x40000000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (x86_64 is little-endian: ARG0 is its low half)
_CLONE, _CLONE3, _SOCKET = 56, 435, 41
_CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: all inside its own network namespace
_DENIED = {  # x86_64 numbers (asm/unistd_64.h), each answered EPERM
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "open_by_handle_at": 304, "name_to_handle_at": 303, "quotactl": 179, "quotactl_fd": 443,
    "swapon": 167, "swapoff": 168, "reboot": 169, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "personality": 135, "syslog": 103, "acct": 163,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "iopl": 172, "ioperm": 173,
    "vhangup": 153, "uselib": 134, "lookup_dcookie": 212, "fanotify_init": 300, "memfd_create": 319,
    "memfd_secret": 447,
}


def seccomp_filter() -> bytes:
    """The filter bwrap loads (``--seccomp FD``): a wrong architecture kills the process; x32 calls,
    the ``_DENIED`` calls, clone with a namespace flag and sockets of other families get EPERM;
    clone3 gets ENOSYS (its flags sit behind a pointer a filter cannot read; libc then uses clone)."""
    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:  # struct sock_filter
        return struct.pack("=HBBI", code, jt, jf, k)

    eperm, allow = op(_RET, _ERRNO | errno.EPERM), op(_RET, _ALLOW)
    families = len(_SOCKET_FAMILIES)
    program = [
        op(_LOAD, _ARCH), op(_JEQ, _AUDIT_ARCH_X86_64, 1, 0), op(_RET, _KILL_PROCESS),
        op(_LOAD, _NR), op(_JGE, _X32_BIT, 0, 1), eperm,
        op(_JEQ, _CLONE3, 0, 1), op(_RET, _ERRNO | errno.ENOSYS),
        op(_JEQ, _CLONE, 0, 4), op(_LOAD, _ARG0), op(_JSET, _CLONE_NEW_NAMESPACES, 0, 1), eperm, allow,
        op(_JEQ, _SOCKET, 0, families + 3), op(_LOAD, _ARG0),
        *[op(_JEQ, family, families - i, 0) for i, family in enumerate(_SOCKET_FAMILIES)], eperm, allow,
    ]
    for number in sorted(_DENIED.values()):
        program += [op(_JEQ, number, 0, 1), eperm]
    return b"".join(program + [allow])


# -- what the sandbox mounts
@functools.cache
def _interpreter_files() -> tuple[tuple[str, str], ...]:
    """(host path, sandbox path) of what Debian's python3 needs: its binary, its standard library,
    the shared libraries they link (``ldd``), the time zone data ``zoneinfo`` reads."""
    binary = os.path.realpath(PYTHON)
    stdlib = f"/usr/lib/{os.path.basename(binary)}"  # /usr/lib/python3.11
    listed = subprocess.run(["ldd", binary, *sorted(glob.glob(f"{stdlib}/lib-dynload/*.so"))],
                            capture_output=True, text=True).stdout
    libraries = sorted(set(re.findall(r"(/\S+) \(0x", listed)))
    if not any("libc.so" in library for library in libraries):
        raise RuntimeError(f"the python tool's sandbox cannot run: `ldd {binary}` lists no libc")
    files = [(binary, PYTHON), (stdlib, stdlib), ("/usr/share/zoneinfo", "/usr/share/zoneinfo")]
    files += [(os.path.realpath(library), os.path.join(os.path.realpath(os.path.dirname(library)),
                                                       os.path.basename(library))) for library in libraries]
    return tuple((host, inside) for host, inside in files if os.path.exists(host))


def command(folder: Path, limits: Limits, seccomp_fd: int, own_disk: bool) -> list[str]:
    """The bwrap command line that runs ``folder/main.py``. ``own_disk``: ``folder/disk`` is the
    call's sized noexec tmpfs, with ``work``, ``tmp`` and ``shm`` in it (root); else bwrap mounts a
    sized tmpfs at each."""
    cmd = [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1",
           "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd), "--clearenv",
           "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/work", "--hostname", "sandbox"]
    for host, inside in _interpreter_files():
        cmd += ["--ro-bind", host, inside]
    for top in ("/bin", "/lib", "/lib32", "/lib64"):  # Debian's links into /usr, which the loader's paths use
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
    size = str(limits.disk_mb << 20)
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    for inside, name in (("/work", "work"), ("/tmp", "tmp"), ("/dev/shm", "shm")):
        cmd += ["--bind", str(folder / "disk" / name), inside] if own_disk else ["--size", size, "--tmpfs", inside]
    cmd += ["--ro-bind", str(folder / "main.py"), "/code/main.py", "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", "/work", PYTHON, "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s),
            str(limits.memory_mb << 20), str(_processes(limits)), size, "/code/main.py"]
    return cmd


def run_python(code: str, limits: Limits | None = None) -> Run:
    """Run ``code`` in a fresh sandbox; answers what it printed, its exit code, whether it was killed."""
    limits = limits or LIMITS
    why = unavailable()
    if why:
        raise RuntimeError(f"the python tool's sandbox cannot run: {why}")
    as_root = os.geteuid() == 0
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="yattflow-sandbox-")))
        os.chmod(folder, 0o755)
        (folder / "main.py").write_text(code)
        os.chmod(folder / "main.py", 0o644)
        (folder / "seccomp.bpf").write_bytes(seccomp_filter())
        seccomp = stack.enter_context(open(folder / "seccomp.bpf", "rb"))
        out = stack.enter_context(open(folder / "output", "wb+"))
        cgroup, uid = [], None
        bwrap = command(folder, limits, seccomp.fileno(), own_disk=as_root)
        if as_root:
            uid = stack.enter_context(_take_uid())
            cgroup = stack.enter_context(_call_cgroup(uid, limits))
            (folder / "disk").mkdir()
            procs = [str(path / "cgroup.procs") for path in cgroup]
            bwrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _ROOT_SETUP, "sh",
                     str(uid), str(limits.disk_mb << 20), str(folder / "disk"), *procs, "--", *bwrap]
        # bwrap and its helpers get no environment either
        proc = subprocess.Popen(bwrap, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, pass_fds=(seccomp.fileno(),),
                                env={"PATH": "/usr/bin:/bin"})
        try:
            exit_code, timed_out = proc.wait(timeout=limits.wall_s), False
        except subprocess.TimeoutExpired:
            exit_code, timed_out = None, True
        finally:
            _end(proc, cgroup, uid)
        out.seek(0)
        data = out.read(limits.output_bytes + 1)
    text = data[: limits.output_bytes].decode("utf-8", errors="replace")
    if len(data) > limits.output_bytes:
        text += f"\n[output cut at {limits.output_bytes} bytes]"
    return Run(text, exit_code, timed_out, limits)


# -- user ids and cgroups (root only)
_taken: set[int] = set()
_taken_lock = threading.Lock()


@contextlib.contextmanager
def _take_uid():
    """A user id no other call holds: this host's pid picks a block of ids no other live process
    has, and a call takes a free slot of it (calls run on threads) until it has ended."""
    first = UID_BASE + os.getpid() * UIDS_PER_HOST
    with _taken_lock:
        uid = next((u for u in range(first, first + UIDS_PER_HOST) if u not in _taken), None)
        if uid is None:
            raise RuntimeError(f"the python tool's sandbox runs at most {UIDS_PER_HOST} calls at once in one process")
        _taken.add(uid)
    try:
        yield uid
    finally:
        with _taken_lock:
            _taken.discard(uid)


def _cgroups_usable() -> bool:
    return all(os.access(CGROUPS / controller / "cgroup.procs", os.W_OK) for controller in ("memory", "pids"))


@contextlib.contextmanager
def _call_cgroup(uid: int, limits: Limits):
    """The call's cgroups (memory, pids), named by its user id, killed and removed when it ends; []
    where cgroup v1 is not writable (then memory and processes are bounded per process and per
    user id only)."""
    cgroup = _make_cgroup(uid, limits) if _cgroups_usable() else []
    try:
        yield cgroup
    finally:
        deadline = time.monotonic() + 1
        _kill_members(cgroup, deadline)
        _remove(cgroup, deadline)


def _make_cgroup(uid: int, limits: Limits) -> list[Path]:
    _remove_stale()
    memory, pids = CGROUPS / "memory" / f"yattflow-sandbox-{uid}", CGROUPS / "pids" / f"yattflow-sandbox-{uid}"
    for path in (memory, pids):
        if path.exists():  # left by a dead host that had this pid, or by a call whose removal failed
            _kill_members([path], time.monotonic() + 1)
            _remove([path], time.monotonic() + 1)
        path.mkdir()
    budget = str(limits.memory_mb << 20)
    (memory / "memory.limit_in_bytes").write_text(budget)
    if (memory / "memory.memsw.limit_in_bytes").exists():  # swap too, where it is accounted
        (memory / "memory.memsw.limit_in_bytes").write_text(budget)
    (pids / "pids.max").write_text(str(limits.processes))
    return [memory, pids]


def _remove_stale() -> None:
    """Kill and remove the cgroups of calls whose host process is gone (killed before it could).
    The host's pid is read from the name: hosts in other PID namespaces must not share this tree."""
    for controller in ("memory", "pids"):
        for cgroup in (CGROUPS / controller).glob("yattflow-sandbox-*"):
            uid = cgroup.name.removeprefix("yattflow-sandbox-")
            host = (int(uid) - UID_BASE) // UIDS_PER_HOST if uid.isdigit() else 0
            if host > 0 and host != os.getpid() and not _alive(host):
                _kill_members([cgroup], time.monotonic() + 1)
                _remove([cgroup], time.monotonic() + 1)


def _end(proc: subprocess.Popen, cgroup: list[Path], uid: int | None) -> None:
    """Every process of the call dead within about a second: those in its cgroup, bwrap's own,
    and without a cgroup those of its user id."""
    deadline = time.monotonic() + 1
    _kill_members(cgroup, deadline)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap's own process (the program's dies with it: --die-with-parent)
    proc.wait()
    if not cgroup and uid is not None:
        _reap(uid, deadline)


def _kill_members(cgroup: list[Path], deadline: float) -> None:
    """SIGKILL every process in the cgroups until none is left (a fork bomb's children included)."""
    _kill_until_gone(lambda: {int(pid) for path in cgroup for pid in _read(path / "cgroup.procs").split()}, deadline, 0.002)


def _kill_until_gone(alive, deadline: float, pause: float) -> None:
    """SIGKILL the pids ``alive()`` names, again and again, until it names none or ``deadline`` passes."""
    while (pids := alive()) and time.monotonic() <= deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(pause)


def _remove(cgroup: list[Path], deadline: float) -> None:
    """rmdir the cgroups: busy for a moment while their last processes exit; a stale one is retried later."""
    for path in cgroup:
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)


def _reap(uid: int, deadline: float) -> None:
    """Root without a cgroup: return once no process of the call's user id is alive (unique to the
    call: see ``_take_uid``). Stragglers get SIGKILL; zombies do not count."""
    _kill_until_gone(lambda: [int(p.name) for p in Path("/proc").iterdir()
                              if p.name.isdigit() and _owner(p) == uid and not _dead(p)], deadline, 0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


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
