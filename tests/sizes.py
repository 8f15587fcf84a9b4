"""The suite's run shapes as plain lists: no imports, so that a process that only needs a shape (the GPU
check's part child, a benchmark's parent) has it at once (``tests/helpers.py`` imports torch: ~8 s cold)."""

# The demo at test size: small enough to prepare in seconds, big enough that every stage does real work
# (the tests' prepared store, tests/conftest.py; the CPU rehearsals and benches that run the demo small).
TASK = [  # the demo task at the suite's size, as bench/ runs it
    "prepare.train_prompts=600", "prepare.heldout_prompts=40", "sft.hidden_size=32", "sft.layers=1",
    "sft.max_steps=150", "prepare.sft_target=0", "prepare.judge_target=0", "sft.check_every=150", "data.heldout_limit=40",
    "sampling.prompts_per_wave=4", "sampling.target_groups=2", "rollout.samples_per_prompt=4",
    "data.max_prompt_tokens=48", "rollout.max_new_tokens=8",  # the demo task's lengths (the defaults are a real model's)
]
# ... and as the tests run it: hosts forked from one server per process (engines/wire/launch.py), not each importing
# the engines (4-8 s of CPU a host, more than most of the suite's runs train); the demos' tests start theirs fresh
TINY = [*TASK, "hosts.fork=true"]
STUBS = ["rollout.backend=stub", "judge.backend=stub", "train.backend=stub"]  # the timing stubs: orchestration, no model
