"""The base of the services whose work is asking LLM roles (explorer, abstractor, judge)."""

from __future__ import annotations

from typing import ClassVar

from coevolve.shared.config import Settings
from coevolve.shared.llm.roles import Role, RoleClients
from coevolve.shared.runtime.actor import Actor


class RoleActor(Actor):
    """An actor with clients for its ``roles``, made from the ``llm`` section unless given
    (and then closed by whoever made them)."""

    roles: ClassVar[tuple[Role, ...]] = ()

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings)
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(
            settings.services.get("llm"), settings.run_dir, roles=self.roles
        )

    async def teardown(self) -> None:
        if self._own_llm:
            await self.llm.aclose()
