"""Agentic RL (engines/agents): episodes are token-in/token-out with a loss mask; observation
tokens get no gradient and a one-turn episode trains as today's single-turn sample; bad calls are
observations; the sandbox contains escape attempts; bad environments and tools fail before any
engine loads, naming what is wrong."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tests.helpers import final_parameters, no_engine_hosts_left, random_batch, save_tiny_model, trained  # (puts the checkout on sys.path)

from engines.agents import environment, sandbox, tools
from engines.agents.episodes import Episodes
from engines.backends import chat
from engines.backends.base import TrainBatch
from engines.backends.batching import pad_batch
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.trainer import TorchTrainer
from engines.config import load_config
from engines.config.sections import RolloutConfig
from engines.host import validation
from engines.rl.loss_step import LossStep
from engines.rl.grpo import GRPOConfig
from engines.rl.off_policy import correction_weights
from storage import datasets

AUTO = chat.PromptFormat("auto")
CALCULATOR = "engines.agents.tools:calculator"
RETRY_ENV = '''
from engines.agents.environment import Step

class Retry:
    """Feedback after a wrong answer, then a retry: truly multi-turn, no tools."""
    def reset(self, row):
        self.answer, self.tries = row["answer"], 0
        return row["prompt"]
    def step(self, text):
        self.tries += 1
        if text.strip().startswith(self.answer) or self.tries == 2:
            return Step(None, reward=float(text.strip().startswith(self.answer)), done=True)
        return Step("Wrong, try again.", reward=0.0)
'''


@pytest.fixture(scope="module")
def agent(tool_agent) -> str:
    return tool_agent


def _play(model: str, rows, n=2, **rollout):
    generator = TorchGenerator(model, prompt_format=AUTO)
    episodes = Episodes(RolloutConfig(**({"max_new_tokens": 80, "temperature": 0.3} | rollout)), generator.renderer)
    played = episodes.run(generator, rows, n, 3)
    return generator, episodes, played


def test_episodes_are_token_in_token_out_and_the_trainer_agrees(agent):
    rows = [{"prompt_id": 7, "prompt": "What is 2+3?", "answer": "5"}]
    generator, episodes, played = _play(agent, rows, tools=[CALCULATOR], max_turns=3)
    assert all(e.tool_calls == 1 and e.turns == 2 and not e.truncated for e in played)
    for e in played:
        # prompt, the sampled call (mask 1), the tool's turn as the template renders it after an assistant turn (mask 0), the answer
        first = e.loss_mask.index(0)
        result = tools.call(episodes.tools, tools.parse(generator.tokenizer.decode(e.response_ids[:first]))[0], 10)
        observation = episodes.renderer.observation_ids([{"role": "tool", "content": result.content}], True, episodes.schemas)
        assert e.response_ids[first:first + len(observation)] == observation and e.tool_errors == result.error
        assert e.loss_mask == [1] * first + [0] * len(observation) + [1] * (len(e.loss_mask) - first - len(observation))
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if not m)
    print([generator.tokenizer.decode(e.response_ids) for e in played])
    assert generator.tokenizer.decode(played[0].response_ids).endswith(
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
    # (a broken call's observation is its error, as any result's content: the tool errors are below,
    # test_tools_answer_bad_calls_as_observations; which sample, if any, breaks its call is the CPU's rounding)
    # the trainer scores the very tokens the engine sampled: its log-probs of them are the rollout's
    trainer = TorchTrainer(agent, temperature=0.3)
    batch = TrainBatch([e.prompt_ids for e in played], [e.response_ids for e in played], [e.logprobs for e in played],
                       [1.0, -1.0], loss_mask=[e.loss_mask for e in played])
    recomputed = trainer.logprobs(batch)
    gap = max(abs(a - b) for e, lps in zip(played, recomputed) for a, b, m in zip(lps, e.logprobs, e.loss_mask) if m)
    print(f"train-vs-rollout log-prob gap over {sum(map(sum, batch.loss_mask))} sampled tokens of 2 episodes: {gap:.1e}")
    assert gap < 1e-4
    assert batch.trained_tokens() == [sum(m) for m in batch.loss_mask]

    # two lanes (rollout.overlap_tools): one half's tools run while the other half generates; the same record
    _, _, lanes = _play(agent, rows * 2, tools=[CALCULATOR], max_turns=3, overlap_tools=True)
    assert all(e.turns == 2 and e.tool_calls == 1 for e in lanes)
    batch = TrainBatch([e.prompt_ids for e in lanes], [e.response_ids for e in lanes], [e.logprobs for e in lanes],
                       [0.0] * 4, loss_mask=[e.loss_mask for e in lanes])
    assert max(abs(a - b) for e, lps in zip(lanes, trainer.logprobs(batch))
               for a, b, m in zip(lps, e.logprobs, e.loss_mask) if m) < 1e-4


def test_an_environment_gives_feedback_and_a_retry(agent, tmp_path):
    (tmp_path / "retry_env.py").write_text(RETRY_ENV)
    rows = [{"prompt_id": 1, "prompt": "What is 2+3?", "answer": "9"}]  # the model answers with a call: wrong, twice
    _, _, played = _play(agent, rows, env=f"{tmp_path}/retry_env.py:Retry", max_turns=4)
    for e in played:
        assert e.turns == 2 and e.env_reward == 0.0 and not e.truncated and e.tool_calls == 0
        assert "Wrong, try again." in generator_text(agent, e.response_ids)
    _, _, cut = _play(agent, rows, env=f"{tmp_path}/retry_env.py:Retry", max_turns=1)
    assert all(e.turns == 1 and e.truncated for e in cut)  # more turns wanted than allowed: cut and marked


def generator_text(model: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(ids)


def test_observation_tokens_get_no_gradient_and_one_turn_is_todays_sample(tmp_path):
    model = save_tiny_model(tmp_path / "m")
    batch = random_batch(4, seed=1)
    observation = [5, 6, 7]
    # the same samples with an observation after each response, masked out: the same update and statistics
    masked = TrainBatch(batch.prompt_ids, [r + observation for r in batch.response_ids],
                        [o + [0.0] * len(observation) for o in batch.old_logprobs], batch.advantages,
                        loss_mask=[[1] * len(r) + [0] * len(observation) for r in batch.response_ids])
    one_turn = TrainBatch(batch.prompt_ids, batch.response_ids, batch.old_logprobs, batch.advantages,
                          loss_mask=[[1] * len(r) for r in batch.response_ids])
    results = {}
    for name, b in (("today", batch), ("one turn", one_turn), ("observations", masked)):
        trainer = TorchTrainer(model, lr=1e-2)
        stats = trainer.train_step(b, GRPOConfig())
        results[name] = (stats, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    today, (one_stats, one_params), (obs_stats, obs_params) = results["today"], results["one turn"], results["observations"]
    assert one_stats == today[0] and all(torch.equal(one_params[n], p) for n, p in today[1].items())
    assert obs_stats["tokens"] == today[0]["tokens"]
    for name in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert obs_stats[name] == pytest.approx(today[0][name], rel=1e-5, abs=1e-9), name
    # an Adam step of 1e-2 per parameter; a wider padded batch sums in another order
    assert max((obs_params[n] - p).abs().max().item() for n, p in today[1].items()) < 1e-5
    # and directly: the loss's gradient at every observation position is exactly zero
    ids, _, resp, old = pad_batch(masked, 0)
    logprobs = (old + 0.01 * torch.randn(resp.shape)).requires_grad_()  # ratios near 1: no sampled token clipped
    step = LossStep(GRPOConfig(), masked.advantages, lambda v: v)
    step(logprobs, old, masked.advantages, resp, step.count(masked)).backward()
    positions = torch.zeros_like(resp, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(masked.prompt_ids, masked.response_ids)):
        positions[i, len(p) - 1 + len(r) - len(observation): len(p) - 1 + len(r)] = True
    assert torch.all(logprobs.grad[positions] == 0) and torch.all(logprobs.grad[resp.bool()] != 0)


def test_ppo_values_advantages_and_returns_are_on_sampled_tokens_only(agent):
    """PPO on episodes: the critic values the tokens the policy sampled, GAE runs over them as one
    chain (an observation is a step of the environment, never valued or trained), and the critic's
    and the policy's steps read those tokens only: the critic's first loss is half the mean squared
    advantage over them (its values are still the old ones, so R - V = A)."""
    from engines.backends.torch.critic import TorchCritic
    from engines.host.critic import with_token_advantages
    from engines.rl.ppo import PPOConfig

    _, _, played = _play(agent, [{"prompt_id": 7, "prompt": "What is 2+3?", "answer": "5"}], tools=[CALCULATOR], max_turns=3)
    rows = [{"prompt_ids": e.prompt_ids, "response_ids": e.response_ids, "logprobs": e.logprobs, "loss_mask": e.loss_mask,
             "reward": reward} for e, reward in zip(played, (1.0, 0.0))]
    ppo = PPOConfig(lam=0.9)
    critic = TorchCritic(agent, lr=1e-3)
    rows = with_token_advantages(ppo, critic, rows, None)
    for r in rows:
        assert len(r["values"]) == len(r["token_advantages"]) == len(r["returns"]) == sum(r["loss_mask"]) < len(r["response_ids"])
    batch = TrainBatch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], [r["logprobs"] for r in rows],
                       [r["token_advantages"] for r in rows], returns=[r["returns"] for r in rows],
                       values=[r["values"] for r in rows], loss_mask=[r["loss_mask"] for r in rows])
    squares = [a * a for r in rows for a in r["token_advantages"]]
    stats = critic.train_step(batch, ppo)
    assert stats["value_loss"] == pytest.approx(0.5 * sum(squares) / len(squares), rel=1e-4)
    assert TorchTrainer(agent, temperature=0.3).train_step(batch, ppo)["tokens"] == len(squares)


def test_off_policy_weights_skip_observations():
    proximal, behaviour = [[-1.0, -2.0, -0.5]], [[-1.5, -9.0, -0.5]]
    weights, stats = correction_weights(proximal, behaviour, "mis", masks=[[1, 0, 1]])
    plain, _ = correction_weights([[-1.0, -0.5]], [[-1.5, -0.5]], "mis")
    assert [weights[0][0], weights[0][2]] == plain[0] and weights[0][1] == 1.0
    assert stats["is_ratio_max"] == pytest.approx(max(plain[0]))


def test_tools_answer_bad_calls_as_observations():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "slept"

    def broken(x: int) -> str:
        """Raise.

        Args:
            x: Anything.
        """
        raise RuntimeError("out of order")

    box = {"calculator": tools.calculator, "slow": slow, "broken": broken}
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "calculator", "arguments": </tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>')
    results = [tools.call(box, c, timeout_s=0.5) for c in tools.parse(text)]
    assert results[0].content == "5535" and not results[0].error
    expected = ["no tool named 'nope'", "the call is not JSON", "broken raised RuntimeError: out of order", "slow ran past 0.5 s",
                "calculator raised ValueError: not arithmetic", "bad arguments for calculator"]
    for r, why in zip(results[1:], expected):
        assert r.error and r.content.startswith("error: ") and why in r.content, r.content
    assert tools.schema(tools.calculator)["function"]["parameters"]["required"] == ["expression"]
    # the plain format of a model without a chat template: name(its one argument, as written)
    plain = tools.parse("<tool_call>calculator(123*45)</tool_call><tool_call>nope(1)</tool_call><tool_call>calculator(1+)</tool_call>")
    assert [tools.call(box, c, timeout_s=0.5).content for c in plain] == [
        "5535", "error: no tool named 'nope' (tools: calculator, slow, broken)",
        "error: calculator raised SyntaxError: invalid syntax (<unknown>, line 1)"]
    from engines.demo.tiny import build_char_tokenizer

    renderer = chat.Renderer(build_char_tokenizer(words=tools.MARKERS))  # no chat template: the observation as text
    ids = renderer.observation_ids([{"role": "tool", "content": "5535"}], after_eos=True)
    assert renderer.tokenizer.convert_ids_to_tokens(ids) == ["<tool_response>", *"5535", "</tool_response>"]


NO_SANDBOX = pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")
CGROUPS = pytest.mark.skipif(os.geteuid() != 0 or not os.access("/sys/fs/cgroup/memory/cgroup.procs", os.W_OK),
                             reason="a cgroup per call needs root and a writable cgroup v1")


def _sandbox_processes(*hosts: int) -> list[str]:
    """Processes still running under the sandbox user ids of these host processes (zombies aside)."""
    ids = {uid for host in hosts for uid in range(sandbox.UID_BASE + host * sandbox.UIDS_PER_HOST,
                                                  sandbox.UID_BASE + (host + 1) * sandbox.UIDS_PER_HOST)}
    running = subprocess.run(["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True).stdout.splitlines()
    return [line for line in running if line.split() and int(line.split()[0]) in ids and not line.split()[1].startswith("Z")]


@NO_SANDBOX
def test_the_sandbox_contains_escape_attempts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text('{"step": 3}')
    os.environ["YATTFLOW_TEST_SECRET"] = "hunter2"  # a host's secret, in its environment
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # an engine host's port
    port = listener.getsockname()[1]
    # the endless loop ends at its CPU limit; no probe here is about the wall clock (test_a_wedged_sandbox_... is),
    # and on a loaded machine a process's first call alone took more than 3 s (the fresh-clone run beside two CPU hogs)
    limits = sandbox.Limits(wall_s=60, cpu_s=2)
    libc = "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
    probes = {  # what it tries: (its program, what its output must show: each of these)
        "read the run's state.json": (f"print(open({str(run_dir / 'state.json')!r}).read())", "FileNotFoundError"),
        "read a host's secret": ("import os; print(os.environ.get('YATTFLOW_TEST_SECRET'), open('/proc/1/environ').read())",
                                 "None"),
        "write outside its directory": ("open('/usr/escaped', 'w').write('x')", "Read-only file system"),
        "connect to an engine host's port": (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                                             "ConnectionRefusedError"),
        "a fork bomb": ("import os\nwhile True:\n    os.fork()", "BlockingIOError"),
        "allocate 8 GB": ("x = bytearray(8 << 30)", "MemoryError"),
        "an endless loop": ("while True: pass", None),
        "kill its parent": ("import os, signal; os.kill(os.getppid(), signal.SIGKILL); print('still here')", "still here"),
        "leave a process behind": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('left')", "left"),
        # the hostile tester's (each got through the sandbox before seccomp, cgroups and the sized noexec disk)
        "fill /dev/shm past its disk": ("for i in range(4):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (8 << 20))",
                                        "No space left on device"),
        "write to / or /dev": ("for path in ('/x', '/dev/x'):\n    try: open(path, 'w')\n    except OSError as e: print(e)",
                               ("Read-only file system: '/x'", "Read-only file system: '/dev/x'")),
        "a nested user namespace, then mount": (libc + "print('unshare', libc.unshare(0x10000000 | 0x20000), ctypes.get_errno())\n"
                                                "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())",
                                                ("unshare -1 1", "mount -1 1")),  # EPERM
        "clone into a new user namespace": (libc + "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\nif pid == 0: libc._exit(0)\n"
                                            "print('clone', pid, ctypes.get_errno())", "clone -1 1"),
        "ptrace its child and PID 1": (libc + "import os, time\nchild = os.fork()\nif child == 0: time.sleep(30)\n"
                                       "print('ptrace', libc.ptrace(16, child, 0, 0), ctypes.get_errno(), libc.ptrace(16, 1, 0, 0))",
                                       "ptrace -1 1 -1"),
        "find a compiler, a shell, /usr/local": ("import os; print([p for p in ('/usr/bin/gcc', '/bin/sh', '/usr/local') if os.path.exists(p)])",
                                                 "[]"),
        "run a file it wrote": ("import os, subprocess\nfor d in ('/work', '/tmp', '/dev/shm'):\n"
                                "    open(f'{d}/run', 'w').write('#!/usr/bin/python3\\nprint(1)'); os.chmod(f'{d}/run', 0o755)\n"
                                "    try: subprocess.run([f'{d}/run'])\n    except OSError as e: print(e)",
                                tuple(f"Permission denied: '{d}/run'" for d in ("/work", "/tmp", "/dev/shm"))),
        "a socket to the VM's host (AF_VSOCK)": ("import socket; socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)",
                                                 "PermissionError"),
    }
    for name, (code, shows) in probes.items():
        run = sandbox.run_python(code, limits)
        print(f"{name}: exit {run.exit_code}, timed out {run.timed_out}: {run.output.strip().splitlines()[-1:]}")
        if shows is None:
            assert run.timed_out or run.exit_code != 0, name
        for text in [shows] if isinstance(shows, str) else shows or ():
            assert text in run.output, (name, text, run.output)
        assert "hunter2" not in run.output and '"step": 3' not in run.output
        assert not _sandbox_processes(os.getpid()), name
    assert (run_dir / "state.json").read_text() == '{"step": 3}' and not os.path.exists("/usr/escaped")
    listener.settimeout(0.1)
    with pytest.raises(socket.timeout):
        listener.accept()  # nobody got through
    assert "45" in tools.python("print(sum(range(10)))")
    assert tools.python("raise SystemExit(3)").startswith("error: exit code 3")


@NO_SANDBOX
@CGROUPS
def test_a_sandbox_call_has_one_memory_budget_across_its_processes():
    """4 processes holding 48 MB each in a call of 128 MB: the kernel kills some (each alone is far
    below its address-space limit); 4 x 16 MB fit."""
    hold = ("import os, time\nkids = []\nfor _ in range(4):\n    kids.append(os.fork())\n"
            "    if kids[-1] == 0:\n        x = b'x' * ({mb} << 20); time.sleep(0.5); os._exit(0)\n"
            "print('held by all' if not any(os.waitpid(kid, 0)[1] for kid in kids) else 'killed')")
    limits = sandbox.Limits(wall_s=10, memory_mb=128)
    assert "held by all" in sandbox.run_python(hold.format(mb=16), limits).output
    run = sandbox.run_python(hold.format(mb=48), limits)
    assert "held by all" not in run.output and ("killed" in run.output or run.exit_code == 128 + 9), run


@NO_SANDBOX
def test_sandbox_calls_of_two_hosts_do_not_kill_each_other(tmp_path):
    """Two engine hosts (processes) run calls at once: the second's calls end, and with them their
    clean-up, while the first's program runs on (they once shared user ids, and the second's
    clean-up killed it)."""
    host = ("import sys, time; sys.path.insert(0, {folder!r}); import sandbox\n"
            "time.sleep({wait})\n"
            "for _ in range({calls}):\n"
            "    run = sandbox.run_python({code!r}, sandbox.Limits(wall_s=10))\n"
            "    print(run.exit_code, run.output.strip(), flush=True)")
    folder = os.path.dirname(sandbox.__file__)
    first = subprocess.Popen([sys.executable, "-I", "-S", "-c", host.format(folder=folder, wait=0, calls=1,
                                                                code="import time; time.sleep(3); print('done')")],
                             stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen([sys.executable, "-I", "-S", "-c", host.format(folder=folder, wait=1, calls=3, code="print(1)")],
                              stdout=subprocess.PIPE, text=True)
    assert second.communicate(timeout=60)[0].split("\n")[:3] == ["0 1"] * 3
    assert first.communicate(timeout=60)[0].strip() == "0 done"  # it was -9 at about 1 s
    assert not _sandbox_processes(first.pid, second.pid)


@NO_SANDBOX
def test_a_wedged_sandbox_cannot_hold_a_call_past_its_wall_clock():
    """A program that ptrace-stopped the namespace's PID 1 (bwrap's) used to wedge every call until
    its wall clock: ptrace is refused now, so the call ends when the program does. One that cannot
    end (a stopped child, a parent that ignores SIGTERM) is killed at the wall clock: the call
    returns within a second of it, checked with 2 s more for a loaded 2-core machine."""
    wedge = ("import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\nchild = os.fork()\n"
             "if child == 0: time.sleep(30)\n"
             "print('ptrace', libc.ptrace(16, 1, 0, 0), libc.ptrace(16, child, 0, 0), ctypes.get_errno())")
    sandbox.run_python("pass")  # (a process's first call also lists the interpreter's libraries: not timed here)
    started = time.monotonic()
    run = sandbox.run_python(wedge, sandbox.Limits(wall_s=4))
    assert not run.timed_out and "ptrace -1 -1 1" in run.output and time.monotonic() - started < 3, run
    stuck = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "if os.fork() == 0: os.kill(os.getpid(), signal.SIGSTOP)\nprint('stuck', flush=True)\ntime.sleep(60)")
    started = time.monotonic()
    run = sandbox.run_python(stuck, sandbox.Limits(wall_s=2))
    took = time.monotonic() - started
    print(f"killed at the wall clock: returned after {took:.2f} s of 2")
    assert run.timed_out and "stuck" in run.output and 2 <= took < 2 + 1 + 2, (took, run)
    assert not _sandbox_processes(os.getpid())


@NO_SANDBOX
@CGROUPS
def test_sandbox_cgroups_are_removed_and_a_dead_hosts_are_cleaned():
    """Each call's cgroup is gone when it returns; one left by a host killed mid-call (its pid gone)
    is killed and removed by the next call."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no host has now
    stale = [Path(f"/sys/fs/cgroup/{c}/yattflow-sandbox-{sandbox.UID_BASE + gone.pid * sandbox.UIDS_PER_HOST}")
             for c in ("memory", "pids")]
    for path in stale:
        path.mkdir()
    left = subprocess.Popen(["sleep", "60"])  # a process the dead host's call left behind
    for path in stale:
        (path / "cgroup.procs").write_text(str(left.pid))
    assert sandbox.run_python("print(1)").output == "1\n"
    assert left.wait(timeout=5) == -9 and not any(path.exists() for path in stale)
    mine = range(sandbox.UID_BASE + os.getpid() * sandbox.UIDS_PER_HOST, sandbox.UID_BASE + (os.getpid() + 1) * sandbox.UIDS_PER_HOST)
    assert not [p for c in ("memory", "pids") for p in Path(f"/sys/fs/cgroup/{c}").glob("yattflow-sandbox-*")
                if int(p.name.rsplit("-", 1)[1]) in mine]


