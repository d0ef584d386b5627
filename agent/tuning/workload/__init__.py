"""The workload a tuning run replays: the served traffic over a window (`window`), kept across
restarts (`keep`), learned by a one-shot command (`source`), chosen with its reason
(`choice`), as JSON for the API and back (`as_json`), and the last one replayed (`record`)."""
