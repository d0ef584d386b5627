"""kvpilot.collectors.kvpool."""