def _write_prompts(path, rows) -> str:
    datasets.write_table(str(path), pa.Table.from_pylist(rows), datasets.PROMPTS)
    return str(path)


def test_bad_environments_and_tools_fail_before_engines_load(agent, tmp_path):
    prompts = _write_prompts(tmp_path / "p.parquet", [{"prompt_id": 4, "prompt": "What is 2+3?", "answer": "5"}])
    (tmp_path / "envs.py").write_text(textwrap.dedent('''
        class Fine:
            def reset(self, row): return row["prompt"]
            def step(self, text): return (None, 1.0, True)
        class Raises:
            def reset(self, row): raise KeyError("tests")
            def step(self, text): return (None, 1.0, True)
        class Number:
            def reset(self, row): return 42
            def step(self, text): return (None, 1.0, True)
        class NoStep:
            def reset(self, row): return row["prompt"]
        def undocumented(x): return x
    '''))

    def config(*overrides):
        return load_config(None, [f"storage.root={tmp_path}", f"model.policy={agent}", f"data.prompts={prompts}",
                                  "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1",
                                  "data.chat_template=auto", *overrides])

    assert validation.validate_inputs(config(f"rollout.env={tmp_path}/envs.py:Fine", f"rollout.tools=[{CALCULATOR}]")) \
        == {"data.prompts": 1}
    cases = [
        (["rollout.env=no_such_module:Env"], r"rollout.env: cannot import module 'no_such_module'"),
        ([f"rollout.env={tmp_path}/envs.py:NoStep"], r"envs.py:NoStep has no method step\(text\)"),
        ([f"rollout.env={tmp_path}/envs.py:Raises"], r"p.parquet: rollout.env .*Raises: prompt_id 4, turn 0: reset\(\) raised KeyError"),
        ([f"rollout.env={tmp_path}/envs.py:Number"], r"prompt_id 4, turn 0: an observation is text or .* not int 42"),
        ([f"rollout.tools=[{tmp_path}/envs.py:undocumented]"], r"rollout.tools: .*undocumented: no JSON schema"),
    ]
    for overrides, pattern in cases:
        with pytest.raises(validation.InputError, match=pattern):
            validation.validate_inputs(config(*overrides))
    bare = save_tiny_model(tmp_path / "bare")  # a tokenizer without a chat template
    (tmp_path / "bare" / "tokenizer_config.json").write_text((tmp_path / "bare" / "tokenizer_config.json").read_text()
                                                            .replace('"model_max_length"', '"chat_template": "{{ messages }}", "model_max_length"'))
    with pytest.raises(validation.InputError, match=r"does not render tools"):
        validation.validate_inputs(config(f"model.policy={bare}", f"rollout.tools=[{CALCULATOR}]"))
    config("data.chat_template=none", f"rollout.tools=[{CALCULATOR}]")  # no template: the plain call format
    with pytest.raises(Exception, match=r"train.algorithm.name=dpo trains on a preference dataset, not on episodes"):
        config(f"rollout.tools=[{CALCULATOR}]", "train.algorithm.name=dpo", "data.preferences=p.parquet")


