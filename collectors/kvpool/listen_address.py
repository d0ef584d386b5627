"""Where the kvpool plugin listens: the environment the runtime sets for each instance."""

PORT_ENV = "KVPILOT_KVPOOL_PORT"
HOST_ENV = "KVPILOT_KVPOOL_HOST"
DEFAULT_HOST = "127.0.0.1"
# A worker's allocator figures: PORT + ALLOCATOR_PORT_OFFSET + node-local device slot.
ALLOCATOR_PORT_OFFSET = 100
# The engine core's port names its workers' ports in this family (the port as the value).
WORKER_PORT_FAMILY = "kvpool_worker_port"
