"""Engine hosts: one long-lived process per DP group that keeps its engines resident.

The DP-group sub-flow is the controller; the host is the muscle. Each Prefect task
sends a small command — a stage name, input URIs, an output URI, parameters, never
sample data — over a kept-open socket; the host reads its inputs from object storage,
computes, writes its outputs atomically, and answers with metrics and its log lines.

The channel is a way into a process that holds the model, so it binds to loopback
(unless the host runs on another node: ``flows/hosts.py``), authenticates the connection
with a per-run secret (``multiprocessing.connection`` HMAC challenge), serves one
controller, and exchanges JSON only — never pickles.

The hosts of one run form a ``torch.distributed`` group (NCCL when the trainer is on CUDA,
gloo on CPU), so the train step is a real collective; CPU metadata (the balance plan) goes
through a gloo group of its own (``engines/distributed.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

log = logging.getLogger("yattflow.host")


class HostError(RuntimeError):
    """A command failed inside an engine host; the message carries the host's traceback."""


# --------------------------------------------------------------------------- client side


class HostClient:
    """The controller's end of one host's channel: ``call(command, **params) -> result``."""

    def __init__(self, address: tuple[str, int], secret: bytes, group: int, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self._conn: Connection = Client(address, authkey=secret)
        self._lock = threading.Lock()

    def call(self, command: str, **params) -> tuple[dict, list[str]]:
        """Send one command and wait for its answer: (result + ``host_s``, the seconds the host
        spent on it; host log lines)."""
        with self._lock:
            try:
                self._conn.send_bytes(json.dumps({"command": command, "params": params}).encode())
                if not self._conn.poll(self.timeout_s):
                    raise HostError(f"dp-{self.group}: '{command}' got no answer within {self.timeout_s:.0f}s")
                reply = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise HostError(f"dp-{self.group}: engine host is gone ({type(e).__name__}) during '{command}'") from e
        if "error" in reply:
            error = HostError(f"dp-{self.group}: '{command}' failed in the engine host:\n{reply['error']}")
            error.logs = reply.get("logs", [])  # what the host logged before it failed
            raise error
        return reply["result"] | {"host_s": reply.get("host_s", 0.0)}, reply["logs"]  # shutdown answers without host_s

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


_clients: dict[tuple[str, int], HostClient] = {}


def client(run: str, group: int) -> HostClient:
    """The open channel to the host of ``group`` in ``run`` (opened by ``connect``)."""
    try:
        return _clients[(run, group)]
    except KeyError:
        raise HostError(f"no engine host for run '{run}' dp-{group} in this process") from None


def connect(run: str, group: int, address: tuple[str, int], secret: bytes, timeout_s: float) -> None:
    """Open the channel to a started host; tasks of ``run`` then reach it through ``client``."""
    _clients[(run, group)] = HostClient(address, secret, group, timeout_s)


def disconnect(run: str, world: int) -> None:
    """Ask every connected host of ``run`` to shut down, and close the channels."""
    for group in range(world):
        c = _clients.pop((run, group), None)
        if c is not None:
            try:
                c.call("shutdown")
            except HostError:
                pass
            c.close()


class HostProcess:
    """One engine-host process, started and read up to its ``READY`` line."""

    def __init__(self, rank: int, world: int, threads: int, secret: bytes, bind: str = "127.0.0.1",
                 devices: str | None = None):
        env = dict(os.environ, YATTFLOW_HOST_SECRET=secret.hex(), OMP_NUM_THREADS=str(threads))
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines flood the run's output
        project_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [project_root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "engines.host", "--rank", str(rank), "--world", str(world),
               "--threads", str(threads), "--bind", bind]
        # Its own process group: engines start processes of their own (vLLM's engine core,
        # checkpoint workers) that ``stop`` sweeps with it.
        self.rank = rank
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.address: tuple[str, int] | None = None
        self.dist_port: int | None = None

    def wait_ready(self) -> "HostProcess":
        """Block until the host listens: its first line is ``READY host:port dist_port``."""
        line = self.proc.stdout.readline().split()
        if len(line) != 3 or line[0] != "READY":
            raise HostError(f"dp-{self.rank}: engine host failed to start (exit code {self.proc.poll()})")
        host, port = line[1].rsplit(":", 1)
        self.address, self.dist_port = (host, int(port)), int(line[2])
        return self

    def stop(self, grace_s: float = 10) -> int:
        """Wait up to ``grace_s`` for it to exit, then kill its whole process group; its exit code."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait()


def local_devices(world: int, devices: list[str] | None, gpus: int, visible: str | None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of ``world`` local hosts on a machine with ``gpus`` GPUs
    (``visible``: the parent's CUDA_VISIBLE_DEVICES). ``devices`` (``hosts.devices``) when given;
    else one GPU per host, since NCCL refuses two ranks of one group on one GPU; on the CPU, or
    with one host, each inherits the parent's (None)."""
    if devices is not None:
        return list(devices)
    if world == 1 or gpus == 0:
        return [None] * world
    if gpus < world:
        raise HostError(f"dp={world} local hosts need one GPU each and this machine shows {gpus}: lower dp, "
                        "or set hosts.devices (one CUDA_VISIBLE_DEVICES entry per group)")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return ids[:world]


class LocalHosts:
    """Start, supervise and stop the engine hosts of one run as local subprocesses."""

    def __init__(self, run: str, world: int, threads: int, timeout_s: float, devices: list[str] | None = None):
        import torch

        self.run, self.world, self.threads, self.timeout_s = run, world, threads, timeout_s
        self.devices = local_devices(world, devices, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.hosts: list[HostProcess] = []
        self.master: str | None = None  # rank 0's torch.distributed rendezvous, "host:port"

    def __enter__(self) -> "LocalHosts":
        secret = secrets.token_bytes(32)
        try:
            self.hosts = [HostProcess(rank, self.world, self.threads, secret, devices=self.devices[rank])
                          for rank in range(self.world)]
            for h in self.hosts:
                connect(self.run, h.rank, h.wait_ready().address, secret, self.timeout_s)
            self.master = f"{self.hosts[0].address[0]}:{self.hosts[0].dist_port}"
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        disconnect(self.run, self.world)
        for h in self.hosts:
            h.stop()

    async def __aenter__(self) -> "LocalHosts":
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__(*exc)


def _free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- host side


class _Capture(logging.Handler):
    """Collects a command's log lines so they travel back with its answer."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def stable_seed(*parts) -> int:
    """A seed derived from (run seed, step, group, wave, ...): the same on every retry or resume."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's list of integers (lengths may differ), as int64 CPU tensors over the gloo
    metadata group (``engines/distributed.py``; the default group is NCCL on GPUs): unlike
    ``all_gather_object`` nothing is unpickled from the network."""
    import torch
    import torch.distributed as dist

    from engines.distributed import metadata_group

    group = metadata_group()
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(values)], dtype=torch.int64), group=group)
    mine = torch.zeros(max(max(int(s) for s in sizes), 1), dtype=torch.int64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [o[: int(s)].tolist() for o, s in zip(out, sizes)]


class EngineHost:
    """The engines of one DP group and the stage work done with them.

    Each public method below is a command. They read top to bottom like an RL step:
    validate → setup → rollout → score → filter → train_step → sync_weights → checkpoint
    (``placement.mode=partial``: ``rollout_and_score`` instead of rollout → score).
    """

    COMMANDS = {
        "validate", "setup", "rollout", "score", "rollout_and_score", "filter", "train_step", "sync_weights",
        "checkpoint", "checkpoint_wait", "evaluate", "export", "ping",
    }

    def __init__(self, rank: int, world: int, threads: int):
        self.rank, self.world, self.threads = rank, world, threads
        self.config = None
        self.prompts = None  # this group's stream of prompts (rows rank, rank+world, ...)
        self.engine_loads = 0  # times this host loaded its models: once per run is the point of a host
        self._awake: set[str] = set()  # the engines holding the group's devices (placement: see _take)

    # -- setup ---------------------------------------------------------------------------

    def validate(self, config: dict) -> dict:
        """Check prompts and model folders before any engine loads (no device time spent)."""
        from engines.validation import validate_inputs
        from flows.config import RunConfig

        return validate_inputs(RunConfig.model_validate(config))

    def setup(self, config: dict, resume: str | None = None, master: str | None = None) -> dict:
        """Join the DP group (rendezvous at ``master``, rank 0's "host:port"), load the engines
        once for the whole run, resume if asked."""
        import torch
        import torch.distributed as dist

        from engines import distributed
        from flows.config import RunConfig
        from storage import objectstore

        start = time.perf_counter()
        cfg = self.config = RunConfig.model_validate(config)
        torch.set_num_threads(self.threads)
        self.prompt_files = self._prompt_files(cfg.uri(cfg.data.prompts))
        if resume:
            self._check_prompt_files(cfg.uri(cfg.data.prompts), resume)  # before any engine loads
        # the timing stub trains nothing on a device: its one all-reduce is of a CPU tensor
        self.device = torch.device("cpu") if cfg.train.backend == "stub" else distributed.default_device()
        if self.world > 1 and not dist.is_initialized():
            distributed.init_process_groups(self.device, self.rank, self.world, f"tcp://{master}" if master else None,
                                            timedelta(seconds=cfg.host_timeout_s))
        policy_dir = objectstore.local_folder(cfg.uri(cfg.model.policy))
        self.trainer = make_trainer(cfg, policy_dir, self.device)
        self.policy = make_generator(cfg.rollout.backend, policy_dir, cfg, self.threads, self.device)
        self.judge = None
        if cfg.reward.genrm_weight > 0:
            judge_dir = objectstore.local_folder(cfg.uri(cfg.model.judge))
            if cfg.placement.mode == "partial":  # resident beside the rollout engine, on its share of the devices
                self.judge = JudgeProcess(cfg, judge_dir, cfg.placement.judge_threads or max(1, self.threads // 2),
                                          cfg.placement.judge_devices)
            else:
                self.judge = make_generator(cfg.judge.backend, judge_dir, cfg, self.threads, self.device)
        self.backends = f"rollout={cfg.rollout.backend} judge={cfg.judge.backend} train={cfg.train.backend}"
        self.rule = _import_function(cfg.reward.rule) if cfg.reward.rule else None
        self._awake = {"policy", "judge", "trainer"}  # all loaded, all on the devices
        self.engine_loads += 1
        self.prompts = self._load_prompts(cfg.uri(cfg.data.prompts))
        if resume:
            self._resume(resume)
        log.info("dp-%d: engines (%s) loaded in %.2fs, policy version %d", self.rank, self.backends, time.perf_counter() - start, self.trainer.version)
        return {"seconds": time.perf_counter() - start, "policy_version": self.trainer.version, "stream_length": len(self.prompts)}

    def _load_prompts(self, uri: str) -> list[dict]:
        """This group's stream: rows ``rank, rank+world, ...`` of every part file in name order.

        New part files that sort after the existing ones only extend each stream, so the
        cursors of a resumed run keep pointing at the same prompts and go on to the new ones
        (``_check_prompt_files`` refuses anything else)."""
        from storage import datasets

        table = datasets.read_table(uri, datasets.PROMPTS)
        rows = table.to_pylist()
        return rows[self.rank :: self.world]

    @staticmethod
    def _prompt_files(uri: str) -> list[list]:
        """``[file name, rows]`` of the prompts dataset, in the order the streams read them."""
        import pyarrow.parquet as pq

        from storage import objectstore

        files = []
        for part in objectstore.list_files(uri, suffix=".parquet"):
            fs, path = objectstore.fs_for(part)
            with fs.open(path, "rb") as f:
                files.append([part.rsplit("/", 1)[-1], pq.ParquetFile(f).metadata.num_rows])
        return files

    def _check_prompt_files(self, uri: str, checkpoint: str) -> None:
        """The prompts a checkpoint was trained on must still be the first rows of the dataset:
        the cursors it holds are positions in that order."""
        from storage import objectstore

        recorded = objectstore.join(checkpoint, "prompts.json")
        if not objectstore.exists(recorded):
            return  # a checkpoint written before this record existed
        for i, (name, rows) in enumerate(objectstore.read_json(recorded)["files"]):
            now = self.prompt_files[i] if i < len(self.prompt_files) else None
            if now != [name, rows]:
                found = f"'{now[0]}' ({now[1]} rows)" if now else "missing"
                raise ValueError(
                    f"data.prompts {uri}: part file {i + 1} (name order) was '{name}' ({rows} rows) when checkpoint "
                    f"{checkpoint} was written and is now {found}; the data cursors would point at other prompts. "
                    "Leave existing files as they are and add new prompts as new files that sort after them "
                    "(e.g. part-00001.parquet)."
                )

    # -- one RL step ---------------------------------------------------------------------

    def rollout(self, step: int, wave: int, cursor: int, count: int, out: str) -> dict:
        """Sample G responses for the next ``count`` prompts of this group's stream.

        Generated in chunks of ``placement.stream_chunk`` prompts, chunk k seeded by (seed, step,
        group, wave, k): the samples are the same whether the chunks run back to back here (full
        colocation) or stream to the judge in ``rollout_and_score`` (partial)."""
        start = time.perf_counter()
        switch = self._take("policy")
        batch = self._wave_prompts(cursor, count)
        rows = [r for k, chunk in enumerate(self._chunks(batch)) for r in self._generate_chunk(step, wave, k, chunk)]
        self._write_table(out, rows, "ROLLOUTS")
        return self._rollout_metrics(wave, cursor, count, rows, time.perf_counter() - start) | {"switch_s": switch}

    def score(self, rollouts: str, out: str) -> dict:
        """Reward = genrm_weight * judge verdict + rule_weight * rule + overlong penalty.

        The judge scores the rollout's chunks one by one (the same batches as in
        ``rollout_and_score``, so its batched greedy verdicts are the same in both placement modes)."""
        from storage import datasets

        start = time.perf_counter()
        switch = self._take("judge")  # full colocation: the rollout engine sleeps, the judge takes the devices
        rows = datasets.read_table(rollouts, datasets.ROLLOUTS).to_pylist()
        samples = self._chunks(rows, self.config.placement.stream_chunk * self.config.rollout.samples_per_prompt)
        scored = [r for chunk in samples for r in self._score_chunk(chunk)]
        self._write_table(out, scored, "SCORED")
        return self._score_metrics(scored, time.perf_counter() - start) | {"switch_s": switch}

    def rollout_and_score(self, step: int, wave: int, cursor: int, count: int, rollouts_out: str, scored_out: str) -> dict:
        """Partial colocation: ``rollout`` and ``score`` of one wave at once, with the same outputs.

        The rollout engine and the judge are both resident. This thread generates the wave chunk
        by chunk and puts every finished chunk on a bounded queue (``placement.queue_size``; a full
        queue makes the generator wait); a feeder thread hands the chunks as they come to the judge
        (``JudgeProcess`` in partial mode: a process on its own share of the devices, so neither
        engine waits for the other's Python) and collects the scores, while the rest of the wave is
        still generating. The rollout gets the rest of the group's threads (CPU).
        Answers ``{"rollout": ..., "score": ...}`` (each what its own command answers; their
        ``seconds``: generating, judge busy) and the overlap figures."""
        import queue

        import torch

        cfg = self.config
        start = time.perf_counter()
        switch = self._take("policy", "judge")
        batch = self._wave_prompts(cursor, count)
        finished: queue.Queue = queue.Queue(maxsize=cfg.placement.queue_size)
        scored: list[list[dict]] = []
        judge = {"busy_s": 0.0, "error": None}
        # CPU: the group's threads_per_host cores, split (full colocation gives each engine all of them)
        threads = cfg.placement.judge_threads or max(1, self.threads // 2)
        policy_threads = max(1, self.threads - threads)

        def judge_loop() -> None:
            torch.set_num_threads(threads)  # an in-process judge's share of the cores (JudgeProcess: set in its process)
            while (rows := finished.get()) is not None:
                if judge["error"] is not None:
                    continue  # keep draining: the generator never blocks on a failed judge
                t = time.perf_counter()
                try:
                    scored.append(self._score_chunk(rows))
                except BaseException as e:  # noqa: BLE001 - re-raised on the command's thread
                    judge["error"] = e
                judge["busy_s"] += time.perf_counter() - t

        thread = threading.Thread(target=judge_loop, name=f"genrm-judge-dp{self.rank}", daemon=True)
        thread.start()
        rows, blocked, complete = [], 0.0, False
        torch.set_num_threads(policy_threads)
        try:
            for k, chunk in enumerate(self._chunks(batch)):
                generated = self._generate_chunk(step, wave, k, chunk)
                rows += generated
                t = time.perf_counter()
                finished.put(generated)
                blocked += time.perf_counter() - t
                if judge["error"] is not None:
                    break  # the wave fails: stop generating
            else:
                complete = True
        finally:
            finished.put(None)
            torch.set_num_threads(self.threads)
        generate_s = time.perf_counter() - start
        if complete:
            self._write_table(rollouts_out, rows, "ROLLOUTS")  # while the judge scores the tail
        thread.join()
        if judge["error"] is not None:
            raise RuntimeError(f"dp-{self.rank}: the GenRM judge failed in wave {wave}") from judge["error"]
        flat = [r for chunk in scored for r in chunk]
        self._write_table(scored_out, flat, "SCORED")
        seconds = time.perf_counter() - start
        rolled = self._rollout_metrics(wave, cursor, count, rows, generate_s)
        score = self._score_metrics(flat, judge["busy_s"])
        log.info("dp-%d rollout_and_score wave %d: %.2fs (generating %.2fs, judge busy %.2fs, judge after the last chunk "
                 "%.2fs, generator waited on the queue %.2fs)", self.rank, wave, seconds, generate_s, judge["busy_s"],
                 seconds - generate_s, blocked)
        return {"rollout": rolled | {"switch_s": switch}, "score": score | {"switch_s": 0.0}, "seconds": seconds,
                "generate_s": generate_s, "judge_busy_s": judge["busy_s"], "judge_tail_s": seconds - generate_s,
                "queue_wait_s": blocked, "switch_s": switch}

    # the pieces both placement modes share (same chunks, same seeds, same judge batches)

    def _wave_prompts(self, cursor: int, count: int) -> list[dict]:
        batch = [self.prompts[(cursor + i) % len(self.prompts)] for i in range(count)]
        if (cursor + count - 1) // len(self.prompts) > cursor // len(self.prompts):
            log.warning("dp-%d: all %d prompts of this group's stream trained; starting it again (another epoch)", self.rank, len(self.prompts))
        return batch

    def _chunks(self, batch: list, size: int | None = None) -> list[list]:
        """``batch`` in pieces of ``size`` (default ``placement.stream_chunk``: prompts per chunk)."""
        size = size or self.config.placement.stream_chunk
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def _generate_chunk(self, step: int, wave: int, k: int, chunk: list[dict]) -> list[dict]:
        """Rollout rows of chunk ``k`` of a wave: G samples per prompt, prompt-major."""
        cfg = self.config
        n = cfg.rollout.samples_per_prompt
        gens = self.policy.generate(
            [row["prompt"] for row in chunk], n=n, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
            seed=stable_seed(cfg.seed, step, self.rank, wave, k),
        )
        rows = []
        for j, g in enumerate(gens):
            row = chunk[g.prompt_index]
            rows.append({
                "prompt_id": row["prompt_id"], "sample_index": j % n,
                "policy_version": self.trainer.version, "wave": wave, "prompt": row["prompt"], "answer": row["answer"],
                "image": row.get("image"),  # carried, not read: the engines here are text-only
                "prompt_ids": g.prompt_ids, "response": g.response, "response_ids": g.response_ids,
                "logprobs": g.logprobs, "truncated": g.truncated,
            })
        return rows

    def _score_chunk(self, rows: list[dict]) -> list[dict]:
        """``rows`` with their verdicts and rewards (new dicts: the rollout rows are left as they are)."""
        from engines.algorithms import overlong_penalty

        cfg = self.config
        verdicts = [None] * len(rows)
        if self.judge is not None and rows:
            judge_prompts = [cfg.judge.template.format(prompt=r["prompt"], response=r["response"], answer=r["answer"] or "") for r in rows]
            outs = self.judge.generate(judge_prompts, greedy=True, max_new_tokens=cfg.judge.max_new_tokens)
            verdicts = [o.response.strip() for o in outs]
        out = []
        for r, verdict in zip(rows, verdicts):
            genrm = None
            if verdict is not None:
                genrm = 1.0 if verdict.startswith(cfg.judge.good) else 0.0
            rule = float(self.rule(r["prompt"], r["response"], r["answer"])) if self.rule else None
            reward = cfg.reward.genrm_weight * (genrm or 0.0) + (cfg.reward.rule_weight * rule if rule is not None else 0.0)
            reward += overlong_penalty(len(r["response_ids"]), cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
            out.append(r | {"judge_text": verdict, "genrm_reward": genrm, "rule_reward": rule, "reward": reward})
        return out

    @staticmethod
    def _write_table(out: str, rows: list[dict], schema_name: str) -> None:
        """``rows`` as the dataset ``out`` with the schema ``storage.datasets.<schema_name>``."""
        import pyarrow as pa

        from storage import datasets

        schema = getattr(datasets, schema_name)
        datasets.write_table(out, pa.Table.from_pylist(rows, schema=schema), schema)

    def _rollout_metrics(self, wave: int, cursor: int, count: int, rows: list[dict], seconds: float) -> dict:
        tokens = sum(len(r["response_ids"]) for r in rows)
        log.info("dp-%d rollout wave %d: %d prompts x %d samples, %d tokens in %.2fs", self.rank, wave, count,
                 self.config.rollout.samples_per_prompt, tokens, seconds)
        return {"cursor": cursor + count, "samples": len(rows), "tokens": tokens, "seconds": seconds,
                "truncated": sum(r["truncated"] for r in rows)}

    def _score_metrics(self, rows: list[dict], seconds: float) -> dict:
        cfg = self.config
        good, bad = cfg.judge.good, cfg.judge.bad
        unparsed = sum(r["judge_text"] is not None and not (r["judge_text"].startswith(good) or r["judge_text"].startswith(bad))
                       for r in rows)
        known = [r for r in rows if r["genrm_reward"] is not None and r["rule_reward"] is not None and r["answer"] is not None]
        rewards = [r["reward"] for r in rows]
        rules = [r["rule_reward"] for r in rows if r["rule_reward"] is not None]
        return {
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "accuracy": sum(rules) / len(rules) if rules else None,
            "judge_agreement": sum(r["genrm_reward"] == r["rule_reward"] for r in known) / len(known) if known else None,
            "unparsed_verdicts": unparsed, "seconds": seconds,
        }

    def _take(self, *engines: str) -> float:
        """Placement: make ``engines`` (of "policy", "judge", "trainer") the ones holding the group's
        devices — the others release them first (``sleep``: vLLM offloads its weights to host memory
        and drops its KV cache; the Megatron trainer moves weights, gradients and optimizer state
        to host memory, ``engines/offload.py``), then these wake — and answer the seconds the
        switch took.

        Full colocation switches at every stage (rollout → score → train → sync); partial keeps
        policy and judge resident together through ``rollout_and_score``, and training still takes
        the devices alone. The torch engines have no ``sleep`` (on a GPU they stay resident side by
        side: the reference, not the production path); vLLM on a CPU has nothing to give back. The
        Megatron trainer's sleep releases its storages on a CPU too (the GPU's code path). Stages
        that only read the trainer's weights — ``export``, ``params_sha`` — read a sleeping
        trainer's host copy; those that need it live wake it (``train_step``, ``sync_weights``,
        ``checkpoint``)."""
        start = time.perf_counter()
        awake = self._awake
        for name in sorted(awake - set(engines)):
            engine = getattr(self, name, None)
            if engine is not None and hasattr(engine, "sleep"):
                engine.sleep()
            awake.discard(name)
        for name in engines:
            engine = getattr(self, name, None)
            if name not in awake and engine is not None and hasattr(engine, "wake"):
                engine.wake()
            awake.add(name)
        return time.perf_counter() - start

    def filter(self, scored: list[str], out: str, target_groups: int, step: int, carry_in: str | None = None,
               carry_out: str | None = None) -> dict:
        """DAPO dynamic sampling: keep prompt groups whose rewards differ, up to the target.

        ``scored``: this step's waves so far. Groups carried over from earlier steps (``carry_in``,
        the previous step's ``carry_out``) come first, oldest first, then this step's waves in
        order; the first ``target_groups`` are written to ``out`` with their advantages. The kept
        groups beyond the target are written to ``carry_out`` (schema ``CARRY``: with the step that
        generated them) if they will be at most ``sampling.max_carry_age`` steps old in the next
        step, and dropped otherwise; ``carry_out`` is removed when nothing is carried, so a retried
        or resumed filter leaves exactly its own answer. ``new_kept``: groups kept from the last
        wave (``scored[-1]``), for the controller's keep-ratio estimate."""
        import pyarrow as pa

        from engines.algorithms import group_advantages
        from storage import datasets, objectstore

        cfg = self.config
        max_age = cfg.sampling.max_carry_age
        carried: dict[tuple[int, int, int], list[dict]] = defaultdict(list)  # (step, wave, prompt_id): rows
        if carry_in:
            for r in datasets.read_table(carry_in, datasets.CARRY).to_pylist():
                carried[(r["step"], r["wave"], r["prompt_id"])].append(r)
        too_old = [key for key in carried if step - key[0] > max_age]  # only if max_carry_age was lowered
        for key in too_old:
            del carried[key]
        kept, equal, new_kept = [], 0, 0
        for i, uri in enumerate(scored):
            groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
            for r in datasets.read_table(uri, datasets.SCORED).to_pylist():
                groups[(r["wave"], r["prompt_id"])].append(r | {"step": step})
            for rows in groups.values():
                if cfg.sampling.filter_equal_rewards and len({r["reward"] for r in rows}) == 1:
                    equal += 1
                else:
                    kept.append(rows)
                    new_kept += i == len(scored) - 1
        candidates = list(carried.values()) + kept
        train, rest = candidates[:target_groups], candidates[target_groups:]
        carry = [rows for rows in rest if step + 1 - rows[0]["step"] <= max_age]
        flat = [r for rows in train for r in rows]
        advantages = group_advantages([r["reward"] for r in flat], [hash((r["step"], r["wave"], r["prompt_id"])) for r in flat],
                                      cfg.train.advantage_scale)
        for r, a in zip(flat, advantages):
            r["advantage"] = a
        datasets.write_table(out, pa.Table.from_pylist(flat, schema=datasets.EXPERIENCE), datasets.EXPERIENCE)
        if carry_out is not None:
            if carry:
                rows = [r for g in carry for r in g]
                datasets.write_table(carry_out, pa.Table.from_pylist(rows, schema=datasets.CARRY), datasets.CARRY)
            else:
                objectstore.remove(carry_out)
        enough = len(train) >= target_groups
        used = min(len(carried), target_groups)
        reason = "target reached" if enough else f"{len(train)}/{target_groups} groups kept, {equal} had equal rewards"
        if used:
            reason += f" ({used} carried over from earlier steps)"
        return {
            "kept": len(train), "dropped_equal": equal, "new_kept": new_kept, "enough": enough, "reason": reason,
            "carried_in": used,  # groups of earlier steps in this batch
            "surplus": len(rest),  # kept groups beyond the target ...
            "carried_out": len(carry) if carry_out is not None else 0,  # ... carried into the next step ...
            "surplus_dropped": len(rest) - (len(carry) if carry_out is not None else 0) + len(too_old),  # ... or dropped
            "carry": carry_out if carry and carry_out is not None else None,
        }

    def train_step(self, experience: str) -> dict:
        """One GRPO/DAPO update; gradients are all-reduced across every DP group.

        With ``train.balance_tokens`` the groups first even out their work (see ``_balance``);
        the update is the same without it, up to float summation order."""
        from storage import datasets

        cfg = self.config
        start = time.perf_counter()
        switch = self._take("trainer")  # training takes the group's devices (both placement modes)
        rows = datasets.read_table(experience, datasets.EXPERIENCE).to_pylist()
        batch, balanced = self._balance(experience, rows)
        t = cfg.train
        metrics = self.trainer.train_step(
            batch, minibatches=t.minibatches, aggregation=t.loss_aggregation,
            clip_low=t.clip_low, clip_high=t.clip_high, kl_coef=t.kl_coef, micro_batch_tokens=t.micro_batch_tokens,
        )
        seconds = time.perf_counter() - start
        metrics.update(seconds=seconds, sequences=len(batch), policy_version=self.trainer.version, params_sha=self.params_sha(), switch_s=switch,
                       engine_loads=self.engine_loads, **balanced)
        metrics["tokens_per_s"] = metrics["tokens"] / seconds if seconds else 0.0
        return metrics

    def _balance(self, experience: str, rows: list[dict]):
        """This rank's train batch, spread over the DP groups by token count (``engines/balance.py``).

        The hosts all-gather (experience URI, tokens per row) — small integers, as tensors, no
        pickles and no sample data — and every rank computes the same Karmarkar–Karp plan of
        each global minibatch (minibatch k of every group, as ``TrainBatch.split`` cuts it), then
        reads the rows it is given from the other groups' experience files. Each optimizer step
        thus sees the same sequences, normalised by the same global count, as without balancing.
        Returns (batch, metrics); ``balance_ratio`` is max/mean of the groups' tokens (prompt +
        response) after, ``balance_ratio_before`` before; both are reported with balancing off too.
        """
        import torch.distributed as dist

        from engines import balance
        from engines.torch_engines import TrainBatch
        from storage import datasets

        def to_batch(rs: list[dict]) -> TrainBatch:
            return TrainBatch([r["prompt_ids"] for r in rs], [r["response_ids"] for r in rs],
                              [r["logprobs"] for r in rs], [r["advantage"] for r in rs])

        start = time.perf_counter()
        tokens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
        info = {"tokens_before_balance": float(sum(len(r["response_ids"]) for r in rows)),
                "sequences_before_balance": len(rows), "rows_received": 0, "balance_ratio": 1.0, "balance_ratio_before": 1.0}
        if self.world == 1 or not dist.is_initialized():
            return to_batch(rows), info | {"balance_s": time.perf_counter() - start}
        uri = list(experience.encode())
        gathered = _all_gather_ints([len(uri), *uri, *tokens])
        uris = [bytes(g[1 : 1 + g[0]]).decode() for g in gathered]
        counts = [g[1 + g[0] :] for g in gathered]
        info["balance_ratio"] = info["balance_ratio_before"] = balance.imbalance([sum(c) for c in counts])
        if not self.config.train.balance_tokens:
            return to_batch(rows), info | {"balance_s": time.perf_counter() - start}
        layout = balance.plan(counts, self.config.train.minibatches)
        wanted: dict[int, set[int]] = defaultdict(set)
        for minibatch in layout[self.rank]:
            for src, i in minibatch:
                wanted[src].add(i)
        fetched = {(self.rank, i): rows[i] for i in wanted.pop(self.rank, ())}
        for src, indices in sorted(wanted.items()):
            table = datasets.read_table(uris[src], datasets.EXPERIENCE)
            if table.num_rows != len(counts[src]):
                raise RuntimeError(f"{uris[src]}: {table.num_rows} rows, but dp-{src} trains on {len(counts[src])}: it changed under the step")
            indices = sorted(indices)
            fetched.update(zip(((src, i) for i in indices), table.take(indices).to_pylist()))
        for (src, i), r in fetched.items():
            if len(r["prompt_ids"]) + len(r["response_ids"]) != counts[src][i]:
                raise RuntimeError(f"{uris[src]} row {i}: not the row dp-{src} announced (token count differs)")
        batch = balance.presplit([to_batch([fetched[x] for x in minibatch]) for minibatch in layout[self.rank]])
        info.update(rows_received=sum(src != self.rank for src, _ in fetched),
                    balance_ratio=balance.imbalance(balance.plan_totals(counts, layout)), balance_s=time.perf_counter() - start)
        return batch, info

    def params_sha(self) -> str:
        """Fingerprint of the trainer's parameters: equal on every replica after a step."""
        import torch

        h = hashlib.sha256()
        for _, p in self.trainer.export_weights():
            # the raw bytes, whatever the device and dtype (numpy has no bfloat16)
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def sync_weights(self) -> dict:
        """Trainer → rollout engine, by Hugging Face parameter name."""
        start = time.perf_counter()
        switch = self._take("policy", "trainer")  # a sleeping vLLM engine cannot load weights
        count = self.policy.update_weights(self.trainer.export_weights())
        return {"tensors": count, "seconds": time.perf_counter() - start, "switch_s": switch}

    # the checkpoint write in flight (or finished and not yet collected), and the host-memory copy
    # of the trainer's state it wrote, whose tensors the next checkpoint copies into
    _write: "_BackgroundWrite | None" = None
    _staged: dict | None = None

    def checkpoint(self, uri: str) -> dict:
        """Write this rank's share of a checkpoint; the controller commits the manifest.

        Layout: ``trainer-{backend}/`` (the train engine's own format: one file for torch,
        Megatron ``dist_checkpointing`` shards written by every rank), ``model/`` (the policy
        as a Hugging Face folder, rank 0), ``prompts.json`` (rank 0) and ``rng-{rank}.pt``.

        With ``checkpoint.asynchronous`` this returns as soon as the state is copied into host
        memory (``stall_s``: how long training waited) while a thread writes the copy;
        ``checkpoint_wait`` then answers with the files. Otherwise it returns after the write,
        with the files.
        """
        leftover = self._finish_write()  # one write at a time (normally collected by checkpoint_wait already)
        if leftover is not None:
            log.warning("dp-%d: checkpoint %s was written but never collected with checkpoint_wait", self.rank, leftover["uri"])
        start = time.perf_counter()
        self._take(*self._awake | {"trainer"})  # awake after sync_weights anyway; reads a sleeping trainer never
        asynchronous = self.config.checkpoint.asynchronous
        write = self._freeze_checkpoint(uri, copy=asynchronous)
        if not asynchronous:
            files = write()
            seconds = time.perf_counter() - start
            return {"files": files, "asynchronous": False, "stall_s": seconds, "seconds": seconds}
        self._write = _BackgroundWrite(uri, write)
        stall = time.perf_counter() - start
        log.info("dp-%d: checkpoint %s: state copied in %.3fs, writing in the background", self.rank, uri, stall)
        return {"files": None, "asynchronous": True, "stall_s": stall, "seconds": stall}

    def checkpoint_wait(self) -> dict:
        """Wait for the background checkpoint write; its ``uri``, ``files`` (None and None when no
        write was started since the last wait), ``write_s`` and ``wait_s`` (how long this call
        blocked). A failed write raises here, with the writer's traceback."""
        start = time.perf_counter()
        done = self._finish_write()
        if done is None:
            return {"uri": None, "files": None, "write_s": 0.0, "wait_s": 0.0}
        return done | {"wait_s": time.perf_counter() - start}

    def _finish_write(self) -> dict | None:
        write, self._write = self._write, None
        return write.result() if write is not None else None

    def _freeze_checkpoint(self, uri: str, copy: bool):
        """Take what this rank's checkpoint holds *now*; return a function that writes it to
        ``uri`` and returns the file names. With ``copy`` the function reads only host-memory
        copies (and files already written), so it may run on another thread while the next
        steps change the live state; without, it writes the live state (call it at once)."""
        import shutil

        import torch

        from engines.torch_engines import to_bytes
        from storage import objectstore

        backend = self.config.train.backend
        tmp = tempfile.mkdtemp(prefix="yattflow-checkpoint-")
        trainer_dir = os.path.join(tmp, f"trainer-{backend}")
        try:
            hf = None  # rank 0's Hugging Face weights; None: the live ones
            if hasattr(self.trainer, "checkpoint_state"):  # torch: copied now (rank 0), serialised by the writer
                state = None
                if copy:
                    state = self._staged = self.trainer.checkpoint_state(into=self._staged)
                    hf = state["model"] if state is not None else None
                trainer_files = lambda: self.trainer.save_checkpoint(trainer_dir, state)  # noqa: E731
            else:
                # Megatron: dist_checkpointing's save is a collective (the DP ranks split the
                # replicated tensors), which must not run on another thread beside the train step's
                # collectives; so the shards are written to local disk here, and only their upload,
                # the Hugging Face folder and the rest are left to the writer.
                written = self.trainer.save_checkpoint(trainer_dir)
                trainer_files = lambda: written  # noqa: E731
                if copy and self.rank == 0:
                    hf = dict(self.trainer.export_weights())  # host-memory copies
            rng = to_bytes({"torch": torch.get_rng_state(), "python": random.getstate()})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        rank, prompt_files = self.rank, list(self.prompt_files)

        def write() -> list[str]:
            try:
                files = [f"trainer-{backend}/{f}" for f in trainer_files()]
                if rank == 0:
                    self.trainer.save_hf(os.path.join(tmp, "model"), tensors=hf)
                    files += sorted(str(p.relative_to(tmp)) for p in Path(tmp, "model").rglob("*") if p.is_file())
                objectstore.write_bytes(objectstore.join(uri, f"rng-{rank}.pt"), rng)
                _test_checkpoint_pause()
                for name in files:
                    objectstore.write_bytes(objectstore.join(uri, name), Path(tmp, name).read_bytes())
                if rank == 0:  # the prompt files this run's streams (and so the cursors) were read from
                    objectstore.write_json(objectstore.join(uri, "prompts.json"), {"files": prompt_files})
                    files.append("prompts.json")
                return [f"rng-{rank}.pt", *files]
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        return write

    def _resume(self, uri: str) -> None:
        import torch

        from engines.torch_engines import from_bytes
        from storage import objectstore

        local = objectstore.local_folder(uri)
        trainer_dir = Path(local, f"trainer-{self.config.train.backend}")
        if not trainer_dir.is_dir():
            found = sorted(p.name for p in Path(local).glob("trainer-*"))
            raise ValueError(f"{uri}: no {trainer_dir.name}/ to resume train.backend={self.config.train.backend} from (found {found})")
        self.trainer.load_checkpoint(str(trainer_dir))
        rng = from_bytes(objectstore.read_bytes(objectstore.join(uri, f"rng-{self.rank}.pt")))
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        self.sync_weights()
        log.info("dp-%d: resumed from %s (policy version %d, parameters %s)", self.rank, uri, self.trainer.version, self.params_sha())

    def export(self, uri: str) -> dict:
        """Write the current policy as a Hugging Face folder (MANIFEST.json last). A sleeping
        trainer is not woken: its weights are read from its host copy."""
        from storage import objectstore

        if self.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                self.trainer.save_hf(tmp)
                objectstore.upload_folder(tmp, uri)
        return {"uri": uri}

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, uri: str, limit: int) -> dict:
        """Greedy exact-match accuracy of the current policy on this rank's share of held-out prompts."""
        from storage import datasets

        cfg = self.config
        rows = datasets.read_table(uri, datasets.PROMPTS).slice(0, limit).to_pylist()[self.rank :: self.world]
        if not rows or self.rule is None:
            return {"correct": 0, "total": 0}
        self._take("policy")
        outs = self.policy.generate([r["prompt"] for r in rows], greedy=True, max_new_tokens=cfg.rollout.max_new_tokens)
        correct = sum(self.rule(rows[o.prompt_index]["prompt"], o.response, rows[o.prompt_index]["answer"]) for o in outs)
        return {"correct": int(correct), "total": len(rows)}

    def ping(self) -> dict:
        return {"pid": os.getpid(), "rank": self.rank}


