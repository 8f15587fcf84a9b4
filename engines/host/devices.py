"""Which of a DP group's engines hold its devices: placement on an engine host.

Full colocation switches at every stage (rollout → score → train → sync); partial keeps the
rollout engine and the judge resident together through ``rollout_and_score``, and training still
takes the devices alone. Overlapping lanes (``rollout.max_staleness``) keep every engine resident
(docs/off-policy.md). Stages that only read the trainer's weights (``export_policy``, ``params_sha``)
read a sleeping trainer's host copy.
"""

from __future__ import annotations

import time

NAMES = ("policy", "judge", "trainer", "critic")  # "judge": the scorers, the GenRM and the scalar reward model


class Devices:
    """The group's engines by name (``NAMES``; an absent engine is None) and which are ``awake``."""

    def __init__(self, engines: dict[str, list], awake: set[str], resident: bool = False):
        self.engines = {name: [e for e in engines.get(name, []) if e is not None] for name in NAMES}
        self.awake = set(awake)
        self.resident = resident  # every engine stays where it is: ``take`` switches nothing

    def take(self, *names: str) -> float:
        """Make ``names`` the engines holding the devices: the others release them first (``sleep``:
        vLLM offloads its weights and drops its KV cache; the Megatron trainer moves weights,
        gradients and optimizer state to host memory, ``engines/backends/megatron/offload.py``),
        then these wake. Answers the seconds the switch took."""
        if self.resident:
            return 0.0
        start = time.perf_counter()
        for name in sorted(self.awake - set(names)):
            for engine in self.engines[name]:
                engine.sleep()
            self.awake.discard(name)
        for name in names:
            if name not in self.awake:
                for engine in self.engines[name]:
                    engine.wake()
            self.awake.add(name)
        return time.perf_counter() - start
