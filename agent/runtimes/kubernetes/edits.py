"""A person's edit of the stable Deployment during a trial wins over the trial.

Promote, revert and recovery write argv built from the flags the trial started from; a
change someone made meanwhile (a new image, an env var, a flag) would be overwritten. The
Deployment's `metadata.generation` rises with every change of its spec and never with a
controller's status update (which changes `resourceVersion` only), so kvpilot notes the
generation when a trial starts and after each of its own writes, and refuses to write over
a generation it did not make: the trial aborts, says so, and the Deployment stays as the
person left it. Each write also carries the resourceVersion read, as its precondition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.agent.runtimes.base import RuntimeFailure


class EditedMeanwhile(RuntimeFailure):
    """Someone changed the stable Deployment's spec during the trial; nothing was written."""


def generation(deployment: Mapping[str, Any]) -> int:
    return int((deployment.get("metadata") or {}).get("generation") or 0)


class EditWatch:
    """The stable Deployment's generation as kvpilot last saw or made it."""

    def __init__(self) -> None:
        self.known: int | None = None

    def note(self, deployment: Mapping[str, Any]) -> None:
        """The Deployment as a trial starts, or as kvpilot's own write left it."""
        self.known = generation(deployment)

    def forget(self) -> None:
        """A new tuning run: what happened before it is not an edit during a trial."""
        self.known = None

    def check(self, deployment: Mapping[str, Any], doing: str) -> None:
        """Raise EditedMeanwhile when the Deployment's spec changed since it was noted."""
        now = generation(deployment)
        if self.known is not None and now != self.known:
            name = (deployment.get("metadata") or {}).get("name")
            raise EditedMeanwhile(
                f"the Deployment {name!r} was changed by someone else during the trial "
                f"(generation {self.known} -> {now}): not {doing}; it is left as they left it"
            )
