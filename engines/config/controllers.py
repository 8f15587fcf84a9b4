"""Where the DP groups' controllers run (``controllers.*``): ``docs/controllers.md``."""

from __future__ import annotations

from pydantic import Field

from engines.config.sections import Section


class ControllersConfig(Section):
    """Every DP group keeps its own controller (a ``dp-group`` sub-flow per step); this says which
    process runs it. One process costs Prefect's per-group bookkeeping (sub-flow and task engines,
    ~0.3-0.5 s of CPU per group and step) in the training run's process alone; node controllers
    spread it over the nodes' CPUs, and the training run then waits for one small result per node."""

    groups_per_node: int | None = Field(
        None, gt=0,
        description="None: every DP group's sub-flow runs in the training run's own process (one controller "
        "process). N: each iteration hands groups [k*N, (k+1)*N) to node controller k, a process of its own (started "
        "with the engine hosts, alive for the run) that runs those groups' dp-group sub-flows; the training run does "
        "one task per node. Needs a Prefect server (PREFECT_API_URL): the node controllers report to it.",
    )
    bind: str = Field(
        "127.0.0.1",
        description="Address a node controller listens on for the training run's commands (loopback: the node "
        "controllers run on the training run's machine).",
    )
    start_timeout_s: float = Field(120.0, gt=0, description="A node controller not listening by then fails the run.")

    def nodes(self, dp: int) -> list[list[int]]:
        """The DP groups of each node controller (one list holding all of them: no node controllers)."""
        per = self.groups_per_node or dp
        return [list(range(first, min(first + per, dp))) for first in range(0, dp, per)]
