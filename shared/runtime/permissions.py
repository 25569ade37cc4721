"""Who may do what on the bus: one NATS user per service, plus reader, operator and admin.

The table is data (``ROLES``), derived from the actor table in ``subjects.py``: each
service publishes what it produces, fetches and acks only its own durable consumers,
asks or answers only its own request subjects. ``nats_permissions`` turns a role into
the allow-lists of a nats-server ``authorization`` block (``authorization_config``, which
``shared/runtime/nats_server.py`` and the compose secrets use), and ``markdown_table`` renders
the table docs/security.md shows (a test checks that they agree).

Once a user has allow-lists, anything not on them is refused: no role but ``admin`` may
delete, update or purge a stream (the learner purges only the weights bucket's stream),
and a service may only create a stream (idempotent: an existing stream with another
configuration is left as it is).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from coevolve.shared.runtime.subjects import (
    ABSTRACTOR_CONSUMER,
    CANDIDATES,
    CONSUMERS,
    DEAD_LETTERS,
    EXPERIENCES,
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    EXPLORER_REQUESTS_CONSUMER,
    EXPLORER_SIGNALS_CONSUMER,
    FAILURE_POLICY_UPDATES,
    HEARTBEAT_BUCKET,
    HEARTBEATS,
    JUDGE_CONSUMER,
    LEARNER_GROUPS_CONSUMER,
    METRICS,
    MONITOR_GROUPS_CONSUMER,
    POLICY_BUCKET,
    POLICY_UPDATES,
    POOL_ADD,
    POOL_EXPERIENCES_CONSUMER,
    POOL_RESULTS_CONSUMER,
    POOL_RPC,
    POOL_VERDICTS_CONSUMER,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS,
    ROLLOUT_JOBS_CONSUMER,
    ROLLOUT_RESULTS,
    SERVICES,
    SIGNALS_ALL,
    STREAM_BY_NAME,
    STREAMS,
    TASK_ADDED,
    VERDICTS,
    ConsumerSpec,
    dead_letter_subject,
    heartbeat_subject,
    metrics_subject,
    stream_for,
)

ADMIN = "admin"
READER = "reader"
OPERATOR = "operator"

JS_API = "$JS.API"
INBOX = "_INBOX"
KV_STREAM = f"KV_{HEARTBEAT_BUCKET}"
OBJECT_STREAM = f"OBJ_{POLICY_BUCKET}"
POLICY_STREAM = stream_for(POLICY_UPDATES).name

Weights = Literal["none", "read", "write"]


@dataclass(frozen=True)
class Role:
    """What one NATS user may do, in the actor table's terms."""

    user: str
    summary: str
    publishes: tuple[str, ...] = ()  # JetStream subjects it publishes into
    consumes: tuple[ConsumerSpec, ...] = ()  # its own durables: create, fetch, ack
    listens: tuple[str, ...] = ()  # core NATS subscriptions (live views)
    requests: tuple[str, ...] = ()  # request/reply subjects it asks
    answers: tuple[str, ...] = ()  # request/reply subjects it answers
    watches: tuple[ConsumerSpec, ...] = ()  # consumer info only (backpressure)
    reads_policy_announcements: bool = False  # the last announced version
    weights: Weights = "none"
    service: bool = True  # heartbeats, metrics, dead letters under its own name
    reads_status: bool = False  # every stream's and consumer's info, heartbeat bucket

    def streams(self) -> tuple[str, ...]:
        """The streams this role may create and read the info of: every stream of the
        topology for a role that writes (creation only ever applies the configuration the
        code declares, and any service may be the first to start), none for the reader
        (it reads the info of all)."""
        if not (self.service or self.publishes):
            return ()
        return tuple(spec.name for spec in STREAMS)


# An interest stream drops a message no consumer is interested in yet: whoever creates
# it also declares its readers' durables (creates them; fetching stays the owner's).
INTEREST_CONSUMERS: tuple[ConsumerSpec, ...] = tuple(
    c for c in CONSUMERS if STREAM_BY_NAME[c.stream].retention == "interest"
)

