"""kvpilot.tuner."""