class _BackgroundWrite:
    """One checkpoint write on a thread of its own; ``result()`` waits for it and re-raises its error."""

    def __init__(self, uri: str, write):
        self.uri, self.files, self.error, self.seconds = uri, None, None, None
        self._started = time.perf_counter()
        # a daemon: a host that shuts down (or fails) before the write was collected does not
        # wait for it; an uncollected checkpoint is never committed anyway
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, write) -> None:
        try:  # Linux schedules threads one by one: where CPU is short, training goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # (on 2 cores: step +30% instead of +100%)
        except (AttributeError, OSError):
            pass
        try:
            self.files = write()
        except BaseException as e:  # noqa: BLE001 - handed to whoever collects the write
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self._started

    def result(self) -> dict:
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"checkpoint write to {self.uri} failed after {self.seconds:.2f}s") from self.error
        return {"uri": self.uri, "files": self.files, "write_s": self.seconds}


def _test_checkpoint_pause() -> None:
    """TEST HOOK ONLY: ``YATTFLOW_TEST_CHECKPOINT_DELAY_S`` makes every checkpoint writer pause that
    many seconds after its first file, so that a test can kill a run while a checkpoint is half
    written (tests/test_checkpoint.py). Read only here, on the writer's thread; never set it in a real run."""
    delay = float(os.environ.get("YATTFLOW_TEST_CHECKPOINT_DELAY_S") or 0)
    if delay > 0:
        time.sleep(delay)


