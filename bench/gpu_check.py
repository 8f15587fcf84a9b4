"""One command for a GPU lease: the production path on CUDA, checked and measured, into one report.

    python -m bench.gpu_check --out $OUT                 # on the GPU machine (docs/engines.md#the-gpu-check)
    python -m bench.gpu_check --device cpu --out DIR     # the CPU rehearsal (tiny sizes; tests/test_gpu_check.py)

A GPU is lent rarely and briefly (15 minutes of device time, a machine start included), so this
is rehearsed on the CPU by ``make test`` and run on the GPU as one call. Its parts, in order,
each in a subprocess of its own with its own time limit (a hang loses that part, not the lease;
the whole process group of a part is killed at its limit):

- ``env``: torch, CUDA, the GPU, the packages that travelled; the GPU's bf16 peak measured on a
  large matmul (MFU below is against this figure, not the data sheet's);
- ``tests``: ``pytest -m "gpu and not slow"`` — every GPU-marked test but the demo, which is the next part;
- ``demo``: the text demo on CUDA, dp=1, torch rollout and GenRM, the Megatron trainer in bf16,
  full colocation (the trainer sleeps around every rollout): held-out accuracy before and after
  RL and each step's reward (the bar: a lift of 20 points);
- ``sync``: a trainer step, then the weight sync into the rollout engine, and a fingerprint of
  each side (the rollout engine must hold the trainer's weights bit for bit), and the two
  engines' log-probabilities of the same tokens;
- ``speed``: ``bench.megatron_gpu`` at 0.44B and 1.2B (the Megatron engine beside transformers
  + SDPA + fused AdamW: tokens/s, MFU, peak memory) and the 1.2B policy's weight-sync time.

Each finished part rewrites ``gpu-report.md`` and ``gpu-report.json`` in ``--out``, so a report
is there whatever stops the run; ``gpu-check.log`` holds every part's output. Exit status 0 when
every part passed. On the GPU machine, with the wheels ``bench/gpu_wheels.sh`` builds carried as
``.whl`` (docs/engines.md says how):

    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \\
      && PYTHONPATH=$PWD:$PWD/.site python3 -m bench.gpu_check --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# seconds each part may take (the whole check also has --budget); the GPU's lease is ~13 minutes after its start
LIMITS = {"env": 60, "tests": 150, "demo": 240, "sync": 60, "speed": 180}
LIFT_BAR = 20.0  # held-out points the demo must gain (tests/test_demo.py's bar)
CPU_SPEED = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "64", "--batch", "2", "--vocab", "512",
             "--steps", "1", "--warmup", "1", "--allow-cpu"]


# -- the parts (each runs in its own process: ``--part NAME``) --------------------------------------

def part_env(args) -> dict:
    import importlib.metadata as md

    import torch

    cuda = args.device == "cuda"
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0], "packages": {}}
    for name in ("transformers", "megatron-core", "prefect", "peft", "pydantic", "safetensors"):
        try:
            out["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            out["packages"][name] = None
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch")
        props = torch.cuda.get_device_properties(0)
        out |= {"device": props.name, "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}"}
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        out["nvidia_smi"] = smi.stdout.strip()
    else:
        out["device"] = _cpu_name()
    # every module of the project imports with what travelled: a wheel missing from bench/gpu_wheels.sh's set is
    # one line here, not a failure deep in another part (the vLLM backend imports vLLM only when it is built)
    out["modules"], missing = _import_everything()
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a, b = (torch.randn(n, n, device=args.device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync()
    out["peak_tflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    out["peak_what"] = f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')} matmul, mean of {reps} after 3"
    if missing:
        raise PartFailed("modules that do not import: " + "; ".join(f"{m} ({e})" for m, e in missing.items()), out)
    return out


def _import_everything() -> tuple[int, dict[str, str]]:
    import importlib
    import pkgutil

    count, missing = 0, {}
    for package in ("flows", "tasks", "engines", "storage"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if info.name.endswith("__main__"):  # a command line, not a library module
                continue
            count += 1
            try:
                importlib.import_module(info.name)
            except Exception as e:  # noqa: BLE001 - each failure is named in the report
                missing[info.name] = f"{type(e).__name__}: {e}"
    return count, missing


def part_tests(args) -> dict:
    # only the files that hold GPU tests: a module that cannot import on the GPU machine (one needing vLLM or
    # s3fs, which do not travel) must not stop the collection of the others
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in f.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu and not slow", "-q", "-rfEs", "-p", "no:cacheprovider", *files]
    env = {k: v for k, v in os.environ.items() if k != "YATTFLOW_TEST_TIER"}  # every GPU test, whichever tier runs this
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n")
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    out = {"summary": summary, "counts": counts, "failed": failed, "returncode": proc.returncode}
    if proc.returncode not in (0, 5) or failed:  # 5: nothing collected
        raise PartFailed(f"pytest: {summary or proc.returncode}", out)
    return out


def part_demo(args) -> dict:
    root = Path(args.prepared) if args.prepared and args.device == "cpu" else Path(tempfile.mkdtemp(prefix="gpu-check-demo-"))
    if args.device == "cpu":  # the rehearsal: the demo as the tests run it, two RL steps
        from tests.sizes import TASK

        common = [f"storage.root={root}", "dp=1", *TASK, "steps=2"]
    else:
        common = [f"storage.root={root}", "dp=1"]
    # the shim's Megatron on the CPU is fp32; on the GPU the production setting, bf16
    megatron = ["name=gpu-check", "train.backend=megatron"] + (["model.dtype=bfloat16"] if args.device == "cuda" else [])
    out = _demo(common + megatron)
    if args.device == "cuda" and out.get("lift", 0) < LIFT_BAR:
        # the H100 run of 2026-11-22 did not learn either: the same RL (the prepared models reused) on the torch
        # trainer tells the Megatron path from the rest (torch generation and judge on CUDA)
        out["torch_trainer"] = _demo(common + ["name=gpu-check-torch", "train.backend=torch"])
        raise PartFailed(f"lift {out.get('lift', 0):.1f} points < {LIFT_BAR} (Megatron, bf16); with the torch trainer "
                         f"{out['torch_trainer'].get('lift', 'none')}", out)
    if "lift" not in out:
        raise PartFailed(f"the demo exited {out['returncode']}, no held-out figures", out)
    return out


def _demo(overrides: list[str]) -> dict:
    """``yattflow demo`` with ``overrides``: held-out accuracy before and after, each step's reward."""
    cmd = [sys.executable, "-m", "flows.cli", "demo", "-c", str(ROOT / "deployments" / "demo.yaml"), *overrides]
    print("$", " ".join(cmd), flush=True)
    lines, start = [], time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # as it goes: a part killed at its limit still leaves its steps in the log
            print(line, end="", flush=True)
            lines.append(line)
    text = "".join(lines)
    out = {"overrides": overrides, "step_rewards": [float(r) for r in re.findall(r"train step \d+/\d+ reward ([\d.]+)", text)],
           "seconds": time.perf_counter() - start, "returncode": proc.returncode}
    match = re.search(r"([\d.]+)% before RL → ([\d.]+)% after", text)
    if match:
        out |= {"before": float(match.group(1)), "after": float(match.group(2))}
        out["lift"] = out["after"] - out["before"]
    return out


