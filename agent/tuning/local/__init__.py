"""Tuning of servers kvpilot starts on this machine: the canary beside the stable server."""