ROLES: tuple[Role, ...] = (
    Role(
        "pool_store",
        "the task pool: feeds rollout jobs, records results and verdicts, answers the pool",
        publishes=(ROLLOUT_JOBS, TASK_ADDED),
        consumes=(POOL_RESULTS_CONSUMER, POOL_VERDICTS_CONSUMER, POOL_EXPERIENCES_CONSUMER),
        answers=(POOL_RPC, POOL_ADD),
    ),
    Role(
        "rollout",
        "runs rollout jobs with the announced policy",
        publishes=(ROLLOUT_GROUPS, ROLLOUT_RESULTS),
        consumes=(ROLLOUT_JOBS_CONSUMER,),
        # the learner's heartbeat: more groups while it waits for the data loop
        listens=(POLICY_UPDATES, FAILURE_POLICY_UPDATES, heartbeat_subject("learner")),
        watches=(LEARNER_GROUPS_CONSUMER,),
        reads_policy_announcements=True,
        weights="read",
    ),
    Role(
        "learner",
        "trains on rollout groups; the only writer of policy versions and weights",
        publishes=(POLICY_UPDATES, FAILURE_POLICY_UPDATES),
        consumes=(LEARNER_GROUPS_CONSUMER,),
        requests=(POOL_RPC,),
        reads_policy_announcements=True,
        weights="write",
    ),
    Role(
        "signal_monitor",
        "turns rollout groups into signals",
        publishes=(SIGNALS_ALL,),
        consumes=(MONITOR_GROUPS_CONSUMER,),
        requests=(POOL_RPC,),
    ),
    Role(
        "explorer",
        "explores from signals and exploration requests; with no labels, its own unguided ones",
        publishes=(EXPLORATIONS, EXPLORATION_REQUESTS),
        consumes=(EXPLORER_SIGNALS_CONSUMER, EXPLORER_REQUESTS_CONSUMER),
        requests=(POOL_RPC,),
    ),
    Role(
        "abstractor",
        "turns explorations into task candidates",
        publishes=(CANDIDATES,),
        consumes=(ABSTRACTOR_CONSUMER,),
        requests=(POOL_RPC,),
    ),
    Role(
        "judge",
        "judges candidates into verdicts",
        publishes=(VERDICTS,),
        consumes=(JUDGE_CONSUMER,),
    ),
    Role(
        "evaluator",
        "scores announced policy versions on held-out turns (optional)",
        listens=(POLICY_UPDATES,),
        reads_policy_announcements=True,
        weights="read",
    ),
    Role(
        "distiller",
        "distils experiences from rollout groups for navigated rollouts (off by default)",
        publishes=(EXPERIENCES,),
        listens=(ROLLOUT_GROUPS,),
        requests=(POOL_RPC,),
    ),
    Role(
        READER,
        "read-only CLI (`status`, `signals --follow`, `tasks`) and `up`'s event lines",
        listens=(
            f"{HEARTBEATS}.>",
            f"{METRICS}.>",
            POLICY_UPDATES,
            SIGNALS_ALL,
            VERDICTS,
            TASK_ADDED,
            f"{DEAD_LETTERS}.>",
        ),
        requests=(POOL_RPC,),
        service=False,
        reads_status=True,
    ),
    Role(
        OPERATOR,
        "`coevolve explore`: publishes exploration requests; adds tasks by hand",
        publishes=(EXPLORATION_REQUESTS,),
        requests=(POOL_ADD,),
        service=False,
    ),
)

ROLE_BY_USER: dict[str, Role] = {role.user: role for role in ROLES}
USERS: tuple[str, ...] = (ADMIN, *ROLE_BY_USER)
assert set(SERVICES) <= set(ROLE_BY_USER), "every service needs a role"


@dataclass(frozen=True)
class NatsPermissions:
    """The allow-lists of one nats-server user (anything else is refused)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    publish_deny: tuple[str, ...] = ()


def inbox_prefix(user: str) -> str:
    """A user's own inboxes: it cannot read the replies another user asked for."""
    return f"{INBOX}.{user}"


def _consumer_create(spec: ConsumerSpec) -> list[str]:
    base = f"{JS_API}.CONSUMER"
    return [
        f"{base}.CREATE.{spec.stream}.{spec.durable}",
        f"{base}.CREATE.{spec.stream}.{spec.durable}.>",
        f"{base}.DURABLE.CREATE.{spec.stream}.{spec.durable}",
    ]


