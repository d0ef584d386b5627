"""Notifiers (webhook, Alertmanager, Slack) and at-least-once delivery from the outbox."""

from kvpilot.agent.notify.alertmanager import AlertmanagerNotifier
from kvpilot.agent.notify.base import DeliveryError, Notifier
from kvpilot.agent.notify.delivery import (
    Backoff,
    DeliveryCount,
    DeliveryReport,
    DeliveryWorker,
    Outbox,
    OutboxItem,
)
from kvpilot.agent.notify.signing import sign, verify_signature
from kvpilot.agent.notify.slack import SlackNotifier
from kvpilot.agent.notify.webhook import WebhookNotifier

__all__ = [
    "AlertmanagerNotifier",
    "Backoff",
    "DeliveryCount",
    "DeliveryError",
    "DeliveryReport",
    "DeliveryWorker",
    "Notifier",
    "Outbox",
    "OutboxItem",
    "SlackNotifier",
    "WebhookNotifier",
    "sign",
    "verify_signature",
]
