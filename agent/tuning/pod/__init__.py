"""Tuning on the pod runtime: canary Deployments, live traffic, the Lease, the handover."""
