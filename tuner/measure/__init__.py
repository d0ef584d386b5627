"""Driving a server for a measurement: a trial's workload or trace replayed, capacity at the SLO."""
