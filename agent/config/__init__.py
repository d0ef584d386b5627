"""The agent's configuration: pydantic models by section, loading, errors.

Relative paths are relative to the agent's working directory. Secrets are `SecretStr` and
never appear in errors, summaries or logs. Every command loads it the same way
(`agent/cli/config_load.py`): the YAML, then `KVPILOT_*` overrides, validated.
"""

from kvpilot.agent.config.agent import (
    AgentConfig,
    ApiConfig,
    ListenConfig,
    RetentionConfig,
    config_warnings,
    secret_values,
)
from kvpilot.agent.config.errors import ConfigError
from kvpilot.agent.config.kubernetes import KubernetesConfig
from kvpilot.agent.config.load import apply_env_overrides, load_config, validate_config
from kvpilot.agent.config.notifiers import (
    AlertmanagerAuth,
    AlertmanagerNotifierConfig,
    NotifierConfig,
    SlackNotifierConfig,
    WebhookNotifierConfig,
)
from kvpilot.agent.config.remediation import (
    BudgetConfig,
    CircuitBreakerConfig,
    PreflightConfig,
    RemediationConfig,
)
from kvpilot.agent.config.runtime import (
    AttachedServerConfig,
    AttachRuntimeConfig,
    InstanceConfig,
    LocalRuntimeConfig,
    PodRuntimeConfig,
    ProcessRuntimeConfig,
    RuntimeConfig,
)

__all__ = [
    "AgentConfig",
    "AlertmanagerAuth",
    "AlertmanagerNotifierConfig",
    "ApiConfig",
    "AttachRuntimeConfig",
    "AttachedServerConfig",
    "BudgetConfig",
    "CircuitBreakerConfig",
    "ConfigError",
    "InstanceConfig",
    "KubernetesConfig",
    "ListenConfig",
    "LocalRuntimeConfig",
    "NotifierConfig",
    "PodRuntimeConfig",
    "PreflightConfig",
    "ProcessRuntimeConfig",
    "RemediationConfig",
    "RetentionConfig",
    "RuntimeConfig",
    "SlackNotifierConfig",
    "WebhookNotifierConfig",
    "apply_env_overrides",
    "config_warnings",
    "load_config",
    "secret_values",
    "validate_config",
]
