"""The hosts' two process groups (``engines/backends/distributed.py``): trainer collectives on the default
group (NCCL on CUDA, gloo here), CPU metadata on a gloo group of its own.

On a GPU gloo cannot all-reduce CUDA tensors and NCCL cannot carry CPU ones, so a collective on
the wrong group fails there; here both groups are gloo and either would work. So two real gloo
processes record the group every collective is given (the real collectives run, observed on the
way through) and the test checks the routing: the balance plan's all-gather on the metadata group,
the trainers' gradient and count all-reduces (TorchTrainer and Megatron-Core's DDP) never on it.

And the groups of a DP run's hosts listen on the hosts' bind address only.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from datetime import timedelta

import pytest

import megatron_cpu

megatron_cpu.install()  # in the spawned workers too: they import this module

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from engines.backends import distributed  # noqa: E402
from tests.helpers import free_port, random_batch, save_tiny_model, with_old_logprobs  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier")


def test_local_hosts_take_one_gpu_each():
    from engines.wire.channel import HostError
    from engines.wire.launch import local_devices

    assert local_devices(2, None, gpus=0, visible=None) == [None, None]  # the CPU: nothing to choose
    assert local_devices(1, None, gpus=8, visible=None) == [None]  # one host sees every GPU
    assert local_devices(2, None, gpus=4, visible=None) == ["0", "1"]
    assert local_devices(2, None, gpus=2, visible="5,7") == ["5", "7"]  # the parent's numbering
    assert local_devices(2, ["0,1", "2,3"], gpus=4, visible=None) == ["0,1", "2,3"]  # hosts.devices wins
    with pytest.raises(HostError, match="4 local hosts need one GPU each and this machine shows 2"):
        local_devices(4, None, gpus=2, visible=None)


def test_backend_follows_the_device():
    assert distributed.backend_for("cuda:0") == distributed.backend_for(torch.device("cuda", 1)) == "nccl"
    assert distributed.backend_for("cpu") == "gloo"
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="not initialised"):
            distributed.metadata_group()


def _record_collectives(log: list) -> None:
    """Wrap torch.distributed's collectives so that each call notes the group it was given, then runs."""
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            log.append((_name, inspect.signature(_real).bind(*args, **kwargs).arguments.get("group")))
            return _real(*args, **kwargs)

        setattr(dist, name, recorded)


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    from engines.backends.base import fingerprint
    from engines.backends.distributed import all_gather_ints
    from engines.backends.torch.trainer import TorchTrainer
    from engines.config.layout import Layout
    from test_replica_check import replica_checks

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    distributed.init_process_groups("cpu", rank, 2, store, timedelta(seconds=120))
    try:
        meta = distributed.metadata_group()
        result = {
            "backend": dist.get_backend(), "metadata_backend": dist.get_backend(meta),
            "metadata_is_default": meta is dist.group.WORLD, "metadata_size": dist.get_world_size(meta),
        }
        log: list = []
        _record_collectives(log)

        def groups(calls):  # each call's group, by role: "metadata", "default" (None) or "other"
            return [(name, "metadata" if g is meta else "default" if g is None or g is dist.group.WORLD else "other")
                    for name, g in calls]

        result["gathered"] = all_gather_ints(list(range(rank, 3 + 2 * rank)))
        result["balance_calls"] = groups(log)
        log.clear()

        batch = random_batch(2 + rank, seed=rank)
        trainer = TorchTrainer(model_dir, lr=1e-3)
        trainer.train_step(with_old_logprobs(batch, trainer.logprobs(batch)), minibatches=2)
        result["torch_calls"] = groups(log)
        log.clear()
        result["whole_sha"] = fingerprint(trainer.export_weights())
        result["replicas"] = replica_checks(trainer, Layout(dp=2), rank, flip=1)
        result["replica_calls"] = groups(log)
        log.clear()

        if importlib.util.find_spec("megatron") is None:  # Megatron-Core is optional
            torch.save(result, os.path.join(out, f"rank{rank}.pt"))
            return
        from megatron.core import parallel_state

        from engines.backends.megatron.trainer import MegatronTrainer

        megatron = MegatronTrainer(model_dir, lr=1e-3)
        result["megatron_dp_backend"] = dist.get_backend(parallel_state.get_data_parallel_group())
        log.clear()  # construction's own collectives (group setup) aside: the step
        megatron.train_step(with_old_logprobs(batch, megatron.logprobs(batch)))
        result["megatron_calls"] = groups(log)
        result["megatron_replicas"] = replica_checks(megatron, Layout(dp=2), rank, flip=1)
        parallel_state.destroy_model_parallel()
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    model_dir = save_tiny_model(tmp / "model", hidden_size=32, num_layers=1)
    mp.spawn(_worker, args=(free_port(), model_dir, str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
def test_metadata_on_its_own_gloo_group_trainer_collectives_on_the_default(two_ranks):
    for r in two_ranks:
        assert r["backend"] == "gloo"  # backend_for the CPU
        assert r["metadata_backend"] == "gloo" and not r["metadata_is_default"] and r["metadata_size"] == 2
        # the balance plan: both ranks' integers, every collective on the metadata group
        assert r["gathered"] == [[0, 1, 2], [1, 2, 3, 4]]
        assert r["balance_calls"] and {group for _, group in r["balance_calls"]} == {"metadata"}
        # TorchTrainer: the gradient and count all-reduces, all on the default group
        assert {name for name, _ in r["torch_calls"]} == {"all_reduce"}
        assert {group for _, group in r["torch_calls"]} == {"default"}
        # the replica check: the replicas' shas equal (one process's fingerprint of its weights), a bit
        # flipped on rank 1 named with its tensor on both ranks, its few integers on the metadata group
        checked, flipped = r["replicas"], two_ranks[1]["replicas"]["flipped"][0]
        assert checked["sha"] == checked["again"] == two_ranks[0]["replicas"]["sha"] == r["whole_sha"]
        assert checked["flipped"][1] == ("replica check after the train step: dp-0 (rank 0) and dp-1 (rank 1) hold "
                                         f"different bits in {flipped!r}")
        assert r["replica_calls"] and {group for _, group in r["replica_calls"]} == {"metadata"}
        # Megatron-Core: DDP's gradient all-reduce and the counts go over its data-parallel group,
        # built on the default group's backend, never over the metadata group
        if "megatron_calls" not in r:
            pytest.skip("megatron-core is not installed")
        assert r["megatron_dp_backend"] == r["backend"]
        assert any(name == "all_reduce" for name, _ in r["megatron_calls"])
        assert "metadata" not in {group for _, group in r["megatron_calls"]}
        checked, flipped = r["megatron_replicas"], two_ranks[1]["megatron_replicas"]["flipped"][0]
        assert checked["sha"] == checked["again"] == two_ranks[0]["megatron_replicas"]["sha"]
        assert checked["flipped"][1].endswith(f"hold different bits in {flipped!r}")

def test_a_group_initialised_elsewhere_serves_metadata_only_if_gloo(tmp_path):
    """Code that initialises torch.distributed itself (a test's or a benchmark's gloo workers) gets
    the default group for metadata; a metadata group left from an earlier default group is not used."""
    distributed.init_process_groups("cpu", 0, 1, dist.HashStore(), timedelta(seconds=30))
    try:
        assert distributed.metadata_group() is not dist.group.WORLD
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert distributed.metadata_group() is dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_a_dp_runs_hosts_listen_on_their_bind_address_only(tmp_path, monkeypatch):
    """Nothing listens beyond the bind address (local hosts bind to loopback): after a dp=2
    setup, every listening socket of both hosts (and of any process they started) is on
    127.0.0.1: the channel, rank 0's rendezvous store, the gloo groups. torch's ``tcp://``
    rendezvous listened on every interface; gloo listens where ``GLOO_SOCKET_IFNAME`` (else the
    hostname) points, so the test points it at an interface off loopback where there is one."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import psutil
    import pyarrow as pa

    from engines.wire.channel import client
    from engines.wire.commands import SetupEngines
    from engines.config import RunConfig
    from engines.wire.launch import LocalHosts
    from storage import datasets

    up = psutil.net_if_stats()
    elsewhere = [name for name, addresses in psutil.net_if_addrs().items() if name in up and up[name].isup
                 and any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses)]
    if elsewhere:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", elsewhere[0])  # the hosts inherit it
    (tmp_path / "policy").mkdir()  # the stub engines read no weights
    datasets.write_table(str(tmp_path / "prompts" / "part-00000.parquet"),
                         pa.table({"prompt_id": [0, 1], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), datasets.PROMPTS)
    config = RunConfig(name="bind-test", dp=2, storage={"root": str(tmp_path)}, model={"policy": "policy"},
                       data={"prompts": "prompts", "heldout": None}, reward={"genrm_weight": 0.0, "rule_weight": 1.0},
                       rollout={"backend": "stub"}, judge={"backend": "stub"}, train={"backend": "stub"}, host_timeout_s=60)
    with LocalHosts("bind-test", 2, 1, 60, fork=True) as hosts:
        with ThreadPoolExecutor(2) as pool:  # the rendezvous: both hosts at once
            for f in [pool.submit(client("bind-test", g).call, SetupEngines(config=config, master=hosts.master)) for g in (0, 1)]:
                f.result()
        listening = {}  # rank -> the (address, port) its processes listen on
        for h in hosts.hosts:
            host = psutil.Process(h.proc.pid)
            listening[h.rank] = {(c.laddr.ip, c.laddr.port) for p in [host, *host.children(recursive=True)]
                                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert {ip for sockets in listening.values() for ip, _ in sockets} == {"127.0.0.1"}, listening
    for h in hosts.hosts:
        ports = {port for _, port in listening[h.rank]}
        assert h.address[1] in ports  # the channel
        own = {h.address[1], h.dist_port}
        assert ports - own, f"dp-{h.rank}: no gloo socket listens"  # gloo pairs connect to a listener of each rank
    assert hosts.hosts[0].dist_port in {port for _, port in listening[0]}  # the rendezvous store
