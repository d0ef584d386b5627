"""kvpilot.dashboards."""
