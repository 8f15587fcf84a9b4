"""Benchmarks: ``python -m bench`` runs them all and prints one table; ``python -m bench.<name>`` runs one.

Every benchmark runs offline and keeps its output readable: the defaults below apply to all of
them and to the processes they start (the environment overrides each)."""

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

for _key, _value in {
    "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}.items():
    os.environ.setdefault(_key, _value)


def cpu_model() -> str:
    """``lscpu``'s model name: figures from different machines are not comparable, so every
    benchmark table says where it ran (float kernels differ even between x86 CPUs)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown CPU")


class Sampler:
    """A thread that calls ``sample()`` every ``every`` seconds while in its ``with`` block (the
    benchmarks' meters of the processes they start)."""

    every = 1.0

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(self.every):
            self.sample()


@contextlib.contextmanager
def against(commit: str, prefix: str, **env: str):
    """A benchmark of this checkout against an earlier ``commit``, with ``yattflow`` commands of its own:
    yields ``(work, baseline, env, store)``: a fresh folder, a git worktree of ``commit`` in it (removed
    afterwards), an environment without PREFECT_API_URL (each command a temporary Prefect server, its
    home in the folder; plus ``env``) and the ``storage.root=`` override of the suite's tiny store,
    prepared there by this checkout."""
    from tests.sizes import TASK

    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix=prefix))
    baseline = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(baseline), commit], cwd=root, check=True)
    try:
        environ = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(work / "home")} | env
        store = f"storage.root={work / 'store'}"
        subprocess.run([sys.executable, "-m", "flows.cli", "prepare", *TASK, store], cwd=root, env=environ,
                       capture_output=True, check=True)
        yield work, baseline, environ, store
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=root, check=False)