def part_sync(args) -> dict:
    """A Megatron trainer step, full colocation's sleep, the sync into a TorchGenerator, wake; then
    the fingerprints and the log-probabilities of the rollout's own tokens under both engines."""
    from bench.megatron_gpu import _save_model, sync_into
    from engines.backends.base import TrainBatch, fingerprint
    from engines.backends.megatron.trainer import MegatronTrainer
    from engines.backends.torch.generator import TorchGenerator

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    folder = tempfile.mkdtemp(prefix="gpu-check-sync-")
    shape = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "seq": 64, "batch": 8}
    _save_model(folder, shape, vocab=512)
    trainer = MegatronTrainer(folder, lr=1e-3, dtype=dtype, device=args.device)
    generator = TorchGenerator(folder, dtype=dtype, device=args.device, autocast=False)
    gens = generator.generate(["12+34=", "7+8=", "99+1=", "5+5="], n=2, max_new_tokens=8, seed=0)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [1.0 if i % 2 else -1.0 for i in range(len(gens))])
    stats = trainer.train_step(batch)
    moved = trainer.sleep()  # full colocation: the rollout takes the device, the export reads the host copy
    synced = sync_into(trainer, generator)
    trainer.wake()
    awake_fp = fingerprint(trainer.export_weights())
    gens = generator.generate(["12+34=", "7+8="], n=2, max_new_tokens=8, seed=1)
    probe = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens], [0.0] * len(gens))
    gap = max(abs(a - b) for g, r in zip(gens, trainer.logprobs(probe)) for a, b in zip(g.logprobs, r))
    rollout_fp, asleep_fp = synced["fingerprint_rollout"], synced["fingerprint_trainer"]
    out = {"tensors": synced["sync_tensors"], "sync_s": synced["sync_s"], "slept_mib": moved / 2**20, "loss": stats["loss"],
           "fingerprint_trainer": awake_fp, "fingerprint_asleep": asleep_fp, "fingerprint_rollout": rollout_fp,
           "logprob_gap": gap, "dtype": dtype}
    if not rollout_fp == asleep_fp == awake_fp:
        raise PartFailed("the rollout engine's weights are not the trainer's after the sync", out)
    return out