def _ephemeral_reader(stream: str) -> list[str]:
    """Read a KV or object-store stream: direct gets and ordered (ephemeral) consumers."""
    return [
        f"{JS_API}.STREAM.NAMES",  # nats-py finds the stream of an ordered consumer
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def nats_permissions(user: str) -> NatsPermissions:
    if user == ADMIN:
        return NatsPermissions(publish=(">",), subscribe=(">",), allow_responses=True)
    role = ROLE_BY_USER[user]
    publish: list[str] = [*role.publishes, *role.requests]
    for stream in role.streams():
        publish += [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.STREAM.CREATE.{stream}"]
    for spec in role.consumes:
        publish += _consumer_create(spec)
        publish += [
            f"{JS_API}.CONSUMER.INFO.{spec.stream}.{spec.durable}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}",
            f"$JS.ACK.{spec.stream}.{spec.durable}.>",
        ]
    if role.streams():
        for spec in INTEREST_CONSUMERS:
            publish += _consumer_create(spec)
    publish += [f"{JS_API}.CONSUMER.INFO.{s.stream}.{s.durable}" for s in role.watches]
    if role.service:
        publish += [
            heartbeat_subject(user),
            metrics_subject(user),
            dead_letter_subject(user),
            f"$KV.{HEARTBEAT_BUCKET}.{user}.>",
            f"{JS_API}.STREAM.INFO.{KV_STREAM}",
            f"{JS_API}.STREAM.CREATE.{KV_STREAM}",
        ]
    if role.reads_policy_announcements:
        publish += [
            f"{JS_API}.STREAM.INFO.{POLICY_STREAM}",
            f"{JS_API}.STREAM.MSG.GET.{POLICY_STREAM}",
            f"{JS_API}.DIRECT.GET.{POLICY_STREAM}.>",
        ]
    if role.weights != "none":
        publish += _ephemeral_reader(OBJECT_STREAM)
    if role.weights == "write":
        publish += [
            f"{JS_API}.STREAM.CREATE.{OBJECT_STREAM}",
            f"{JS_API}.STREAM.PURGE.{OBJECT_STREAM}",
            f"$O.{POLICY_BUCKET}.>",
        ]
    if role.reads_status:
        publish += [
            f"{JS_API}.INFO",
            *(f"{JS_API}.STREAM.INFO.{spec.name}" for spec in STREAMS),
            f"{JS_API}.CONSUMER.INFO.*.*",
            *_ephemeral_reader(KV_STREAM),
        ]
    subscribe = [f"{inbox_prefix(user)}.>", *role.listens, *role.answers]
    return NatsPermissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        allow_responses=bool(role.answers),
        # belt and braces: never on an allow-list above, refused even if one grows
        publish_deny=(f"{JS_API}.STREAM.DELETE.>", f"{JS_API}.STREAM.UPDATE.>"),
    )


def may_create_stream(user: str | None, stream: str) -> bool:
    """Whether ``user`` may create ``stream`` (None or an unknown user: not restricted here;
    the server decides)."""
    role = ROLE_BY_USER.get(user or "")
    return role is None or stream in role.streams()


def may_declare_consumer(user: str | None, spec: ConsumerSpec) -> bool:
    role = ROLE_BY_USER.get(user or "")
    if role is None or spec in role.consumes:
        return True
    return bool(role.streams()) and spec in INTEREST_CONSUMERS


def may_update_streams(user: str | None) -> bool:
    return user is None or user == ADMIN or user not in ROLE_BY_USER


def authorization_config(passwords: Mapping[str, str]) -> str:
    """The nats-server ``authorization`` block for these users (JSON values: quoted,
    so ``$`` in subjects is never read as a variable)."""
    users = []
    for user, password in passwords.items():
        perms = nats_permissions(user)
        publish: dict[str, list[str]] = {"allow": list(perms.publish)}
        if perms.publish_deny:
            publish["deny"] = list(perms.publish_deny)
        permissions: dict[str, object] = {
            "publish": publish,
            "subscribe": {"allow": list(perms.subscribe)},
        }
        if perms.allow_responses:
            permissions["allow_responses"] = True
        entry = {"user": user, "password": password, "permissions": permissions}
        users.append("    " + json.dumps(entry))
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


# ----------------------------------------------------------------- documentation


def _cell(items: Iterable[str]) -> str:
    return "<br>".join(f"`{item}`" for item in items) or "-"


def markdown_table() -> str:
    """The permission table of docs/security.md, rendered from ``ROLES``."""
    lines = [
        "| user | role | publishes | consumes (own durables) | subscribes | requests | "
        "answers | JetStream extras |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role in ROLES:
        extras = []
        if role.watches:
            extras.append("consumer info of " + ", ".join(c.durable for c in role.watches))
        if role.reads_policy_announcements:
            extras.append("reads the last policy version")
        if role.weights == "write":
            extras.append(f"writes bucket `{POLICY_BUCKET}`")
        elif role.weights == "read":
            extras.append(f"reads bucket `{POLICY_BUCKET}`")
        if role.service:
            extras.append(f"own keys of `{HEARTBEAT_BUCKET}`, own heartbeat/metrics/dlq")
        if role.reads_status:
            extras.append(f"info of every stream and consumer, reads `{HEARTBEAT_BUCKET}`")
        consumes = [f"{c.stream}/{c.durable}" for c in role.consumes]
        lines.append(
            f"| `{role.user}` | {role.summary} | {_cell(role.publishes)} | {_cell(consumes)} "
            f"| {_cell(role.listens)} | {_cell(role.requests)} | {_cell(role.answers)} "
            f"| {'; '.join(extras) or '-'} |"
        )
    lines.append(
        f"| `{ADMIN}` | `coevolve up`'s stream setup only: may update streams | `>` | - "
        "| `>` | - | - | everything |"
    )
    return "\n".join(lines) + "\n"
