"""Engine hosts: one long-lived process per DP group that keeps its engines resident.

The DP-group sub-flow is the controller; the host is the muscle. Each Prefect task
sends a small command — a stage name, input URIs, an output URI, parameters, never
sample data — over a kept-open socket; the host reads its inputs from object storage,
computes, writes its outputs atomically, and answers with metrics and its log lines.

The channel is a way into a process that holds the model, so it binds to loopback,
authenticates every connection with a per-run secret (``multiprocessing.connection``
HMAC challenge) and exchanges JSON only — never pickles.

The hosts of one run form a ``torch.distributed`` group (gloo on CPU), so the train
step is a real collective.
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
    """The open channel to the host of ``group`` in ``run`` (registered by ``LocalHosts``)."""
    try:
        return _clients[(run, group)]
    except KeyError:
        raise HostError(f"no engine host for run '{run}' dp-{group} in this process") from None


class LocalHosts:
    """Start, supervise and stop the engine hosts of one run as local subprocesses."""

    def __init__(self, run: str, world: int, threads: int, timeout_s: float):
        self.run, self.world, self.threads, self.timeout_s = run, world, threads, timeout_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "LocalHosts":
        secret = secrets.token_bytes(32)
        env = dict(os.environ, YATTFLOW_HOST_SECRET=secret.hex(), OMP_NUM_THREADS=str(self.threads))
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines flood the run's output
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(_free_port())
        project_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [project_root, env.get("PYTHONPATH")]))
        try:
            for rank in range(self.world):
                cmd = [sys.executable, "-m", "engines.host", "--rank", str(rank), "--world", str(self.world)]
                cmd += ["--threads", str(self.threads)]
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True))
            for rank, proc in enumerate(self.procs):
                line = proc.stdout.readline().strip()  # "READY host:port", printed once the socket listens
                if not line.startswith("READY "):
                    raise HostError(f"dp-{rank}: engine host failed to start (exit code {proc.poll()})")
                host, port = line.split()[1].rsplit(":", 1)
                _clients[(self.run, rank)] = HostClient((host, int(port)), secret, rank, self.timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for rank in range(self.world):
            c = _clients.pop((self.run, rank), None)
            if c is not None:
                try:
                    c.call("shutdown")
                except HostError:
                    pass
                c.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            # Each host leads its own process group; engines may have started processes of
            # their own (vLLM's engine core, checkpoint workers) that outlive a host: sweep them.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
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


class EngineHost:
    """The engines of one DP group and the stage work done with them.

    Each public method below is a command. They read top to bottom like an RL step:
    validate → setup → rollout → score → filter → train_step → sync_weights → checkpoint.
    """

    COMMANDS = {
        "validate", "setup", "rollout", "score", "filter", "train_step", "sync_weights",
        "checkpoint", "evaluate", "export", "ping",
    }

    def __init__(self, rank: int, world: int, threads: int):
        self.rank, self.world, self.threads = rank, world, threads
        self.config = None
        self.prompts = None  # this group's stream of prompts (rows rank, rank+world, ...)
        self.engine_loads = 0  # times this host loaded its models: once per run is the point of a host

    # -- setup ---------------------------------------------------------------------------

    def validate(self, config: dict) -> dict:
        """Check prompts and model folders before any engine loads (no device time spent)."""
        from engines.validation import validate_inputs
        from flows.config import RunConfig

        return validate_inputs(RunConfig.model_validate(config))

    def setup(self, config: dict, resume: str | None = None) -> dict:
        """Join the DP group, load the engines once for the whole run, resume if asked."""
        import torch
        import torch.distributed as dist

        from flows.config import RunConfig
        from storage import objectstore

        start = time.perf_counter()
        cfg = self.config = RunConfig.model_validate(config)
        torch.set_num_threads(self.threads)
        self.prompt_files = self._prompt_files(cfg.uri(cfg.data.prompts))
        if resume:
            self._check_prompt_files(cfg.uri(cfg.data.prompts), resume)  # before any engine loads
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world, timeout=timedelta(seconds=cfg.host_timeout_s))
        policy_dir = objectstore.local_folder(cfg.uri(cfg.model.policy))
        self.trainer = make_trainer(cfg, policy_dir)
        self.policy = make_generator(cfg.rollout.backend, policy_dir, cfg, self.threads)
        self.judge = None
        if cfg.reward.genrm_weight > 0:
            self.judge = make_generator(cfg.judge.backend, objectstore.local_folder(cfg.uri(cfg.model.judge)), cfg, self.threads)
        self.backends = f"rollout={cfg.rollout.backend} judge={cfg.judge.backend} train={cfg.train.backend}"
        self.rule = _import_function(cfg.reward.rule) if cfg.reward.rule else None
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
        """Sample G responses for the next ``count`` prompts of this group's stream."""
        import pyarrow as pa

        from storage import datasets

        cfg = self.config
        start = time.perf_counter()
        batch = [self.prompts[(cursor + i) % len(self.prompts)] for i in range(count)]
        if (cursor + count - 1) // len(self.prompts) > cursor // len(self.prompts):
            log.warning("dp-%d: all %d prompts of this group's stream trained; starting it again (another epoch)", self.rank, len(self.prompts))
        gens = self.policy.generate(
            [row["prompt"] for row in batch], n=cfg.rollout.samples_per_prompt, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
            seed=stable_seed(cfg.seed, step, self.rank, wave),
        )
        rows = []
        for j, g in enumerate(gens):
            row = batch[g.prompt_index]
            rows.append({
                "prompt_id": row["prompt_id"], "sample_index": j % cfg.rollout.samples_per_prompt,
                "policy_version": self.trainer.version, "wave": wave, "prompt": row["prompt"], "answer": row["answer"],
                "prompt_ids": g.prompt_ids, "response": g.response, "response_ids": g.response_ids,
                "logprobs": g.logprobs, "truncated": g.truncated,
            })
        datasets.write_table(out, pa.Table.from_pylist(rows, schema=datasets.ROLLOUTS), datasets.ROLLOUTS)
        seconds = time.perf_counter() - start
        tokens = sum(len(r["response_ids"]) for r in rows)
        log.info("dp-%d rollout wave %d: %d prompts x %d samples, %d tokens in %.2fs", self.rank, wave, count, cfg.rollout.samples_per_prompt, tokens, seconds)
        return {"cursor": cursor + count, "samples": len(rows), "tokens": tokens, "seconds": seconds,
                "truncated": sum(r["truncated"] for r in rows)}

    def score(self, rollouts: str, out: str) -> dict:
        """Reward = genrm_weight * judge verdict + rule_weight * rule + overlong penalty."""
        import pyarrow as pa

        from engines.algorithms import overlong_penalty
        from storage import datasets

        cfg = self.config
        start = time.perf_counter()
        rows = datasets.read_table(rollouts, datasets.ROLLOUTS).to_pylist()
        verdicts = [None] * len(rows)
        if self.judge is not None:
            judge_prompts = [cfg.judge.template.format(prompt=r["prompt"], response=r["response"], answer=r["answer"] or "") for r in rows]
            outs = self.judge.generate(judge_prompts, greedy=True, max_new_tokens=cfg.judge.max_new_tokens)
            verdicts = [o.response.strip() for o in outs]
        unparsed = agree = rule_known = 0
        for r, verdict in zip(rows, verdicts):
            genrm = None
            if verdict is not None:
                genrm = 1.0 if verdict.startswith(cfg.judge.good) else 0.0
                unparsed += not (verdict.startswith(cfg.judge.good) or verdict.startswith(cfg.judge.bad))
            rule = float(self.rule(r["prompt"], r["response"], r["answer"])) if self.rule else None
            if genrm is not None and rule is not None and r["answer"] is not None:
                rule_known += 1
                agree += genrm == rule
            reward = cfg.reward.genrm_weight * (genrm or 0.0) + (cfg.reward.rule_weight * rule if rule is not None else 0.0)
            reward += overlong_penalty(len(r["response_ids"]), cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
            r.update(judge_text=verdict, genrm_reward=genrm, rule_reward=rule, reward=reward)
        datasets.write_table(out, pa.Table.from_pylist(rows, schema=datasets.SCORED), datasets.SCORED)
        rewards = [r["reward"] for r in rows]
        rules = [r["rule_reward"] for r in rows if r["rule_reward"] is not None]
        return {
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "accuracy": sum(rules) / len(rules) if rules else None,
            "judge_agreement": agree / rule_known if rule_known else None,
            "unparsed_verdicts": unparsed, "seconds": time.perf_counter() - start,
        }

    def filter(self, scored: list[str], out: str, target_groups: int) -> dict:
        """DAPO dynamic sampling: keep prompt groups whose rewards differ, up to the target."""
        import pyarrow as pa

        from engines.algorithms import group_advantages
        from storage import datasets

        cfg = self.config
        groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
        for uri in scored:
            for r in datasets.read_table(uri, datasets.SCORED).to_pylist():
                groups[(r["wave"], r["prompt_id"])].append(r)
        kept, equal = [], 0
        for rows in groups.values():
            if cfg.sampling.filter_equal_rewards and len({r["reward"] for r in rows}) == 1:
                equal += 1
            else:
                kept.append(rows)
        surplus = max(len(kept) - target_groups, 0)
        kept = kept[:target_groups]
        flat = [r for rows in kept for r in rows]
        advantages = group_advantages([r["reward"] for r in flat], [hash((r["wave"], r["prompt_id"])) for r in flat], cfg.train.advantage_scale)
        for r, a in zip(flat, advantages):
            r["advantage"] = a
        datasets.write_table(out, pa.Table.from_pylist(flat, schema=datasets.EXPERIENCE), datasets.EXPERIENCE)
        enough = len(kept) >= target_groups
        reason = "target reached" if enough else f"{len(kept)}/{target_groups} groups kept, {equal} had equal rewards"
        return {"kept": len(kept), "dropped_equal": equal, "surplus": surplus, "enough": enough, "reason": reason}

    def train_step(self, experience: str) -> dict:
        """One GRPO/DAPO update; gradients are all-reduced across every DP group."""
        from engines.torch_engines import TrainBatch
        from storage import datasets

        cfg = self.config
        start = time.perf_counter()
        rows = datasets.read_table(experience, datasets.EXPERIENCE).to_pylist()
        batch = TrainBatch(
            [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
            [r["logprobs"] for r in rows], [r["advantage"] for r in rows],
        )
        t = cfg.train
        metrics = self.trainer.train_step(
            batch, minibatches=t.minibatches, aggregation=t.loss_aggregation,
            clip_low=t.clip_low, clip_high=t.clip_high, kl_coef=t.kl_coef,
        )
        seconds = time.perf_counter() - start
        metrics.update(seconds=seconds, sequences=len(rows), policy_version=self.trainer.version, params_sha=self.params_sha(),
                       engine_loads=self.engine_loads)
        metrics["tokens_per_s"] = metrics["tokens"] / seconds if seconds else 0.0
        return metrics

    def params_sha(self) -> str:
        """Fingerprint of the trainer's parameters: equal on every replica after a step."""
        h = hashlib.sha256()
        for _, p in self.trainer.export_weights():
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def sync_weights(self) -> dict:
        """Trainer → rollout engine, by Hugging Face parameter name."""
        start = time.perf_counter()
        count = self.policy.update_weights(self.trainer.export_weights())
        return {"tensors": count, "seconds": time.perf_counter() - start}

    def checkpoint(self, uri: str) -> dict:
        """Write this rank's share of a checkpoint; the controller commits the manifest.

        Layout: ``trainer-{backend}/`` (the train engine's own format: one file for torch,
        Megatron ``dist_checkpointing`` shards written by every rank), ``model/`` (the policy
        as a Hugging Face folder, rank 0) and ``rng-{rank}.pt``.
        """
        import torch

        from engines.torch_engines import to_bytes
        from storage import objectstore

        start = time.perf_counter()
        trainer_dir = f"trainer-{self.config.train.backend}"
        with tempfile.TemporaryDirectory() as tmp:
            files = [f"{trainer_dir}/{f}" for f in self.trainer.save_checkpoint(os.path.join(tmp, trainer_dir))]
            if self.rank == 0:
                self.trainer.save_hf(os.path.join(tmp, "model"))
                files += sorted(str(p.relative_to(tmp)) for p in Path(tmp, "model").rglob("*") if p.is_file())
            for name in files:
                objectstore.write_bytes(objectstore.join(uri, name), Path(tmp, name).read_bytes())
        if self.rank == 0:  # the prompt files this run's streams (and so the cursors) were read from
            objectstore.write_json(objectstore.join(uri, "prompts.json"), {"files": self.prompt_files})
            files.append("prompts.json")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        objectstore.write_bytes(objectstore.join(uri, f"rng-{self.rank}.pt"), to_bytes(rng))
        files.append(f"rng-{self.rank}.pt")
        return {"files": files, "seconds": time.perf_counter() - start}

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
        """Write the current policy as a Hugging Face folder (MANIFEST.json last)."""
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
        outs = self.policy.generate([r["prompt"] for r in rows], greedy=True, max_new_tokens=cfg.rollout.max_new_tokens)
        correct = sum(self.rule(rows[o.prompt_index]["prompt"], o.response, rows[o.prompt_index]["answer"]) for o in outs)
        return {"correct": int(correct), "total": len(rows)}

    def ping(self) -> dict:
        return {"pid": os.getpid(), "rank": self.rank}


def make_trainer(cfg, model_dir: str):
    """The train engine the config names, on the policy's Hugging Face folder."""
    t = cfg.train
    kwargs = dict(
        lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        temperature=cfg.rollout.temperature, reference=t.kl_coef > 0, dtype=cfg.model.dtype,
    )
    if t.backend == "megatron":
        from engines.megatron_engine import MegatronTrainer

        return MegatronTrainer(model_dir, tensor_parallel=t.tensor_parallel, distributed_optimizer=t.distributed_optimizer, **kwargs)
    from engines.torch_engines import TorchTrainer

    return TorchTrainer(model_dir, **kwargs)


def make_generator(backend: str, model_dir: str, cfg, threads: int):
    """A generation engine (policy rollout or GenRM judge) of the named backend."""
    if backend == "vllm":
        from engines.vllm_engine import VLLMGenerator

        # threads: in a DP host vLLM runs in its own process, which does not inherit torch's setting
        return VLLMGenerator(model_dir, dtype=cfg.model.dtype, seed=cfg.seed, threads=threads)
    from engines.torch_engines import TorchGenerator

    return TorchGenerator(model_dir, dtype=cfg.model.dtype)


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


def serve(rank: int, world: int, threads: int) -> None:
    """Listen on loopback, answer commands until ``shutdown``."""
    secret = bytes.fromhex(os.environ.pop("YATTFLOW_HOST_SECRET"))
    _exit_with_parent()
    host = EngineHost(rank, world, threads)
    capture = _Capture()
    capture.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("yattflow").addHandler(capture)
    logging.getLogger("yattflow").setLevel(logging.INFO)
    with Listener(("127.0.0.1", 0), authkey=secret) as listener:
        print(f"READY {listener.address[0]}:{listener.address[1]}", flush=True)
        # Nobody reads our stdout after READY: send whatever comes later (engine libraries and
        # the processes they spawn write there) to stderr, so a full pipe can never block us.
        os.dup2(2, 1)
        while True:
            conn = listener.accept()
            while True:
                try:
                    message = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    break
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
    args = parser.parse_args()
    serve(args.rank, args.world, args.threads)


if __name__ == "__main__":
    main()