def test_an_environment_that_raises_mid_episode_is_named(agent, tmp_path):
    (tmp_path / "bad_env.py").write_text(textwrap.dedent('''
        class Bad:
            def reset(self, row): return row["prompt"]
            def step(self, text): return {"observation": "not a Step"}
    '''))
    with pytest.raises(environment.EnvError, match=r"bad_env.py:Bad: prompt_id 9, turn 1: step\(\) answers a Step or "
                                                   r"\(observation, reward, done\), not dict"):
        _play(agent, [{"prompt_id": 9, "prompt": "What is 2+3?", "answer": "5"}], env=f"{tmp_path}/bad_env.py:Bad")



CHECKED_ENV = '''
from engines.agents.environment import Step

class Checked:
    """One answer, checked: reward 1 when it is the row's answer (the tools' turns come before it)."""
    def reset(self, row):
        self.answer = row["answer"]
        return row["prompt"]
    def step(self, text):
        return Step(None, reward=float(text.strip() == self.answer), done=True)
'''
KILLING_CALCULATOR = '''
import os, signal
from engines.agents import tools

def calculator(expression: str) -> str:
    """yattflow's calculator, but the call numbered KILL_AT_CALL ("folder:n") SIGKILLs its engine host, once."""
    if plan := os.environ.get("KILL_AT_CALL"):
        folder, n = plan.rsplit(":", 1)
        with open(os.path.join(folder, "calls"), "a") as f:
            f.write("x")
        if os.path.getsize(os.path.join(folder, "calls")) >= int(n):
            try:
                os.close(os.open(os.path.join(folder, "fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.killpg(0, signal.SIGKILL)  # the host and its engines, in the middle of its episodes
    return tools.calculator(expression)

calculator.__doc__ = tools.calculator.__doc__  # the same schema: the prompts are the built-in calculator's
'''