def make_trainer(cfg, model_dir: str, device=None):
    """The train engine the config names, on the policy's Hugging Face folder, on ``device``
    (None: ``engines.distributed.default_device()``)."""
    t = cfg.train
    kwargs = dict(
        lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        temperature=cfg.rollout.temperature, reference=t.kl_coef > 0, dtype=cfg.model.dtype,
    )
    if t.backend == "stub":  # timing stub for scale benchmarks, not training (engines/stub.py)
        from engines.stub import TimingStubTrainer

        return TimingStubTrainer(model_dir, seconds_per_token=t.stub_seconds_per_token)
    if t.backend == "megatron":
        from engines.megatron_engine import MegatronTrainer

        return MegatronTrainer(model_dir, tensor_parallel=t.tensor_parallel, distributed_optimizer=t.distributed_optimizer,
                               recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
                               recompute_num_layers=t.recompute_num_layers, recompute_modules=t.recompute_modules,
                               device=device, **kwargs)
    from engines.torch_engines import TorchTrainer

    return TorchTrainer(model_dir, device=device, **kwargs)


def make_generator(backend: str, model_dir: str, cfg, threads: int, device=None):
    """A generation engine (policy rollout or GenRM judge) of the named backend."""
    if backend == "stub":  # timing stub for scale benchmarks, not training (engines/stub.py)
        from engines.stub import TimingStubGenerator

        return TimingStubGenerator(model_dir, cfg.rollout.stub_seconds_per_token, (cfg.judge.good, cfg.judge.bad))
    if backend == "vllm":
        from engines.vllm_engine import VLLMGenerator

        # threads: in a DP host vLLM runs in its own process, which does not inherit torch's setting
        return VLLMGenerator(model_dir, dtype=cfg.model.dtype, seed=cfg.seed, threads=threads)
    from engines.torch_engines import TorchGenerator

    return TorchGenerator(model_dir, dtype=cfg.model.dtype, device=device)


