"""Replicas of one Deployment acting together through Kubernetes' own objects: a restart
budget held in a Lease, the PodDisruptionBudget, Events for every decision, and the guards
kept per Deployment in a ConfigMap."""