def test_a_run_trains_on_episodes_and_heals_from_a_host_killed_mid_episode(agent, prefect_server, tmp_path, monkeypatch):
    """Two RL steps over two DP groups on the real flow, the episodes streamed (rollout.mode=stream:
    the lane plays them a turn at a time beside the steps, decoupled correction): episodes with the
    calculator and an environment's reward; the experience holds each episode's loss mask and the trainer counts
    only the tokens the policy sampled; the step's figures show turns and tool calls. Then, without
    the stream (whose resume is exactly-once, not bit-identical: docs/off-policy.md), a run and the
    same run with an engine host SIGKILLed by a tool call of its last step, in the middle of its
    episodes: the second heals from its last committed checkpoint, regenerates the cut episodes from
    the same seeds and trains exactly what the uninterrupted run trained, to the same final weights."""
    from flows.console import step_figures
    from flows.training import train
    from flows.metrics import StepMetrics

    (tmp_path / "checked_env.py").write_text(CHECKED_ENV)
    (tmp_path / "killing_calculator.py").write_text(KILLING_CALCULATOR)
    prompts = _write_prompts(tmp_path / "prompts.parquet",
                             [{"prompt_id": i, "prompt": "What is 2+3?", "answer": "5"} for i in range(8)])
    overrides = [
        f"storage.root={tmp_path}", f"model.policy={agent}", f"data.prompts={prompts}", "data.heldout=null",
        "data.chat_template=auto", "data.max_prompt_tokens=600", "reward.genrm_weight=0", "reward.rule=null",
        "reward.env_weight=1", f"rollout.env={tmp_path}/checked_env.py:Checked",
        f"rollout.tools=[{tmp_path}/killing_calculator.py:calculator]", "rollout.max_new_tokens=80", "rollout.temperature=0.3",
        "rollout.samples_per_prompt=4", "sampling.prompts_per_wave=2", "sampling.target_groups=1",
        "sampling.filter_equal_rewards=false", "dp=2", "checkpoint.every=1"]
    streamed = ["name=agents", "steps=2", "rollout.mode=stream", "rollout.max_staleness=2", "train.old_policy=decoupled",
                "train.off_policy_correction=tis"]
    summary = asyncio.run(train(overrides=overrides + streamed))
    history = [StepMetrics(**m) for m in summary["history"]]
    for m in history:
        print(step_figures(m))
        assert m.episodes["turns"] >= 1 and m.episodes["tool_calls"] > 0 and 0 <= m.episodes["truncated"] <= 1
        assert " turns, " in step_figures(m) and " calls (" in step_figures(m)
    rows = pq.read_table(tmp_path / "runs" / "agents" / "steps" / "000001" / "experience").to_pylist()
    assert rows and all(len(r["loss_mask"]) == len(r["response_ids"]) == len(r["logprobs"]) for r in rows)
    assert any(0 in r["loss_mask"] for r in rows)  # tool turns between the sampled ones
    assert history[1].train_tokens == sum(sum(r["loss_mask"]) for r in rows)  # the trainers counted sampled tokens only
    assert 0 < history[1].train["is_ratio_mean"] < 2  # the correction's statistics, over sampled tokens
    rolled = pq.read_table(tmp_path / "runs" / "agents" / "steps" / "000001" / "rollouts").to_pylist()
    assert all(len(r["token_versions"]) == len(r["response_ids"]) for r in rolled)  # streamed: a version per token
    assert "token_staleness_mean" in history[1].train

    (tmp_path / "kill").mkdir()
    monkeypatch.setenv("KILL_AT_CALL", f"{tmp_path / 'kill'}:1000000")  # counts the calls, kills none
    asyncio.run(train(overrides=overrides + ["name=agents-reference", "steps=3"]))
    calls = (tmp_path / "kill" / "calls").stat().st_size
    (tmp_path / "kill" / "calls").unlink()
    monkeypatch.setenv("KILL_AT_CALL", f"{tmp_path / 'kill'}:{calls - 2}")  # the run's third last call: its last step
    healed = asyncio.run(train(overrides=overrides + ["name=agents-healed", "steps=3"]))["history"]
    assert (tmp_path / "kill" / "fired").exists() and [m["step"] for m in healed] == [0, 1, 2]
    reference, again = tmp_path / "runs" / "agents-reference", tmp_path / "runs" / "agents-healed"
    assert trained(again) == trained(reference)
    a, b = final_parameters(again), final_parameters(reference)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "final weights differ"
    no_engine_hosts_left()
