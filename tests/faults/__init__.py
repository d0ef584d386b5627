"""Fault tests: bad input, faults and abuse, each with a defined outcome."""
