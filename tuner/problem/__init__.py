"""What the tuner optimises: the search space, its constraints, the objective under the SLO,
vLLM's start-up failures and the study's fingerprint."""
