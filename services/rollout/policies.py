"""Which weights the rollout engine holds: the target's newest, or the failure agent's.

The learner announces each agent's versions on its own subject. The engine holds one
adapter at a time; before a job the worker loads the newest weights of the job's agent
(a hot swap, tens of milliseconds under llama.cpp). While the failure agent is in use
each agent's last weights are kept in memory, so switching back does not fetch again.
A job for a failure agent that has announced nothing is rolled by the target and its
group says so.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from coevolve.shared.messages import Agent, PolicyVersion
from coevolve.shared.policy_sync import PolicySyncError

log = logging.getLogger(__name__)

Fetch = Callable[[PolicyVersion], Awaitable[bytes]]
Load = Callable[[bytes, int], Awaitable[None]]


@dataclass
class AgentPolicies:
    """The announcements heard, the weights kept and the engine's current (agent,
    version); ``fetch`` gets verified weights (raises on a bad digest), ``load`` puts them
    into the engine."""

    fetch: Fetch
    load: Load
    announced: dict[Agent, PolicyVersion] = field(default_factory=dict)
    loaded: tuple[Agent, int] | None = None
    kept: dict[Agent, tuple[int, bytes]] = field(default_factory=dict)
    # announcements whose weights failed their digest: not fetched again
    refused: set[tuple[str, str]] = field(default_factory=set)
    _warned_no_failure_agent: bool = False

    def hear(self, agent: Agent, update: PolicyVersion) -> None:
        """Note an announcement (an older or equal version than known is ignored)."""
        known = self.announced.get(agent)
        if known is None or update.version > known.version:
            self.announced[agent] = update

    async def use(self, agent: Agent) -> Agent:
        """Load the newest weights of ``agent`` (the target's when the failure agent has
        none yet); returns the agent whose weights the engine now holds."""
        if agent == "failure" and "failure" not in self.announced:
            if not self._warned_no_failure_agent:
                log.warning("a failure-agent job, but no failure agent announced: the target rolls")
                self._warned_no_failure_agent = True
            agent = "target"
        update = self.announced.get(agent)
        if update is None:
            return agent  # nothing announced: the engine's initial weights
        version, blob = await self._newest(agent, update)
        if blob is not None and self.loaded != (agent, version):
            await self.load(blob, version)
            self.loaded = (agent, version)
            log.info("hot-swapped to %s policy version %d", agent, version)
        elif blob is None:
            # none of its weights could be had: the group says whose weights rolled it
            agent = self.loaded[0] if self.loaded else "target"
        if "failure" not in self.announced:
            self.kept.clear()  # one agent: nothing to switch back to
        return agent

    async def _newest(self, agent: Agent, update: PolicyVersion) -> tuple[int, bytes | None]:
        """(version, weights) to load for ``agent``: the announced ones unless refused or
        already held, else the last kept (None: the engine's are the newest we have)."""
        kept = self.kept.get(agent)
        held = self.loaded == (agent, update.version)
        if held or (kept is not None and kept[0] >= update.version):
            return (update.version, None) if held else kept  # type: ignore[return-value]
        if (update.object_name, update.sha256) not in self.refused:
            try:
                blob = await self.fetch(update)
            except PolicySyncError as exc:
                # keep sampling with the weights we have; a later announcement may be good
                self.refused.add((update.object_name, update.sha256))
                log.error("refused %s policy v%d: %s", agent, update.version, exc)
            else:
                self.kept[agent] = (update.version, blob)
                return update.version, blob
        if kept is not None:
            return kept
        return (self.loaded[1], None) if self.loaded else (0, None)
