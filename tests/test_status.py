"""``yattflow status NAME`` exits 1 for a run that is nowhere: no run folder under the storage root (a
``runs/NAME`` with a state.json or lease.json) and no flow run of it on a Prefect server; 0 when either has
it. Called directly (``flows.status.status``) on a temporary root, the server faked: no engine, no server."""

from __future__ import annotations

import pytest

from flows import status as status_module
from storage.runstate import RunState
from tests.helpers import ROOT, free_port


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.chdir(ROOT)  # (status() moves to the checkout, as the worker does)
    monkeypatch.setattr(status_module, "api_url", lambda: f"http://127.0.0.1:{free_port()}/api")


def test_a_run_that_is_nowhere_exits_1_and_says_so(tmp_path, no_server, capsys):
    assert status_module.status(["gone", "--root", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "no run named 'gone' there" in out and "no Prefect server at" in out
    assert f"yattflow status: no run named 'gone' in {tmp_path}" in err and "no Prefect server to ask" in err


def test_a_run_folder_in_storage_exits_0(tmp_path, no_server, capsys):
    RunState(step=1, cursors=[16], checkpoint="runs/here/checkpoints/000001", heldout_before=0.25).save(str(tmp_path / "runs" / "here"))
    assert status_module.status(["here", "--root", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "here" in out and "no run named" not in out + err
    assert status_module.status(["--root", str(tmp_path)]) == 0  # (no name: every run there, none asked for)
    assert status_module.status(["elsewhere", "--root", str(tmp_path)]) == 1


@pytest.mark.parametrize("flow_runs, code", [(1, 0), (0, 1)])
def test_a_run_only_the_server_knows_exits_0_and_one_neither_knows_1(tmp_path, monkeypatch, capsys, flow_runs, code):
    """No folder (another root, or storage cleaned up) but a flow run of it on the server: it is there."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(status_module, "api_url", lambda: "http://127.0.0.1:1/api")
    monkeypatch.setattr(status_module.prefect_server, "healthy", lambda url: True)
    asked = []
    monkeypatch.setattr(status_module, "_flow_runs", lambda url, deployment, name, limit: asked.append(name) or (0, flow_runs))
    assert status_module.status(["remote", "--root", str(tmp_path)]) == code and asked == ["remote"]
    err = capsys.readouterr().err
    assert ("no run named 'remote'" in err) == bool(code) and "no Prefect server" not in err
