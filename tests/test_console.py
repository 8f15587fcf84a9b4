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
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.helpers import free_port
from tests.test_ui import Browser, needs_browser

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
LINK = re.compile(r"train-console in the Prefect UI: (http://127\.0\.0\.1:4200/runs/flow-run/([0-9a-f-]{36})) "
                  r"\(once this command has ended, serve it with: PREFECT_HOME=(\S+) yattflow server\)")


def _embedded_env(home: Path) -> dict:
    return {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home), "TERM": "xterm-256color"}


@pytest.fixture(scope="module")
def terminal_run(prepared, tmp_path_factory) -> dict:
    """``yattflow train`` in a 160x40 pty: what it wrote, and when each piece came."""
    home = tmp_path_factory.mktemp("console-home")
    began = time.monotonic()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *TINY, f"storage.root={prepared}", "name=console",
                             f"steps={STEPS}", "dp=1", f"eval.every={STEPS}"],
                            cwd=ROOT, env=_embedded_env(home), stdin=slave, stdout=slave, stderr=slave, close_fds=True)
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
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    reader.join(timeout=10)
    os.close(master)
    text = b"".join(c for _, c in chunks).decode(errors="replace")
    assert code == 0, text[-3000:]
    print(f"\n[console] yattflow train ({STEPS} steps, embedded default) in a pty: {ended - began:.0f}s")
    return {"chunks": chunks, "text": text, "ended": ended, "home": home, "root": prepared}


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
    assert len(LINK.findall(plain)) == 2, plain[-3000:]  # at the start and at the end
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
