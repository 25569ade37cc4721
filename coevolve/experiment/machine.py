"""What a result needs to say about the machine and the code it was measured on."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from coevolve.code_version import git_commit


def cpu_flags() -> tuple[str | None, set[str]]:
    """The CPU's model name and its flags (None and nothing where /proc/cpuinfo is absent)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or None, set()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name"), set(fields.get("flags", "").split())


def cpu_facts() -> dict[str, Any]:
    """CPU model, core count, and whether it has native bf16 (AVX512_BF16, AMX)."""
    model, flags = cpu_flags()
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def policy_dtype() -> str:
    """The dtype the policy runs in on this machine."""
    from coevolve.shared.policy.loading import pick_device, pick_dtype

    return str(pick_dtype(pick_device())).removeprefix("torch.")


def machine_facts() -> dict[str, Any]:
    """CPU model, core count, native bf16 and the dtype the policy runs in here."""
    cpu = cpu_facts()
    return {"cpu": cpu.pop("model"), **cpu, "dtype": policy_dtype()}


def provenance() -> dict[str, Any]:
    """What every experiment result records of where it was made: ``commit`` (HEAD, short,
    ``+dirty``), ``cpu`` (:func:`cpu_facts`) and ``dtype``."""
    return {"commit": git_commit(), "cpu": cpu_facts(), "dtype": policy_dtype()}
