"""The `notifiers:` section: webhook, Alertmanager, Slack."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvpilot.agent.config.base import (
    NAME,
    check_http_url,
)
from kvpilot.agent.strict_model import StrictModel

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token


def _check_headers(headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
    """Header names and values that make a valid request; values are never shown."""
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name (letters, digits, -_.!#$%&'*+^`|~)")
        text = value.get_secret_value()
        if "\r" in text or "\n" in text:
            raise ValueError(f"header {name!r}: the value has a line break")
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text):
            raise ValueError(f"header {name!r}: the value has a control character")
    return headers


class _NotifierBase(StrictModel):
    name: str = Field(
        "",  # filled with the kind before validation; the schema shows it as optional
        pattern=NAME,
        description="Unique name; keys this receiver's outbox rows (default: the kind).",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one request may take, connecting to answer, before it is retried.",
    )
    send_resolved: bool = Field(True, description="Also notify when an alert resolves.")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _seconds_not_a_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read true as 1 s
            raise ValueError("must be a number of seconds, not true or false")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "name" not in data and isinstance(data.get("kind"), str):
            return {**data, "name": data["kind"]}
        return data


class WebhookNotifierConfig(_NotifierBase):
    """Posts Alertmanager's webhook payload (version 4) to any receiver written for it."""

    kind: Literal["webhook"] = Field(description="Alertmanager-compatible webhook.")
    url: str = Field(description="The receiver's URL.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Extra request headers (values are secrets)."
    )
    hmac_secret: SecretStr | None = Field(
        None, description="Signs each body with HMAC-SHA256 when set (never logged)."
    )
    repeat_interval_s: float = Field(
        4 * 3600.0, gt=0, description="Re-send a still-firing alert this often."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url)

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
        return _check_headers(headers)


class AlertmanagerAuth(StrictModel):
    """Basic or bearer authentication for Alertmanager's API."""

    username: str | None = Field(None, description="Basic-auth user.")
    password: SecretStr | None = Field(None, description="Basic-auth password.")
    bearer_token: SecretStr | None = Field(None, description="Bearer token.")

    @model_validator(mode="after")
    def _one_scheme(self) -> AlertmanagerAuth:
        basic = self.username is not None or self.password is not None
        if basic and self.bearer_token is not None:
            raise ValueError("use basic auth (username, password) or bearer_token, not both")
        if basic and (self.username is None or self.password is None):
            raise ValueError("basic auth needs both username and password")
        return self


class AlertmanagerNotifierConfig(_NotifierBase):
    """Pushes alerts to a real Alertmanager through `/api/v2/alerts`."""

    kind: Literal["alertmanager"] = Field(description="Alertmanager's v2 API.")
    url: str = Field(description="Alertmanager's base URL, e.g. http://alertmanager:9093.")
    auth: AlertmanagerAuth | None = Field(None, description="Credentials, if required.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Extra headers on every push, e.g. X-Scope-OrgID for a multi-tenant "
        "Alertmanager (values are secrets; Authorization only without auth).",
    )
    repeat_interval_s: float = Field(
        60.0,
        gt=0,
        description="Re-push firing alerts this often (Alertmanager resolves an alert whose "
        "endsAt passes without a re-push).",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url)

    @field_validator("headers")
    @classmethod
    def _valid_headers(
        cls, headers: dict[str, SecretStr], info: ValidationInfo
    ) -> dict[str, SecretStr]:
        if info.data.get("auth") is not None and "authorization" in {k.lower() for k in headers}:
            raise ValueError("auth sets the Authorization header: remove it from headers")
        return _check_headers(headers)


class SlackNotifierConfig(_NotifierBase):
    """Slack-compatible incoming-webhook text."""

    # Fields that once were, and why they went: the error says so instead of "unknown field".
    retired_fields: ClassVar[dict[str, str]] = {
        "channel": "Slack app incoming webhooks post to the channel chosen when the webhook "
        "was created and ignore a channel field; remove it (one webhook per channel)",
    }

    kind: Literal["slack"] = Field(description="Slack-compatible incoming webhook.")
    url: SecretStr = Field(
        description="The incoming-webhook URL (a secret: it holds the token); it posts to the "
        "channel chosen when the webhook was created."
    )
    repeat_interval_s: float = Field(
        4 * 3600.0, gt=0, description="Re-send a still-firing alert this often."
    )

    @field_validator("url")
    @classmethod
    def _slack_url(cls, url: SecretStr) -> SecretStr:
        check_http_url(url.get_secret_value())
        return url


NotifierConfig = Annotated[
    WebhookNotifierConfig | AlertmanagerNotifierConfig | SlackNotifierConfig,
    Field(discriminator="kind"),
]
