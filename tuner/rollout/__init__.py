"""A trial's rollout: its settings, the persisted record, the decisions and the ports it drives."""
