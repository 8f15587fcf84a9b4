"""Loading benchmark: the host memory a Megatron rank needs to build its share of a policy from a
Hugging Face folder, reading the folder whole (the baseline: every tensor in memory first) against
reading only the tensors of its share (``mapping.HFState``: each tensor read from the safetensors
file when the rank's pipeline stage and TP slice need it).

    python -m bench.stage_load                          # a ~430 MB (fp32) Llama, ~1 min on 2 CPU cores
    python -m bench.stage_load --hidden 512 --layers 4

Two gloo processes (one DP group of two pipeline stages, then of two TP ranks; Megatron-Core on
the CPU under the tests' shim) each build the GPT of their share with ``model.build_gpt``, once
from ``load_hf_state`` (a dict of every tensor) and once from ``HFState.open`` (fresh processes
each time). **peak MB**: the process's high-water mark of resident memory (``VmHWM``) while it
builds, above the mark it had reached before (imports and the process group). Its share of the
model (the built GPT) is in both; the whole folder only in the baseline's. Prints a markdown table
and returns the figures.
"""

from __future__ import annotations

import argparse
import os
import runpy
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"PP=2": (1, 2), "TP=2": (2, 1)}  # name: (tensor_parallel, pipeline_parallel)
MODES = ("whole folder", "its share")


def high_water_mark() -> int:
    """This process's peak resident bytes so far (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rank(rank: int, port: int, folder: str, tp: int, pp: int, lazy: bool, out: str) -> None:
    import torch

    runpy.run_path(str(ROOT / "tests" / "megatron_cpu_site" / "sitecustomize.py"))  # Megatron-Core on the CPU
    import torch.distributed as dist
    from transformers import AutoConfig

    from engines.backends.megatron.mapping import HFState, load_hf_state
    from engines.backends.megatron.model import _init_distributed, build_gpt, transformer_config

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    device = torch.device("cpu")
    _init_distributed(tp, device, pp)
    hf_config = AutoConfig.from_pretrained(folder)
    config = transformer_config(hf_config, tp, torch.float32, pipeline_parallel=pp)
    before = high_water_mark()
    model = build_gpt(hf_config, config, HFState.open(folder) if lazy else load_hf_state(folder), device)
    peak = high_water_mark() - before
    share = sum(p.numel() * p.element_size() for p in model.parameters())
    Path(out, f"{rank}.txt").write_text(f"{peak} {share}")
    dist.destroy_process_group()


def measure(folder: str, tp: int, pp: int, lazy: bool) -> list[dict]:
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    with tempfile.TemporaryDirectory(prefix="yattflow-stage-load-") as out:
        mp.spawn(_rank, args=(free_port(), folder, tp, pp, lazy, out), nprocs=2, join=True)
        figures = [Path(out, f"{rank}.txt").read_text().split() for rank in range(2)]
    return [{"peak_mb": int(peak) / 2**20, "share_mb": int(share) / 2**20} for peak, share in figures]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.stage_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    from bench.sync import _policy

    with tempfile.TemporaryDirectory(prefix="yattflow-stage-load-") as tmp:
        folder, size = _policy(Path(tmp) / "policy", args.hidden, args.layers)
        figures = {name: {mode: measure(folder, tp, pp, lazy=mode == MODES[1]) for mode in MODES}
                   for name, (tp, pp) in LAYOUTS.items()}
    lines = [f"A Llama of {size / 2**20:.0f} MB (fp32, hidden {args.hidden}, {args.layers} layers), one DP group of two ranks",
             "", "| layout | rank | its share (MB) | peak MB, whole folder read | peak MB, its share read | ratio |",
             "|---|---|---|---|---|---|"]
    rows = []
    for name, by_mode in figures.items():
        for rank, (whole, share) in enumerate(zip(by_mode[MODES[0]], by_mode[MODES[1]])):
            ratio = share["peak_mb"] / whole["peak_mb"]
            lines.append(f"| {name} | {rank} | {share['share_mb']:.0f} | {whole['peak_mb']:.0f} | {share['peak_mb']:.0f} | "
                         f"{ratio:.2f} |")
            rows.append({"figure": f"peak MB building {name} rank {rank}: its share read vs the whole folder",
                         "yattflow": share["peak_mb"], "baseline": whole["peak_mb"], "ratio": ratio})
    print("\n".join(lines))
    return {"model_mb": size / 2**20, "figures": figures, "rows": rows}


if __name__ == "__main__":
    main()
