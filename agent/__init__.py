"""kvpilot.agent."""
