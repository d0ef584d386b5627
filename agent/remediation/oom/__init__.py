"""The OOM guard (`guard.py`): a server that died of memory, at start-up (`startup.py`) or
mid-run, comes back with its memory knob stepped (`step.py`) within the planner's range
(`range.py`); the cgroup's OOM-kill count (`cgroup.py`) is part of the evidence."""
