"""The `kvpilot` command: one module per command group, one config loader for all."""


def main() -> None:
    """The console script's entry point; the command tree is imported only when it runs."""
    from kvpilot.agent.cli.main import main as run

    run()
