"""Whether a handed-over promotion may be resumed: the ConfigMap is only a carrier.

Anyone who can write `<deployment>-kvpilot-handover` could otherwise make kvpilot patch the
Deployment with any command line (another model, `--trust-remote-code`), and a stale record
would roll it back to old flags weeks later. So the pod that writes a handover vouches for it
in the Deployment's tuning Lease, which only a holder writes (the data's SHA-256 under an
annotation, set while the Lease is its own or free); the next holder resumes only a handover
whose digest the Lease vouches for, consumes the vouch, and only when the record's flags
differ from the live Deployment's in the tuned flags alone. Recovery is held to the same
measure (`KeepEdits`): it restores the flags from before an interrupted trial only where the
live Deployment differs from them in the tuned flags alone, and leaves a person's change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvpilot.agent.runtimes.kubernetes.lease import DeploymentLease
from kvpilot.collectors.secrets import mask_argv
from kvpilot.collectors.vllm_argv import canonical_flags, without_flags
from kvpilot.tuner.problem.space import KnobKind, SearchSpace
from kvpilot.tuner.rollout.ports import PassThroughRuntime, TunerRuntime

log = logging.getLogger(__name__)
VOUCH = "kvpilot.dev/handover-sha256"
VOUCHED_BY = "kvpilot.dev/handover-by"


def vouch(lease: DeploymentLease, digest: str) -> bool:
    """Vouch for the handover just written (False: another tuner holds the Lease)."""
    return lease.annotate({VOUCH: digest, VOUCHED_BY: lease.identity})


def consume_vouch(lease: DeploymentLease) -> None:
    """The handover is taken: the same record found again later is not resumed."""
    lease.annotate({VOUCH: None, VOUCHED_BY: None})


def beyond_tuned_flags(
    argv: Sequence[str], live: Sequence[str], space: SearchSpace
) -> list[list[str]]:
    """The [flag, value] pairs in which `argv` and the live argv differ outside the tuned
    flags (both masked: the record keeps its secrets masked); [] when none."""
    valued = [k.flag for k in space.knobs if k.kind is not KnobKind.FLAG]
    bare = [k.flag for k in space.knobs if k.kind is KnobKind.FLAG]
    ours = canonical_flags(without_flags(mask_argv(argv), valued, bare))
    theirs = canonical_flags(without_flags(mask_argv(live), valued, bare))
    return [pair for pair in ours if pair not in theirs] + [
        pair for pair in theirs if pair not in ours
    ]


def refusal(
    lease: DeploymentLease,
    digest: str,
    argvs: Mapping[str, Sequence[str]],
    live: Sequence[str],
    space: SearchSpace,
) -> str | None:
    """Why a handover must not be resumed, or None when it may be (see the module)."""
    annotations = lease.annotations()
    if annotations.get(VOUCH) != digest:
        vouched = annotations.get(VOUCH)
        return (
            "no Lease holder vouches for it (the ConfigMap was written by someone else, or "
            f"is stale: the Lease vouches for {vouched[:12] if vouched else 'none'}, "
            f"the ConfigMap holds {digest[:12]})"
        )
    for which, argv in argvs.items():
        differing = beyond_tuned_flags(argv, live, space)
        if differing:
            shown = ", ".join(f"{f or '(positional)'}={v}" for f, v in differing[:4])
            return f"its {which} flags differ from the live Deployment's beyond the tuned: {shown}"
    return None


class KeepEdits(PassThroughRuntime):
    """The tuner's runtime for recovery: a restore whose flags differ from the live
    Deployment's outside the tuned flags is not made (a person changed the Deployment after
    the interrupted trial, and their change wins); `kept` says which, in words."""

    def __init__(self, inner: TunerRuntime, space: SearchSpace) -> None:
        super().__init__(inner)
        self._space = space
        self.kept: list[str] = []

    async def set_stable(
        self, argv: Sequence[str], *, reason: str, ready_timeout_s: float, restore: bool = False
    ) -> None:
        differing = beyond_tuned_flags(argv, self.stable_argv(), self._space) if restore else []
        if differing:
            shown = ", ".join(f"{f or '(positional)'}={v}" for f, v in differing[:4])
            kept = f"not restored ({reason}): the Deployment was changed meanwhile ({shown})"
            log.warning("%s", kept)
            self.kept.append(kept)
            return
        await super().set_stable(
            argv, reason=reason, ready_timeout_s=ready_timeout_s, restore=restore
        )