class JudgeProcess:
    """Partial colocation's GenRM judge: a generator of its own in a child process, with its own
    share of the group's devices (CUDA: ``placement.judge_devices`` of the host's visible ones;
    CPU: ``placement.judge_threads`` torch threads), so that it computes beside the rollout engine
    (in another process, neither waits for the other's Python: no GIL between them).

    Same methods as a generator (``generate``, ``sleep``, ``wake``); calls go over a pipe to the
    host's own child (never the network), one at a time. The child exits when the pipe closes
    (and with the host's process group)."""

    def __init__(self, cfg, model_dir: str, threads: int, devices: list[int] | None = None):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited torch or CUDA state
        self._conn, child = ctx.Pipe()
        env = {}
        if devices is not None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
        self._lock = threading.Lock()
        self.process = ctx.Process(target=_judge_process, args=(child, cfg.model_dump(), model_dir, threads, env),
                                   name="genrm-judge", daemon=True)
        self.process.start()
        child.close()
        self._call("ping")  # loaded: fail at setup, not in the first wave

    def _call(self, method: str, *args, **kwargs):
        with self._lock:
            try:
                self._conn.send((method, args, kwargs))
                ok, value = self._conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"the GenRM judge process is gone (exit code {self.process.exitcode})") from e
        if not ok:
            raise RuntimeError(f"the GenRM judge process failed in '{method}':\n{value}")
        return value

    def generate(self, prompts: list[str], **kwargs):
        return self._call("generate", prompts, **kwargs)

    def sleep(self) -> None:
        self._call("sleep")

    def wake(self) -> None:
        self._call("wake")

    def close(self) -> None:
        self._conn.close()
        self.process.join(timeout=10)


