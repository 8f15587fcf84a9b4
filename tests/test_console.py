"""What a person sees of ``yattflow train`` (issue 33): in a real terminal (a pty) a live progress
display that advances step by step, no Prefect log firehose, and a link to the run's page; after
the command has ended, that link opened in headless Chromium on ``yattflow server`` serving the
same local database shows the run's per-step task states. Without a server, ``yattflow status``
says where the run stands from storage.

The run uses the embedded default (no PREFECT_API_URL: a temporary server on SQLite in a
PREFECT_HOME of its own), as ``make demo`` does.
"""

from __future__ import annotations

import codecs
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import TINY, free_port
from tests.browser import Browser, needs_browser

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
LINK = re.compile(r"train-console in the Prefect UI: (http://127\.0\.0\.1:4200/runs/flow-run/([0-9a-f-]{36})) "
                  r"\(once this command has ended, serve it with: PREFECT_HOME=(\S+) yattflow server\)")
# the line at the start: the page on the command's temporary server (its own port, not 4200), and the one for after
LIVE = re.compile(r"train-console in the Prefect UI: (http://127\.0\.0\.1:(\d+))/runs/flow-run/([0-9a-f-]{36}) \(live while "
                  r"this command runs; afterwards http://127\.0\.0\.1:4200/runs/flow-run/([0-9a-f-]{36}), served by: "
                  r"PREFECT_HOME=\S+ yattflow server\)")


def _embedded_env(home: Path) -> dict:
    return {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home), "TERM": "xterm-256color"}


