"""The canary judge: per-metric statistical tests over one analysis or over windows."""
