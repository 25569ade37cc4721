"""Service skeleton: starts, heartbeats and drains; its work lands with its issue."""

from __future__ import annotations

from coevolve.shared.actor import Actor
from coevolve.shared.config import Settings


class AbstractorActor(Actor):
    name = "abstractor"


def build(settings: Settings) -> Actor:
    return AbstractorActor(settings)