def in_terminal(args: list[str], env: dict, timeout_s: float = 300, watch=None) -> tuple[int, list[tuple[float, bytes]], float]:
    """``python -m flows.cli *args`` in a 160x40 pty: its exit code, what it wrote and when each piece
    came, and when it ended. ``watch(chunks, proc)``, if given, runs in a thread while the command does."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[tuple[float, bytes]] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end closed
                return
            if not data:
                return
            chunks.append((time.monotonic(), data))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if watch is not None:
        threading.Thread(target=watch, args=(chunks, proc), daemon=True).start()
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    reader.join(timeout=10)
    os.close(master)
    return code, chunks, ended


@pytest.fixture(scope="module")
def terminal_run(prepared, tmp_path_factory) -> dict:
    """``yattflow train`` in a 160x40 pty: what it wrote, and when each piece came."""
    home = tmp_path_factory.mktemp("console-home")
    live: dict = {}

    def open_live_link(chunks, proc) -> None:
        """While the command runs: its printed live page's flow run, asked of that server's API."""
        while proc.poll() is None and "flow_run" not in live:
            found = LIVE.search(_plain(b"".join(c for _, c in list(chunks)).decode(errors="replace")))
            if found:
                base, _, run_id, _ = found.groups()
                try:
                    with urllib.request.urlopen(f"{base}/api/flow_runs/{run_id}", timeout=10) as answer:
                        live.update(flow_run=json.loads(answer.read()), running=proc.poll() is None)
                except OSError as e:
                    live["error"] = repr(e)
            time.sleep(0.5)

    began = time.monotonic()
    code, chunks, ended = in_terminal(["train", *TINY, f"storage.root={prepared}", "name=console", f"steps={STEPS}", "dp=1",
                                       f"eval.every={STEPS}"], _embedded_env(home), watch=open_live_link)
    text = b"".join(c for _, c in chunks).decode(errors="replace")
    assert code == 0, text[-3000:]
    print(f"\n[console] yattflow train ({STEPS} steps, embedded default) in a pty: {ended - began:.0f}s")
    return {"chunks": chunks, "text": text, "ended": ended, "home": home, "root": prepared, "live": live}


ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _plain(text: str) -> str:
    """The text without colours and cursor moves."""
    return ESCAPE.sub("", text)


def _first_seen(chunks: list[tuple[float, bytes]], pattern: str) -> float | None:
    """When the output first showed ``pattern`` (in its text without colours and cursor moves)."""
    decoder, raw, ends = codecs.getincrementaldecoder("utf-8")(errors="replace"), "", []
    for at, data in chunks:
        raw += decoder.decode(data)
        ends.append((len(raw), at))
    plain, where, pos = [], [], 0  # where[i]: the index in raw of plain's i-th character
    for m in [*ESCAPE.finditer(raw), None]:
        stop = len(raw) if m is None else m.start()
        plain.append(raw[pos:stop])
        where.extend(range(pos, stop))
        pos = stop if m is None else m.end()
    found = re.search(pattern, "".join(plain))
    if found is None:
        return None
    end = where[found.end() - 1]
    return next(at for length, at in ends if length > end)


def test_a_terminal_shows_a_live_progress_display_not_the_log(terminal_run):
    """The display (the run, a bar, step N/S, elapsed, time left, the step's reward, accuracy,
    kept/dropped and seconds) redraws as steps finish — each step's figure appears before the
    next one, while the command runs; Prefect's own lines are in the log file, not on the screen."""
    text, chunks = terminal_run["text"], terminal_run["chunks"]
    plain = _plain(text)
    shown = [_first_seen(chunks, rf"train console [^\n]*?━[^\n]*? {n}/{STEPS} steps") for n in range(STEPS + 1)]
    assert all(shown), plain[-3000:]
    assert shown == sorted(shown) and shown[1] < shown[STEPS] < terminal_run["ended"], shown
    assert re.search(rf"{STEPS}/{STEPS} steps \d:\d\d:\d\d elapsed \d:\d\d:\d\d left\s+reward \d\.\d{{3}}, accuracy [\d.]+%, "
                     r"kept \d+, dropped \d+, [\d.]+s", plain), plain[-3000:]
    assert re.search(rf"held-out mean \S+ reward after step {STEPS} .*: [\d.]+%", plain), plain[-3000:]
    assert "Finished in state" not in plain and "View at" not in plain and "anonymous usage" not in plain, plain[-3000:]
    # at the start, the page on the live temporary server (answering while the command ran), with the one for after;
    # at the end, only the one for after (the temporary server has stopped)
    lines = [m.start() for m in re.finditer("train-console in the Prefect UI: ", plain)]
    (start,), (end,) = list(LIVE.finditer(plain)), list(LINK.finditer(plain))
    assert lines == [start.start(), end.start()], plain[-3000:]
    assert start.group(2) != "4200" and start.group(3) == start.group(4) == end.group(2), (start.group(0), end.group(0))
    live = terminal_run["live"]
    assert live.get("running") and live["flow_run"]["id"] == start.group(3) and live["flow_run"]["name"] == "train-console", live
    log = Path(terminal_run["root"]) / "logs" / "console-train.log"
    assert f"log: {log}" in plain
    assert "Finished in state Completed()" in log.read_text() and "rollout dp=0 wave=0" in log.read_text()


def test_status_without_a_server_says_where_the_run_stands(terminal_run):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "status", "console", "--root", terminal_run["root"]], cwd=ROOT,
                         env=_embedded_env(terminal_run["home"]) | {"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(rf"console\s+{STEPS}/{STEPS}\s+step {STEPS}\s+[\d.]+% before RL → [\d.]+% after step {STEPS}\s+free",
                     out.stdout), out.stdout
    assert "no Prefect server at" in out.stdout
    # the learning curve: a sparkline per figure, a character per step, the held-out figures, the picture's path
    picture = Path(terminal_run["root"]) / "runs" / "console" / "curves.svg"
    assert f"console: {STEPS}/{STEPS} steps (picture: {picture})" in out.stdout, out.stdout
    for label in ("reward (mean)", "rollout accuracy"):
        assert re.search(rf"^  {re.escape(label)}\s+\S+ → \S+\s+[▁▂▃▄▅▆▇█]{{{STEPS}}}$", out.stdout, re.M), out.stdout
    assert re.search(rf"^  held-out\s+[\d.]+% before RL, [\d.]+% after {STEPS} steps$", out.stdout, re.M), out.stdout
    assert picture.read_text().count("<polyline") == 2


