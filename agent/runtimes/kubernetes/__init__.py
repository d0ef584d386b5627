"""vLLM in Kubernetes: the runtime (`runtime`) that keeps a canary Deployment beside the stable
one, the pod runtime (`pod`) the sidecar in vLLM's pod runs, and what they stand on: the API
client and its deadlines (`api`, `faults`), the objects and patches (`objects`, `values`),
the tuner's Lease (`lease`), live-traffic splits (`traffic`, `route_weights`), edits made
meanwhile (`edits`), recommend-only promotion (`recommend`), the handover ConfigMap
(`handover_configmap`), canary restarts (`restarts`) and unattended canaries (`unattended`)."""
