"""The command contract between controller and engine host (``engines/wire/commands.py``): each stage
named once, one handler per request type, engines behind explicit protocols, and requests that
travel as JSON to a real host process and come back as typed results or errors."""

from __future__ import annotations

import inspect
import json
import logging
import os

import pytest

from engines.wire.commands import REQUESTS, Ping, PingResult, Request, Shutdown, SyncWeights
from engines.backends.base import Generator, Trainer
from engines.host.worker import Worker
from tasks import stages


def handlers() -> dict:
    return {kind: fn for kind, fn in Worker.__dict__["handle"].dispatcher.registry.items() if kind is not object}


def test_every_stage_has_one_request_one_handler_and_one_task_of_its_name():
    # the engine host's stages (a node controller's own requests, flows/nodes.py, register here too once imported)
    host_requests = {stage: kind for stage, kind in REQUESTS.items() if kind.__module__ == "engines.wire.commands"}
    assert set(handlers()) == set(host_requests.values()) - {Shutdown}  # the channel answers Shutdown itself
    for stage, kind in host_requests.items():
        assert issubclass(kind, Request) and kind.stage == stage
        if kind is Shutdown:
            continue
        assert handlers()[kind].__name__ == stage, f"{kind.__name__} is handled by {handlers()[kind].__name__}"
        if kind is not Ping:
            assert inspect.iscoroutinefunction(getattr(stages, stage).fn), f"no Prefect task named {stage}"


def _members(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def _mismatches(method, protocol_method) -> list[str]:
    """What keeps ``method`` from standing in for ``protocol_method``: each parameter of the protocol
    must be one of the method's by name, and taken the same way (positionally, or by keyword only).
    ``**kwargs`` stands in for nothing: a method that passes its arguments on must still name them,
    or a caller's argument could go nowhere (a judge that dropped ``images``)."""
    params = inspect.signature(method).parameters
    wanted = inspect.signature(protocol_method).parameters
    problems = []
    for name, p in wanted.items():
        if name not in params:
            problems.append(f"no parameter '{name}'")
        elif (p.kind is p.KEYWORD_ONLY) != (params[name].kind is p.KEYWORD_ONLY):
            problems.append(f"'{name}' is {params[name].kind.description}, the protocol's is {p.kind.description}")
    positional = [n for n, p in wanted.items() if p.kind is not p.KEYWORD_ONLY]
    if [n for n in params if n in positional] != positional:
        problems.append(f"positional parameters not in the protocol's order {positional}")
    return problems


def _engine_classes():
    from engines.backends.build import JudgeProcess
    from engines.backends.stub.engines import TimingStubGenerator, TimingStubTrainer
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from engines.backends.vllm.generator import VLLMGenerator

    generators, trainers = [TorchGenerator, VLLMGenerator, TimingStubGenerator, JudgeProcess], [TorchTrainer, TimingStubTrainer]
    try:
        from engines.backends.megatron.trainer import MegatronTrainer
    except ImportError:  # megatron-core not installed (make install without make engines)
        pass
    else:
        trainers.append(MegatronTrainer)
    return [(Generator, c) for c in generators] + [(Trainer, c) for c in trainers]


@pytest.mark.parametrize("protocol, engine", _engine_classes(), ids=lambda x: x.__name__)
def test_engines_implement_their_protocol(protocol, engine):
    for name in _members(protocol):
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__} has no {protocol.__name__}.{name}"
        problems = _mismatches(method, getattr(protocol, name))
        assert not problems, f"{engine.__name__}.{name}{inspect.signature(method)}: {'; '.join(problems)}"


def test_the_protocol_check_fails_a_method_that_hides_a_parameter_in_kwargs():
    """The check above is not vacuous: a generator whose ``generate`` takes ``**kwargs`` but lacks
    ``images`` (and one that makes ``seed`` keyword-only) is refused, naming the parameter."""

    class Planted:
        def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, greedy=False, *, seed=0, **kwargs):
            return []

    assert _mismatches(Planted.generate, Generator.generate) == [
        "'seed' is keyword-only, the protocol's is positional or keyword", "no parameter 'images'",
        "positional parameters not in the protocol's order ['self', 'prompts', 'n', 'temperature', 'top_p', "
        "'max_new_tokens', 'seed', 'greedy', 'images']"]


@pytest.mark.integration
def test_requests_travel_as_json_to_a_real_host_and_errors_come_back_named():
    """A real host process: a typed result comes back; an unknown stage, a field of the wrong type
    and a stage that fails inside the host each come back as an error naming what was wrong, and
    the host still answers afterwards."""
    from engines.wire.channel import HostError, client
    from engines.wire.launch import LocalHosts

    with LocalHosts("commands-test", 1, 1, 120, fork=True):
        host = client("commands-test", 0)
        pong = host.call(Ping())[0]
        assert isinstance(pong, PingResult) and pong.pid != os.getpid() and pong.rank == 0 and pong.host_s >= 0

        def raw(message: dict) -> dict:
            host._conn.send_bytes(json.dumps(message).encode())
            return json.loads(host._conn.recv_bytes())

        assert "unknown stage 'score'" in raw({"stage": "score", "fields": {}})["error"]
        wrong = raw({"stage": "rollout", "fields": {"step": "three", "wave": 0, "cursor": 0, "count": 4, "out": "x"}})["error"]
        assert "ValidationError" in wrong and "step" in wrong
        with pytest.raises(HostError, match="'sync_weights' failed in the engine host") as failed:
            host.call(SyncWeights())  # no engines loaded: nothing was set up
        assert failed.value.remote[0] and "Traceback" in failed.value.traceback
        assert "Traceback" not in str(failed.value)  # one line: the host's traceback travels beside it
        assert host.call(Ping())[0].pid == pong.pid


