"""Schedules staggered per Deployment: a fleet of sidecars sharing one crontab line would
otherwise ask for every canary's GPUs in the same minute.

Each Deployment's firing is the crontab time plus an offset (`schedule.StaggeredCron`): a
hash of its name into a settable window (`tuning.schedule_spread_s`). The hash is stable
across pods and restarts, so every replica of one Deployment fires at the same moment (one
of them wins the tuning Lease) and another Deployment fires at its own.
"""

from __future__ import annotations

import hashlib


def stagger_offset_s(name: str, window_s: int) -> int:
    """Whole seconds in [0, window_s): the same for the same name on every pod."""
    if window_s <= 0:
        return 0
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % window_s
