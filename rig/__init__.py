"""kvpilot.rig."""
