"""kvpilot.collectors."""
