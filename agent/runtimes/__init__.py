"""Where vLLM lives: `local` (kvpilot runs the server), `process` (a supervised process it
may signal), `attach` (servers known only by URL: watched, never signalled) and, in their own
room, `kubernetes` (Deployments through the API server)."""

from kvpilot.agent.runtimes.attach import AttachedServer, AttachRuntime
from kvpilot.agent.runtimes.base import (
    InstanceState,
    InstanceStatus,
    NotReady,
    ProcessesSurvived,
    Runtime,
    RuntimeFailure,
    RuntimeKind,
    RuntimeUnsupported,
    StopResult,
    UnknownInstance,
)
from kvpilot.agent.runtimes.local import LocalInstanceSpec, LocalRuntime
from kvpilot.agent.runtimes.process import ProcessRuntime, ProcessTarget, SupervisorTimeout
from kvpilot.collectors.vllm_argv import NotAVllmServer, ServerArgs, parse_server_argv

__all__ = [
    "AttachRuntime",
    "AttachedServer",
    "InstanceState",
    "InstanceStatus",
    "LocalInstanceSpec",
    "LocalRuntime",
    "NotAVllmServer",
    "NotReady",
    "ProcessRuntime",
    "ProcessTarget",
    "ProcessesSurvived",
    "Runtime",
    "RuntimeFailure",
    "RuntimeKind",
    "RuntimeUnsupported",
    "ServerArgs",
    "StopResult",
    "SupervisorTimeout",
    "UnknownInstance",
    "parse_server_argv",
]
