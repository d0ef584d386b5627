"""One tick: read every source once (NVML once), derive the figures, evaluate the rules."""
