"""`python -m kvpilot.agent` runs the `kvpilot` command."""

from kvpilot.agent.cli.main import main

main()
