"""A receiver that repeats the request back (a proxy's error page, a gateway naming the tenant
it refused) does not put the notifier's secrets into the delivery error, which the worker
logs and the outbox stores."""

from __future__ import annotations

import asyncio
from http.server import BaseHTTPRequestHandler

import httpx
from pydantic import SecretStr

from kvpilot.agent.notify import AlertmanagerNotifier, SlackNotifier, WebhookNotifier
from kvpilot.agent.notify.base import DeliveryError, Notifier
from tests.agent.notify.notify_helpers import make_event
from tests.http_helpers import ServedInThread


class _Echo(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen = [self.path, self.headers.get("X-Scope-OrgID"), self.headers.get("Authorization")]
        data = ("refused POST " + " ".join(s for s in seen if s)).encode()
        self.send_response(400)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_every_notifier_masks_what_the_receiver_repeats() -> None:
    with ServedInThread(_Echo) as echo:
        base = f"http://127.0.0.1:{echo.port}"

        async def errors() -> list[str]:
            async with httpx.AsyncClient() as client:
                notifiers: list[Notifier] = [
                    WebhookNotifier(
                        "webhook",
                        f"{base}/a?token=querytoken1",
                        client,
                        headers={"X-Auth": SecretStr("headervalue1")},
                    ),
                    AlertmanagerNotifier(
                        "am",
                        base,
                        client,
                        username="u",
                        password=SecretStr("ampassword1"),
                        headers={"X-Scope-OrgID": SecretStr("tenantsecret1")},
                    ),
                    SlackNotifier("slack", SecretStr(f"{base}/services/T1/B1/slackpath1"), client),
                ]
                found = []
                for notifier in notifiers:
                    try:
                        await notifier.send([make_event()])
                    except DeliveryError as err:
                        found.append(err.message)
                return found

        webhook, am, slack = asyncio.run(errors())
    assert webhook == "webhook: HTTP 400: refused POST /a?token=***"
    assert "tenantsecret1" not in am and "Basic" in am and "ampassword1" not in am
    assert am.startswith("am: HTTP 400: refused POST /api/v2/alerts *** Basic ***")
    assert slack == "slack: HTTP 400: refused POST ***"
