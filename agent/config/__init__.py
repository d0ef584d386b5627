"""The agent's configuration: pydantic models by section, loading, errors."""
