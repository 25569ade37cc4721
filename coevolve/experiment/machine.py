"""What a result needs to say about the machine it was measured on."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


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


def machine_facts() -> dict[str, Any]:
    """CPU model, core count, native bf16 and the dtype the policy runs in here."""
    from coevolve.shared.policy.loading import pick_device, pick_dtype

    model, flags = cpu_flags()
    dtype = pick_dtype(pick_device())
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "dtype": str(dtype).removeprefix("torch."),
    }
