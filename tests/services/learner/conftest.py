"""Fixtures for learner tests: the real SmolLM2-135M policy and real rollout groups.

The GGUF file is converted to safetensors once into ``runs/test-cache`` (ignored by git);
later loads read that cache in about a second, so each test gets a fresh policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from coevolve.services.learner.preference_pairs import EXPERT, PairSide
from coevolve.shared.messages import ChatMessage, RolloutGroup, Trajectory
from coevolve.shared.policy import (
    Generation,
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    load_policy,
)
from tests.support.cache import CACHE_DIR

PolicyFactory = Callable[[], LoadedPolicy]
GroupFactory = Callable[..., RolloutGroup]


TEMPERATURE = 0.8
SAMPLES = 12


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the test machine's cores are shared, and two spinning torch
    threads on a busy 2-core box run these small models 10x slower than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def policy_factory() -> PolicyFactory:
    def make() -> LoadedPolicy:
        torch.manual_seed(0)
        return load_policy(run_dir=CACHE_DIR, device="cpu")

    return make


@pytest.fixture
def policy(policy_factory: PolicyFactory) -> LoadedPolicy:
    return policy_factory()


@dataclass(frozen=True)
class Sampled:
    messages: list[ChatMessage]
    prompt: list[int]
    generations: list[Generation]

    def trajectory(
        self, generation: Generation, reward: float, name: str, version: int = 0
    ) -> Trajectory:
        """``generation`` as the rollout service records it: behaviour log-probs and a loss
        mask over the generated tokens."""
        return Trajectory(
            id=name,
            task_id="colour",
            messages=[*self.messages, ChatMessage(role="assistant", content=generation.text)],
            token_ids=self.prompt + generation.completion_ids,
            logprobs=[0.0] * len(self.prompt) + generation.logprobs,
            loss_mask=[0] * len(self.prompt) + [1] * len(generation.completion_ids),
            reward=reward,
            policy_version=version,
            temperature=generation.temperature,
        )


@pytest.fixture(scope="session")
def sampled(policy_factory: PolicyFactory) -> Sampled:
    """Answers of the untrained policy, sampled once by the real engine (batched)."""
    policy = policy_factory()
    # A short raw prompt (no chat template) keeps every forward pass in these tests cheap.
    messages = [ChatMessage(role="user", content="Name a colour.")]
    prompt = policy.tokenizer("My favourite colour is", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, seed=0)
    generations = TransformersEngine(policy).generate([prompt] * SAMPLES, params)
    return Sampled(messages, prompt, generations)


@pytest.fixture
def make_group(sampled: Sampled) -> GroupFactory:
    """``make_group(rewards, version=0, offset=0)``: a group of real sampled trajectories
    (see :meth:`Sampled.trajectory`); ``offset`` picks other samples."""

    def make(rewards: list[float], version: int = 0, offset: int = 0) -> RolloutGroup:
        trajectories = [
            sampled.trajectory(
                sampled.generations[(offset + i) % SAMPLES], reward, f"traj-{offset}-{i}", version
            )
            for i, reward in enumerate(rewards)
        ]
        return RolloutGroup(
            task_id="colour", origin="seed", policy_version=version, trajectories=trajectories
        )

    return make


@pytest.fixture
def experts(policy_factory: PolicyFactory, sampled: Sampled) -> dict[str, PairSide]:
    """The ideal answer to the sampled prompt, as an expert side of task "colour"."""
    tokenizer = policy_factory().tokenizer
    answer = tokenizer(" ultramarine blue, like the sea.", add_special_tokens=False)["input_ids"]
    ids = sampled.prompt + answer
    mask = [0] * len(sampled.prompt) + [1] * len(answer)
    return {"colour": PairSide(ids, mask, 1.0, EXPERT)}
