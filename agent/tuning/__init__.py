"""The tuner inside the agent: the study from the config (`study`), the adapters over the
local and Kubernetes runtimes (`local`, `kubernetes`, built by `factory`), the load observer
(`observer`), which flags run and why (`promoted`), and the schedule (`schedule`)."""
