"""The tuner inside the agent: the study from the config, adapters, the schedule."""
