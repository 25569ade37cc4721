"""The signal monitor's settings (the ``services.signal_monitor`` section)."""

from __future__ import annotations

import msgspec

from coevolve.shared.messages import SIGNAL_KINDS, SignalKind


class MonitorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    kinds: tuple[SignalKind, ...] = SIGNAL_KINDS
    threshold: float = 0.5
    # boundary also fires on a group whose best and worst rewards differ by this much
    # (None: the threshold rule alone). 0.1 is one matched call of four at rollout's
    # partial credit 0.4; in runs 17-24 it flagged 5-9 groups of 15-22, the threshold 0-2
    boundary_margin: float | None = 0.1
    window: int = 10
    rare_theta: float = 0.05
    # about 4 minutes of rollout on a 2-core CPU (200 took 9: the first signal came at 17 min)
    rare_min_actions: int = 100
    uncertainty_quantile: float = 0.9
    uncertainty_min_samples: int = 50
    reservoir_size: int = 2048
    reservoir_seed: int = 0
    cooldown_s: float = 300.0
    bucket_capacity: float = 3.0
    bucket_refill_per_s: float = 1.0 / 600.0
    remember_groups: int = 4096
    strip_tokens: bool = True


class SignalMonitorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    state_file: str = "signal_monitor/state.json"
    task_cache_size: int = 4096
    detectors: MonitorConfig = msgspec.field(default_factory=MonitorConfig)
