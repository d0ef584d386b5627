"""kvpool: the in-engine vLLM plugin and its agent-side reader.

Ports, from `KVPILOT_KVPOOL_PORT` (the runtime sets one per instance; unset, the plugin
does nothing) on `KVPILOT_KVPOOL_HOST` (default 127.0.0.1):

* engine core of data-parallel rank r: block pool and preemptions on `PORT + r`;
* worker owning a CUDA device: the caching allocator on `PORT + 100 + local_rank`, where
  local_rank is the node-local device slot (DP-local rank * TP * PP + TP rank).

`plugin` is the entry point (imports vLLM lazily); `client` is what the agent imports.
"""
