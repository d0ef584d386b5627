"""The tuner inside the agent: the study from the config (`study`), the tuner's adapters over
the local and Kubernetes runtimes (`local_adapter`, built by `factory`; `kubernetes_adapter`,
run on the pod runtime by `pod_tuner`), the load observer (`observer`), which flags run and
why (`promoted`), the schedule (`schedule`) and the learned workload (`workload`)."""