def part_speed(args) -> dict:
    from bench import megatron_gpu

    argv = ["--sizes", "0.44b,1.2b", "--steps", "5", "--warmup", "2", "--sync"]
    argv += ["--peak-tflops", repr(args.peak_tflops)] if args.peak_tflops else []  # a CPU's is ~0.01-0.1: every digit
    result = megatron_gpu.main(argv + (CPU_SPEED if args.device == "cpu" else []))
    errors = [f"{r['size']} {r['engine']}: {r['error']}" for r in result["runs"] if "error" in r]
    out = {"runs": result["runs"], "peak_tflops": args.peak_tflops}
    unsynced = [r["size"] for r in result["runs"] if r.get("sync_matches") is False]
    if errors or unsynced:
        raise PartFailed("; ".join(errors + [f"{s}: weight sync fingerprints differ" for s in unsynced]), out)
    return out


PARTS = {"env": part_env, "tests": part_tests, "demo": part_demo, "sync": part_sync, "speed": part_speed}


class PartFailed(Exception):
    """A part ran and its check failed: its figures still go into the report."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


# -- the driver ----------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = re.search(r"Model name:\s*(.+)", out)
        return f"{name.group(1).strip()} ({os.cpu_count()} CPUs)" if name else "CPU"
    except OSError:
        return "CPU"


def run_part(name: str, args) -> None:
    """Child side: run one part, write {status, figures, error} to ``args.result``."""
    record: dict = {"status": "passed"}
    try:
        record["figures"] = PARTS[name](args)
    except PartFailed as e:
        record |= {"status": "failed", "error": str(e), "figures": e.figures}
    except Exception as e:  # noqa: BLE001 - any error is this part's result; the traceback is in the log
        import traceback

        traceback.print_exc()
        record |= {"status": "error", "error": f"{type(e).__name__}: {e}"}
    Path(args.result).write_text(json.dumps(record, default=str))


def _child_env(device: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TOKENIZERS_PARALLELISM="false")
    paths = [str(ROOT)] + ([str(ROOT / "tests" / "megatron_cpu_site")] if device == "cpu" else [])  # Megatron on CPU: the tests' shim
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def spawn(name: str, args, limit: float, log) -> dict:
    """Parent side: the part in a new process group, killed whole at ``limit`` seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", args.device, "--part", name, "--result", result]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    if args.prepared:
        cmd += ["--prepared", args.prepared]
    log.write(f"\n===== {name} (limit {limit:.0f} s) =====\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_child_env(args.device), start_new_session=True)
    try:
        proc.wait(timeout=limit)
        record = json.loads(Path(result).read_text()) if Path(result).stat().st_size else \
            {"status": "error", "error": f"exited {proc.returncode} without a result"}
    except subprocess.TimeoutExpired:
        record = {"status": "timed out", "error": f"still running after {limit:.0f} s: killed"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started (servers, engine hosts)
        except ProcessLookupError:
            pass
        proc.wait()
        Path(result).unlink(missing_ok=True)
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the rehearsal, at tiny sizes")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check"), help="folder for the report and the log")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check: a part gets what is left at most")
    p.add_argument("--peak-tflops", type=float, default=None, help="(parts) the measured peak, for MFU")
    p.add_argument("--prepared", help="(cpu) a storage root where the tiny demo is prepared already (the tests' own, TASK): "
                                      "the demo part trains on it rather than preparing it again")
    p.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        run_part(args.part, args)
        return 0
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown part {sorted(unknown)}: choose from {list(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "parts": {}}
    deadline = time.monotonic() + args.budget
    with open(out / "gpu-check.log", "w") as log:
        for name in parts:
            left = deadline - time.monotonic()
            if left < 10:
                report["parts"][name] = {"status": "not run", "error": "the check's --budget was spent"}
            else:
                report["parts"][name] = record = spawn(name, args, min(LIMITS[name], left), log)
                if name == "env" and record["status"] == "passed":
                    args.peak_tflops = record["figures"]["peak_tflops"]
            print(f"[gpu-check] {name}: {report['parts'][name]['status']} ({report['parts'][name].get('seconds', 0)} s)"
                  + (f" {report['parts'][name]['error']}" if "error" in report["parts"][name] else ""), flush=True)
            write_report(report, out)
    print((out / "gpu-report.md").read_text())
    return 0 if all(r["status"] == "passed" for r in report["parts"].values()) else 1


def _commit() -> str | None:
    try:
        # "-dirty": the tree that ran is not the commit (a device run carries the working tree, not always its history)
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git where the check runs (a copied tree)
        return None
    return proc.stdout.strip() or None


def write_report(report: dict, out: Path) -> None:
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-report.md").write_text(render(report))


def render(report: dict) -> str:
    parts = report["parts"]
    env = parts.get("env", {}).get("figures", {})
    lines = [f"# GPU check, {env.get('device', report['device'])}",
             f"\n{report['started']}, commit {report['commit']}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"packages {env.get('packages')}.",
             "\n| part | status | seconds | result |", "|---|---|---:|---|"]
    for name, r in parts.items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {_summary(name, r)} |")
    speed = parts.get("speed", {}).get("figures", {}).get("runs")
    if speed:
        lines += ["\n## Train step (bf16)\n", "| size | engine | params | seq x batch | step s | tokens/s | TFLOP/s | MFU | peak GiB |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in speed:
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "–"
            figures = (f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} | {100 * r['mfu']:.1f}%" if "error" not in r
                       else f"{r['error']} | | |")
            lines.append(f"| {r['size']} | {r['engine']} | {r['params']:,} | {r['seq']} x {r['batch']} | {figures} | {peak} |")
        lines.append(f"\nMFU against the measured peak, {parts['speed']['figures'].get('peak_tflops') or 0:.3g} TFLOP/s "
                     f"({env.get('peak_what')}).")
    for name, r in parts.items():
        if r["status"] != "passed" and r.get("error"):
            lines.append(f"\n**{name}**: {r['error']}")
    return "\n".join(lines) + "\n"


def _summary(name: str, r: dict) -> str:
    f = r.get("figures") or {}
    if name == "env" and f:
        return (f"{f.get('device')}; measured peak {f.get('peak_tflops', 0):.3g} TFLOP/s; {f.get('modules')} project modules "
                "import")
    if name == "tests" and f:
        return f.get("summary", "") + (f"; failed: {', '.join(f['failed'])}" if f.get("failed") else "")
    if name == "demo" and f:
        text = _demo_summary(f)
        return text + (f"; torch trainer: {_demo_summary(f['torch_trainer'])}" if "torch_trainer" in f else "")
    if name == "sync" and f:
        return (f"{f['tensors']} tensors in {1e3 * f['sync_s']:.1f} ms; fingerprints trainer {f['fingerprint_trainer']}, rollout "
                f"{f['fingerprint_rollout']}; log-prob gap {f['logprob_gap']:.2e} ({f['dtype']})")
    if name == "speed" and f.get("runs"):
        synced = [r for r in f["runs"] if "sync_s" in r]
        return "; ".join(f"{r['size']} sync {r['sync_s']:.2f} s ({r['sync_gib']:.2f} GiB), fingerprints "
                         f"{'equal' if r['sync_matches'] else 'DIFFER'}" for r in synced)
    return r.get("error", "")


def _demo_summary(f: dict) -> str:
    held = f"held-out {f['before']}% → {f['after']}% (lift {f['lift']:.1f}, bar {LIFT_BAR:.0f}); " if "lift" in f else ""
    return held + "step rewards " + " ".join(f"{x:.2f}" for x in f["step_rewards"])


if __name__ == "__main__":
    sys.exit(main())
