"""The run's metrics where people look, beside the Prefect artifacts: TensorBoard event files
in ``runs/<name>/tensorboard`` always, and an MLflow run when ``MLFLOW_TRACKING_URI`` is set.

    tensorboard --logdir yattflow-data/runs/demo/tensorboard

Steps are counted from 1, as in the logs; the held-out metric before RL is step 0. A resumed run
writes on from its first new step and TensorBoard hides what the stopped run wrote past it
(``purge_step``); the MLflow run of the same name is continued. With an object-store root the
event files are written locally and copied to the run's folder after every step.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from engines.config import RunConfig
from flows.metrics import TIMED, StepMetrics
from storage import objectstore

# tag → StepMetrics field: what a step adds to the curves, beside train/<name> for every trainer figure
SCALARS = {
    "rollout/reward": "reward", "rollout/accuracy": "accuracy", "rollout/response_tokens": "response_tokens",
    "sampling/kept_groups": "kept_groups", "sampling/dropped_groups": "dropped_groups", "sampling/waves": "waves",
    "sampling/stale_dropped": "stale_dropped", "train/trained_tokens": "train_tokens",
    "seconds/step": "step_s", "seconds/engines": "engine_s", **{f"seconds/{stage}": f"{stage}_s" for stage in TIMED},
}


class MetricsLog:
    """One run's TensorBoard writer (and MLflow run): ``step`` after every RL step, ``heldout``
    for each held-out figure, ``close`` at the end."""

    def __init__(self, config: RunConfig, first_step: int, heldout_metric: str | None):
        self.uri = objectstore.join(config.run_uri, "tensorboard")
        self.heldout_tag = f"heldout/{heldout_metric}" if heldout_metric else None
        if objectstore.is_local(self.uri):
            self.local = objectstore.fs_for(self.uri)[1]
        else:  # written here, copied to the run's folder after every step
            self.local = tempfile.mkdtemp(prefix="yattflow-tensorboard-")
        self.writer = EventWriter(self.local, purge_step=first_step + 1 if first_step else None)
        self.mlflow = _mlflow_run(config) if os.environ.get("MLFLOW_TRACKING_URI") else None
        self.heldout_steps: set[int] = set()  # the figure after the last step may be eval.every's too
        self.evaluation_steps: set[int] = set()  # the same for every set's figures

    def step(self, metrics: StepMetrics) -> None:
        values = {tag: getattr(metrics, field) for tag, field in SCALARS.items() if getattr(metrics, field) is not None}
        values |= {f"train/{name}": value for name, value in metrics.train.items()}
        values |= {f"episodes/{name}": value for name, value in metrics.episodes.items()}
        self._log(values, metrics.step + 1)
        if metrics.staleness:  # off-policy: how many versions behind the trainer its samples were
            ages = [age for age, count in metrics.staleness.items() for _ in range(count)]
            self.writer.histogram("off_policy/staleness", np.asarray(ages, dtype=np.float64), metrics.step + 1,
                                  edges=np.arange(-0.5, max(ages) + 1.5))
        if metrics.heldout is not None:
            self.heldout(metrics.step + 1, metrics.heldout)
        self.evaluation(metrics.step + 1, metrics.evaluation)
        self._publish()

    def heldout(self, step: int, value: float | None) -> None:
        if self.heldout_tag and value is not None and step not in self.heldout_steps:
            self.heldout_steps.add(step)
            self._log({self.heldout_tag: value}, step)
            self._publish()

    def evaluation(self, step: int, evaluation: dict[str, dict[str, float]] | None) -> None:
        """Every evaluation set's figures as ``eval/<set>/<figure>`` (greedy, mean@k, pass@j, maj@k;
        engines/evaluation.py), once per step."""
        if not evaluation or step in self.evaluation_steps:
            return
        self.evaluation_steps.add(step)
        self._log({f"eval/{name}/{figure}": value for name, figs in evaluation.items() for figure, value in figs.items()
                   if figure != "prompts"}, step)
        self._publish()

    def close(self, failed: bool = False) -> None:
        """The last curves to storage. ``failed``: on the way out of a run that failed or was stopped (perhaps on
        storage): a short wait for the store, then a warning, never an error over the run's own. The MLflow run
        ends either way (FAILED when the run did), so that the next run of this process starts its own."""
        try:
            self.writer.close()
            if not failed:
                self._publish()
            else:
                try:
                    with objectstore.retry_at_most(objectstore.ON_THE_WAY_OUT_S):
                        self._publish()
                except objectstore.StorageError as e:
                    objectstore.log.warning("%s: TensorBoard's last lines not written (%s)", self.uri, " ".join(str(e).split()))
        finally:
            if self.mlflow is not None:
                self.mlflow.end_run(status="FAILED" if failed else "FINISHED")

    def _log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.scalar(tag, value, step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({mlflow_name(tag): float(v) for tag, v in values.items()}, step=step)

    def _publish(self) -> None:
        self.writer.flush()
        if self.local != objectstore.fs_for(self.uri)[1]:
            for path in Path(self.local).iterdir():
                objectstore.write_bytes(objectstore.join(self.uri, path.name), path.read_bytes())


def mlflow_name(tag: str) -> str:
    """``tag`` as an MLflow metric name (alphanumerics and ``_ - . : /`` and spaces): ``eval/heldout/mean@4`` →
    ``eval/heldout/mean_at_4``."""
    return re.sub(r"[^\w\-.:/ ]", "_", tag.replace("@", "_at_").replace("'", ""))


class EventWriter:
    """TensorBoard event files written with the ``tensorboard`` package's own writer and records (what
    torch's ``SummaryWriter`` wraps): the controller writes the curves without loading torch. As torch's,
    a write after ``close`` opens a new file."""

    def __init__(self, folder: str, purge_step: int | None):
        self.folder, self.file = folder, EventFileWriter(folder)
        if purge_step is not None:  # TensorBoard drops what an earlier writer wrote from this step on
            self.file.add_event(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._add(Summary.Value(tag=tag, simple_value=float(value)), step)

    def histogram(self, tag: str, values: np.ndarray, step: int, edges: np.ndarray) -> None:
        counts, edges = np.histogram(values, bins=edges)
        self._add(Summary.Value(tag=tag, histo=HistogramProto(
            min=float(values.min()), max=float(values.max()), num=float(values.size), sum=float(values.sum()),
            sum_squares=float((values * values).sum()), bucket_limit=edges[1:].tolist(), bucket=counts.tolist())), step)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def _add(self, value: Summary.Value, step: int) -> None:
        if self.file is None:
            self.file = EventFileWriter(self.folder)
        self.file.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=[value])))


def _mlflow_run(config: RunConfig):
    """The MLflow module with the run named ``config.name`` active in experiment ``yattflow``
    (continued when it exists; a new one gets the config as parameters)."""
    try:
        import mlflow
    except ImportError:
        raise RuntimeError(f"MLFLOW_TRACKING_URI is set ({os.environ['MLFLOW_TRACKING_URI']}) but mlflow is not installed: "
                           "pip install 'yattflow[mlflow]' (or unset MLFLOW_TRACKING_URI)") from None
    mlflow.set_experiment("yattflow")
    earlier = mlflow.search_runs(experiment_names=["yattflow"], filter_string=f"tags.mlflow.runName = '{config.name}'",
                                 max_results=1, output_format="list")
    if earlier:
        mlflow.start_run(run_id=earlier[0].info.run_id)
    else:
        mlflow.start_run(run_name=config.name)
        mlflow.log_params(_flat(config.model_dump()))
    return mlflow


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
