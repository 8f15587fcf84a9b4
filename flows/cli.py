"""``yattflow``: the command line.

    yattflow prepare [-c run.yaml] [key=value ...]   build the demo's datasets and tiny models
    yattflow train   [-c run.yaml] [key=value ...]   run (or resume) RL training
    yattflow demo    [-c run.yaml] [key=value ...]   prepare, then train, then print accuracy
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


def _quiet_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yattflow", description="RLHF training where every RL iteration is a Prefect flow.")
    parser.add_argument("command", choices=["prepare", "train", "demo"])
    parser.add_argument("-c", "--config", help="run config YAML (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4 dp=2")
    args = parser.parse_intermixed_args(argv)
    _quiet_defaults()

    from flows.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"yattflow: {e}", file=sys.stderr)
        return 2
    from flows.prepare import prepare
    from flows.training import train

    start = time.perf_counter()
    if args.command in ("prepare", "demo"):
        prepare(config_file=args.config, overrides=args.overrides)
    if args.command in ("train", "demo"):
        summary = asyncio.run(train(config_file=args.config, overrides=args.overrides))
        pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        print(f"\nrun '{config.name}': held-out exact-match accuracy {pct(summary['heldout_before'])} (SFT) "
              f"→ {pct(summary['heldout_after'])} (after {config.steps} RL steps); final policy: {summary['final_model']}")
    print(f"yattflow {args.command}: done in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