@needs_browser
def test_the_printed_link_opens_the_run_after_the_command_ended(terminal_run, tmp_path):
    """``yattflow server`` on the run's PREFECT_HOME (the command the run printed, on a free port):
    the printed page shows the run Completed, its iterations, and a step's stage tasks with their
    states; ``yattflow status`` adds the run's flow-run state."""
    pytest.importorskip("playwright", reason="needs the Python package playwright")
    plain = _plain(terminal_run["text"])
    link, run_id, home = LINK.search(plain).groups()
    assert home == str(terminal_run["home"])
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(port), "--no-worker"], cwd=ROOT,
                              env=_embedded_env(terminal_run["home"]), stdout=log, stderr=subprocess.STDOUT)
    browser = Browser(f"http://127.0.0.1:{port}", tmp_path)
    try:
        deadline = time.time() + 120
        while "Prefect UI:" not in (tmp_path / "server.log").read_text():
            assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        browser.open(link.replace(":4200", f":{port}").removeprefix(browser.base)).wait_for("train-console")
        browser.click("Subflow Runs").wait_for(*(f"iteration-{s:04d}" for s in range(STEPS)))
        browser.shot("console-1-run.png")
        assert browser.text().count("Completed") >= STEPS + 1, browser.text()
        browser.click(f"iteration-{STEPS - 1:04d}").click("Subflow Runs").wait_for(f"iteration-{STEPS - 1:04d}-dp-0")
        browser.click(f"iteration-{STEPS - 1:04d}-dp-0").click("Task Runs")
        stages = ["rollout dp=0 wave=0", "genrm_score dp=0 wave=0", "dynamic_filter dp=0 wave=0", "train_step dp=0",
                  "sync_weights dp=0", "checkpoint dp=0"]
        browser.wait_for(*stages)
        browser.shot("console-2-step-tasks.png")
        text = browser.text()
        n = text.count(" dp=0")
        assert n >= len(stages) and f"({n} Completed)" in text, text
        # with the server up, `yattflow status` puts the run's flow-run state beside its storage row
        status = subprocess.run([sys.executable, "-m", "flows.cli", "status", "console", "--root", terminal_run["root"]],
                                cwd=ROOT, env=_embedded_env(terminal_run["home"]) | {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert re.search(rf"console\s+{STEPS}/{STEPS}\s+step {STEPS}\s.*\sfree\s+Completed \(train-console\)", status.stdout), status.stdout
    finally:
        browser.close()
        server.send_signal(2)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# ------------------------------------------------------------- expected errors, as a person sees them


def _screen(text: str) -> list[str]:
    """The lines a terminal keeps: each line's last redraw (``\\r``), without colours and cursor moves."""
    lines = []
    for line in _plain(text.replace("\x1b[2K", "\r")).split("\n"):  # an erased line is redrawn
        drawn = [part for part in line.split("\r") if part.strip()]
        if drawn:
            lines.append(drawn[-1].rstrip())
    return lines


def _pickled_model(prepared: str, to: Path, ran: Path) -> str:
    """The policy's folder with its weights as a pickle that runs code when loaded (it would create ``ran``)."""
    import pickle
    import shutil

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    shutil.copytree(Path(prepared) / "models" / "policy-sft", to)
    (to / "model.safetensors").unlink()
    (to / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    return str(to)


CASES = {  # name: (extra overrides, exit code, the last line)
    "bad-state": ([], 1, r"yattflow train: file://\S+/runs/console-bad-state/state\.json: not valid JSON \('utf-8' codec can't "
                         r"decode .*\), and none of the run's checkpoint folders is intact .*use another run name to start over"),
    # refused by the command's pre-flight, before the server and the hosts start (flows/preflight.py): exit code 2
    # (one case of that class here; each class's check by a direct call: tests/test_preflight.py, tests/test_chat.py)
    "pickled-model": (["model.policy={pickled}"], 2, r"yattflow: model\.policy: file://{pickled}/pytorch_model\.bin: "
                      r"pickled weights are never loaded \(unpickling can run code\); save the model as safetensors"),
    # a rule that passes the pre-flight (its reference answer as the response) and hangs on the model's answers: its
    # time-out on the host names it, the prompt and the response; the run stops, not retried as a hung host
    "rule-hangs": (["reward.rule={slow_rule}:slow_on_wrong", "reward.genrm_weight=0", "reward.rule_weight=1",
                    "reward.rule_timeout_s=1"], 1,
                   r"yattflow train: reward\.rule \S+slow_rule\.py:slow_on_wrong ran past reward\.rule_timeout_s=1s on "
                   r"prompt_id \d+, response .*; stopped at step 1 of \d+; .*fix that, then run the same command"),
    "lost-host": (["steps=2", "timeouts.stage_s=5"], 0, r"yattflow train: done in \d+s"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_expected_error_is_a_line_on_the_console_and_its_traceback_in_the_log(prepared, tmp_path, monkeypatch, case):
    """What issue 43 found printing tracebacks (a garbage state.json: ~35 lines; a pickled model:
    torch's text naming no file; a lost host healed: ~200 lines and 9 tracebacks; an answer column of
    integers, 13 tracebacks, is now refused by the same pre-flight as the pickle), run in a real terminal on the session's server: no traceback, at most a
    few lines besides the run's own (its log file, its page, its progress), the last line naming
    the file and field and what to do, the traceback in the log file that the line names."""
    extra, code, last = CASES[case]
    name = f"console-{case}"
    ran = tmp_path / "pickle-ran"
    paths = {"pickled": _pickled_model(prepared, tmp_path / "pickled", ran) if case == "pickled-model" else "",
             "slow_rule": tmp_path / "slow_rule.py"}
    paths["slow_rule"].write_text("import time\n\ndef slow_on_wrong(prompt, response, answer):\n"
                                  "    if response.strip() != answer:\n        time.sleep(3600)\n    return 1.0\n")
    if case == "bad-state":  # (with an intact checkpoint the run would rebuild state.json from its manifest)
        (Path(prepared) / "runs" / name / "checkpoints" / "000001").mkdir(parents=True)
        (Path(prepared) / "runs" / name / "state.json").write_bytes(bytes(range(128, 256)))  # not even text
    if case == "lost-host":
        monkeypatch.setenv("YATTFLOW_FAULTS", "rollout@1:dp-0:kill")
        monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(tmp_path))
    args = ["train", *TINY, f"storage.root={prepared}", f"name={name}", "dp=1", "data.heldout=null",
            *(e.format(**paths) for e in extra)]
    exit_code, chunks, _ = in_terminal(args, os.environ | {"TERM": "xterm-256color"})
    raw = b"".join(c for _, c in chunks).decode(errors="replace")
    screen = _screen(raw)
    assert exit_code == code and "Traceback" not in raw, "\n".join(screen)
    log = Path(prepared) / "logs" / f"{name}-train.log"
    own = (f"log: {log} ", f"train-{name} in the Prefect UI: ", f"train {name} ", f"run '{name}': ",  # the run's own lines
           "yattflow fault injection: ")  # (the injector's, from the host it kills)
    said = [line for line in screen if not line.startswith(own)]
    assert len(said) <= 4 and re.match(last.format(**paths), said[-1]), "\n".join(screen)
    if code == 1:  # failed in the run: the line names the log file
        assert said[-1].endswith(f"(log: {log})") and "Traceback" in log.read_text()
    if code == 2:  # refused before anything started: the line alone, the traceback in the log file
        assert screen == said == [said[-1]] and "Traceback" in log.read_text()  # no log line, no UI link: no server
    if case == "rule-hangs":  # the rule's error, once: no restart of the hosts (retries.run); and `yattflow status`
        assert "Restarting the engine hosts" not in raw and "Restarting the engine hosts" not in log.read_text()
        # lists a failed command-line run beside the deployments' runs
        status = subprocess.run([sys.executable, "-m", "flows.cli", "status", name], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert re.search(rf"train-{name}\s+Failed .* {name}\s+0/\d+\s+yattflow train", status.stdout), status.stdout
    if case == "lost-host":  # the failed task and the restart: a line each, each on a line of its own
        assert [line.split(" | ")[1].strip() for line in said[:-1]] == ["ERROR", "WARNING"], "\n".join(screen)
        assert "died. Restarting the engine hosts" in said[1]
    assert not ran.exists(), "the pickle ran"