def _judge_process(conn, config: dict, model_dir: str, threads: int, env: dict) -> None:
    """The judge's child process: load the generator, then answer calls until the pipe closes."""
    os.environ.update(env)  # before torch (and CUDA) load
    import torch

    from flows.config import RunConfig

    torch.set_num_threads(threads)
    cfg = RunConfig.model_validate(config)
    try:
        judge = make_generator(cfg.judge.backend, model_dir, cfg, threads)
    except Exception:  # noqa: BLE001 - answered to the first call
        judge, error = None, traceback.format_exc()
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if judge is None:
                raise RuntimeError(f"the judge did not load:\n{error}")
            if method == "ping":
                value = None
            elif method in ("sleep", "wake"):
                value = getattr(judge, method)() if hasattr(judge, method) else None
            else:
                value = judge.generate(*args, **kwargs)
            conn.send((True, value))
        except Exception:  # noqa: BLE001 - sent back to the host's command
            conn.send((False, traceback.format_exc()))


def _import_function(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _exit_with_parent() -> None:
    """A host never outlives the run that started it (no orphaned engines holding devices)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)  # this host and every process its engines started

    threading.Thread(target=watch, daemon=True).start()


def advertised_address(bind: str) -> str:
    """The address the controller and the other hosts reach this host at."""
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    # YATTFLOW_HOST_ADDRESS: set it on nodes whose hostname does not resolve to a routable
    # address (e.g. a Kubernetes pod: the downward API's status.podIP).
    return os.environ.get("YATTFLOW_HOST_ADDRESS") or socket.gethostbyname(socket.gethostname())


def serve(rank: int, world: int, threads: int, bind: str = "127.0.0.1") -> None:
    """Listen on ``bind``, answer one controller's commands until ``shutdown``.

    A host belongs to one run: if the controller's connection ends without ``shutdown`` (the
    run crashed or was cancelled), the host exits rather than hold its devices.
    """
    secret = bytes.fromhex(os.environ.pop("YATTFLOW_HOST_SECRET"))
    _exit_with_parent()
    host = EngineHost(rank, world, threads)
    capture = _Capture()
    capture.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("yattflow").addHandler(capture)
    logging.getLogger("yattflow").setLevel(logging.INFO)
    with Listener((bind, 0), authkey=secret) as listener:
        address = advertised_address(bind)
        dist_port = _free_port(bind)  # for rank 0: the DP group's torch.distributed rendezvous
        print(f"READY {address}:{listener.address[1]} {dist_port}", flush=True)
        # Nobody reads our stdout after READY: send whatever comes later (engine libraries and
        # the processes they spawn write there) to stderr, so a full pipe can never block us.
        os.dup2(2, 1)
        conn = listener.accept()
        while True:
            try:
                message = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                log.error("dp-%d: the controller's connection closed without 'shutdown'; exiting", rank)
                sys.exit(3)
            command, params = message.get("command"), message.get("params", {})
            capture.lines = []
            if command == "shutdown":
                conn.send_bytes(json.dumps({"result": {}, "logs": []}).encode())
                return
            start = time.perf_counter()
            try:
                if command not in EngineHost.COMMANDS:
                    raise ValueError(f"unknown command {command!r}")
                reply = {"result": getattr(host, command)(**params)}
            except Exception:  # noqa: BLE001 - every failure goes back to the task
                reply = {"error": traceback.format_exc()}
            reply["logs"] = capture.lines
            reply["host_s"] = time.perf_counter() - start  # engine-side time: the rest is orchestration
            conn.send_bytes(json.dumps(reply).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description="yattflow engine host (started by the training run)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bind", default="127.0.0.1", help="listen address (0.0.0.0: reachable from other nodes)")
    args = parser.parse_args()
    serve(args.rank, args.world, args.threads, args.bind)


if __name__ == "__main__":
    main()