@pytest.mark.parametrize("moving", [True, False])
def test_watchdog_lets_a_long_moving_command_finish_and_calls_a_still_one_hung(moving):
    """The channel's heartbeat (engines/wire/channel.py): a 4 s command that reports progress every
    0.3 s outlives ``stage_s=1.5``; the same command with no progress is hung after ~1.5 s."""
    import threading
    import time
    from multiprocessing.connection import Listener

    from engines.wire import channel

    def handle(request):
        for _ in range(13):
            time.sleep(0.3)
            if moving:
                channel.progress()
        return PingResult(pid=os.getpid(), rank=0)

    secret = b"s" * 32
    with Listener(("127.0.0.1", 0), authkey=secret) as listener:
        def serve():
            try:
                channel.answer(listener.accept(), handle, 0)
            except SystemExit:  # the client went away without 'shutdown' (the hung case)
                pass

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        client = channel.HostClient(listener.address, secret, 0, timeout_s=60, stage_s=1.5)
        started = time.monotonic()
        if moving:
            result, _ = client.call(Ping())
            assert result.rank == 0 and time.monotonic() - started >= 3.9
            client.call(Shutdown())
        else:
            with pytest.raises(channel.HostLost, match=r"'ping' hung: no progress for \d+s \(timeouts.stage_s=1.5\)"):
                client.call(Ping())
            assert time.monotonic() - started < 3.5
            # the abandoned command's answer still arrives; no later command may take it for its own
            time.sleep(3.0)
            with pytest.raises(channel.HostLost, match="channel unusable for 'shutdown': 'ping' hung"):
                client.call(Shutdown())
            client.end()  # cuts the channel instead of asking
            return
        client.close()
        server.join(10)


def test_a_controller_gone_while_its_command_runs_ends_the_host_as_a_dropped_connection():
    """A run cancelled while its host works closes the connection before the answer; writing the
    answer then breaks the pipe. That is the run's connection dropping (exit 3: the host ends as its
    run did), not a crash of the host (exit 1: seen in CI when a deployed run was cancelled)."""
    import json
    import threading
    import time
    from multiprocessing.connection import Client, Listener

    from engines.wire import channel

    def handle(request):
        time.sleep(0.5)
        for _ in range(2000):  # an answer larger than the socket's buffers: its write meets the closed peer
            logging.getLogger("yattflow").info("a line of the command's log " * 40)
        return PingResult(pid=os.getpid(), rank=0)

    secret = b"s" * 32
    ended = []
    with Listener(("127.0.0.1", 0), authkey=secret) as listener:
        def serve():
            try:
                channel.answer(listener.accept(), handle, 0)
            except SystemExit as e:
                ended.append(e.code)
            except BaseException as e:  # noqa: BLE001 - what the host process would die of
                ended.append(type(e).__name__)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        conn = Client(listener.address, authkey=secret)
        conn.send_bytes(json.dumps({"stage": "ping", "fields": {}}).encode())
        conn.close()  # the run is gone before the answer
        server.join(30)
    assert ended == [3]


def test_the_host_door_survives_garbage_half_and_silent_connections(monkeypatch, caplog):
    """One bad connection must not jam an engine host (``engines.wire.channel.Door``): garbage instead of
    the handshake, a wrong secret, half a handshake and a connection that says nothing are each refused
    on their own (the silent one after ``HANDSHAKE_S``), while a real controller connects meanwhile, and
    another after them."""
    import socket
    import threading
    import time
    from multiprocessing.connection import Client

    from engines.wire import channel

    monkeypatch.setattr(channel, "HANDSHAKE_S", 1.0)
    secret = b"s" * 32
    door = channel.Door("127.0.0.1", secret)
    address = ("127.0.0.1", door.port)
    silent = socket.create_connection(address)  # holds its handshake open
    garbage = socket.create_connection(address)
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 8)
    half = socket.create_connection(address)
    half.recv(64)  # the host's challenge, never answered
    with pytest.raises(Exception):
        Client(address, authkey=b"w" * 32)
    served = []

    def serve():
        while True:
            conn = door.next()
            threading.Thread(target=lambda c=conn: served.append(channel.answer(c, lambda r: PingResult(pid=os.getpid(), rank=0), 0)),
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    started = time.monotonic()
    first = channel.HostClient(address, secret, 0, timeout_s=10, stage_s=10)
    assert first.call(Ping())[0].rank == 0 and time.monotonic() - started < 0.9  # not queued behind the silent one
    time.sleep(1.5)  # past HANDSHAKE_S: the silent and the half connections are cut
    for sock in (silent, half):  # the host's challenge, then the end of the connection
        sock.settimeout(5)
        while sock.recv(4096):
            pass
    second = channel.HostClient(address, secret, 0, timeout_s=10, stage_s=10)
    assert second.call(Ping())[0].rank == 0
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 4, refused  # garbage, the wrong secret, half, silent
    for c in (first, second):
        c.end()
    door.close()
    for s in (silent, garbage, half):
        s.close()
