"""Every ``services:`` section ``coevolve up`` hands to a service, read as that service
will read it, before anything starts: a wrong-typed setting is then one clear error on
the console instead of a service that exits and is restarted until it is held back."""

from __future__ import annotations

import importlib

import msgspec

from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.llm.roles import RoleConfigError, role_settings

# section -> "module:Struct" of the settings its service reads (imported on use)
SECTION_CONFIGS: dict[str, str] = {
    "pool_store": "coevolve.services.pool_store.config:PoolStoreConfig",
    "rollout": "coevolve.services.rollout.config:RolloutConfig",
    "learner": "coevolve.services.learner.config:LearnerServiceConfig",
    "signal_monitor": "coevolve.services.signal_monitor.config:SignalMonitorConfig",
    "explorer": "coevolve.services.explorer.config:ExplorerConfig",
    "abstractor": "coevolve.services.abstractor.config:AbstractorConfig",
    "judge": "coevolve.services.judge.config:JudgeConfig",
    "evaluator": "coevolve.services.evaluator.config:EvaluatorConfig",
    "distiller": "coevolve.services.distiller.config:DistillerConfig",
}


def enabled_optional_services(settings: Settings) -> set[str]:
    """The optional services (``OPTIONAL_SERVICES``) this configuration turns on."""
    from coevolve.services.distiller.config import distiller_enabled
    from coevolve.services.evaluator.config import evaluator_enabled

    enabled = {"evaluator"} if evaluator_enabled(settings) else set()
    return enabled | ({"distiller"} if distiller_enabled(settings) else set())


def step_credit_enabled(settings: Settings) -> bool:
    """Whether rollout labels steps (so the attributor LLM role is in use)."""
    from coevolve.services.rollout.config import RolloutConfig

    return settings.section("rollout", RolloutConfig).step_credit.enabled


def section_config(name: str) -> type[msgspec.Struct]:
    module, _, struct = SECTION_CONFIGS[name].partition(":")
    kind: type[msgspec.Struct] = getattr(importlib.import_module(module), struct)
    return kind


def check_sections(settings: Settings) -> None:
    """Read every service's section and the LLM roles'; ConfigError naming the first
    setting that cannot be used (``services.learner: Expected `float`, got `str` - at
    `$.grpo.lr```)."""
    for name in SECTION_CONFIGS:
        settings.section(name, section_config(name))
    try:
        role_settings(settings.services.get("llm"))
    except RoleConfigError as exc:
        raise ConfigError(f"services.{exc}") from exc
    check_failure_agent(settings)


def check_failure_agent(settings: Settings) -> None:
    """The failure agent needs both halves: the learner training it and pool-store giving
    it jobs; one without the other trains nothing or rolls groups nobody pairs."""
    from coevolve.services.learner.config import LearnerServiceConfig
    from coevolve.services.pool_store.config import PoolStoreConfig

    trained = settings.section("learner", LearnerServiceConfig).grpo.preference.failure_agent
    share = settings.section("pool_store", PoolStoreConfig).failure_agent_share
    if trained and share <= 0:
        raise ConfigError(
            "services.learner.grpo.preference.failure_agent is on but "
            "services.pool_store.failure_agent_share is 0: the failure agent would get no jobs"
        )
    if share > 0 and not trained:
        raise ConfigError(
            f"services.pool_store.failure_agent_share is {share} but "
            "services.learner.grpo.preference.failure_agent is off: nothing would train on "
            "the failure agent's groups"
        )
