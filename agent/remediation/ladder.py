"""Which steps a firing alert leads to, per rule and its configured action.

* `alert`: notify only; nothing is planned.
* `restart`: the light step where vLLM offers one and the user enabled it (resetting the
  prefix cache), then a restart with the same flags.
* `ladder` (the preemption spike's and capacity waiting's default): a restart with the
  tuner's validated better flags when it holds some (a promotion; where the runtime cannot
  change flags, a recommendation naming them instead); a restart with the same flags only
  for the capacity-leak signature; otherwise no restart, since the same flags under the same
  load bring the pressure back: a recommended lower admission cap (`--max-num-active-seqs`,
  vLLM 0.32's cap on requests scheduled at once, below `--max-num-seqs`) where the flags are
  known, else a recommendation to run the tuner. Thrash (the same requests preempted again
  and again) makes the lower cap the first advice; a burst spread over many requests once
  each, or a queue limit already refusing requests, makes it a tuning run for a validated
  larger budget instead, since a lower cap would cost throughput for a passing burst, or
  turn still more requests away.

The ladder decides on the alert's typed facts (`AlertFacts`), which the rule puts on its
condition: the action the rule is configured with (a condition without one is alert-only),
the capacity-leak signature, thrash and admission refusals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.agent.model import Action, AlertFacts
from kvpilot.collectors.secrets import mask_argv
from kvpilot.collectors.vllm_argv import canonical_flags, flag_value, set_flag

LadderStep = Literal[
    "reset_prefix_cache", "restart", "promote", "recommend_tuning", "recommend_config"
]
# Steps that only advise: nothing is restarted.
ADVICE_STEPS: frozenset[tuple[LadderStep, ...]] = frozenset(
    {("recommend_tuning",), ("recommend_config",)}
)
# Rules whose pressure a prefix-cache reset can relieve: it frees cached blocks now, and
# gives the block pool back its order.
LIGHT_STEP_RULES = frozenset({"fragmentation_kv_blocks", "kv_saturation", "preemption_spike"})
BetterConfig = Callable[[str], Sequence[str] | None]
ADMISSION_CAP_FLAG = "--max-num-active-seqs"
# A quarter fewer requests at once: enough to cut preemptions, little enough to keep
# throughput; the judge of a tuning run finds the best value.
ADMISSION_CAP_STEP_RATIO = 0.75


def no_better_config(instance: str) -> Sequence[str] | None:
    """The default before a tuner is wired: it holds nothing validated."""
    return None


@dataclass(frozen=True, slots=True)
class LadderPlan:
    """What to do about one firing alert: the steps in order, and why."""

    rule: str
    action: str
    steps: tuple[LadderStep, ...]
    reason: str
    argv: tuple[str, ...] | None = None  # the flags to promote, or to recommend

    @property
    def restarts(self) -> bool:
        return "restart" in self.steps or "promote" in self.steps

    @property
    def journal_action(self) -> str:
        """What its journal record and audit rows call it: a promotion or a restart."""
        return "promote" if "promote" in self.steps else "restart"


def plan_for(
    rule: str,
    facts: AlertFacts,
    instance: str,
    *,
    light_step_enabled: bool,
    better_config: BetterConfig = no_better_config,
    can_change_flags: bool = True,
    current_argv: Sequence[str] | None = None,
) -> LadderPlan:
    """The ladder for one firing alert of `rule` on `instance` (whose flags now are
    `current_argv`, where known: the plan's reason names what a promotion changes)."""
    action = facts.action
    if action == Action.ALERT:
        return LadderPlan(rule, action, (), f"{rule}: action is alert (notify only)")
    if action == Action.LADDER:
        argv = better_config(instance)
        if argv is not None:
            change = describe_change(current_argv, argv)
            if not can_change_flags:
                return LadderPlan(
                    rule,
                    action,
                    ("recommend_config",),
                    f"the tuner holds a validated better configuration ({change}); this "
                    "runtime cannot change the server's flags: restart it with them",
                    tuple(argv),
                )
            return LadderPlan(
                rule,
                action,
                ("promote",),
                f"the tuner holds a validated better configuration ({change}): promote it",
                tuple(argv),
            )
        if facts.capacity_leak:
            return LadderPlan(
                rule,
                action,
                (*_light(rule, light_step_enabled), "restart"),
                "capacity-leak signature (KV usage high while few requests run): restart "
                "with the same flags",
            )
        why = (
            "no capacity-leak signature"
            if facts.capacity_leak is False
            else "capacity leak unknown"
        )
        larger_budget_first = _larger_budget_first(facts)
        if larger_budget_first is not None:
            return LadderPlan(
                rule,
                action,
                ("recommend_tuning",),
                f"{why}; {larger_budget_first}; a restart with the same flags would bring the "
                "pressure back: recommend a tuning run for a validated larger budget",
            )
        capped = lower_admission_cap(current_argv)
        if capped is not None:
            thrash = (
                "thrash (the same requests preempted again and again: the KV cache is too "
                "small for the admitted batch); "
                if facts.thrash
                else ""
            )
            return LadderPlan(
                rule,
                action,
                ("recommend_config",),
                f"{why}; {thrash}a restart with the same flags would bring the pressure back: "
                f"lower the admission cap ({describe_change(current_argv, capped)}) so fewer "
                "requests share the KV cache, or run the tuner for a validated larger budget",
                capped,
            )
        return LadderPlan(
            rule,
            action,
            ("recommend_tuning",),
            f"{why}; a restart with the same flags would bring the preemptions back: "
            "recommend a tuning run",
        )
    if action == Action.RESTART:
        return LadderPlan(
            rule,
            action,
            (*_light(rule, light_step_enabled), "restart"),
            f"{rule}: action is restart",
        )
    # The configuration admits no other action; should one come anyway, restarting on it
    # would be the unsafe guess.
    return LadderPlan(rule, action, (), f"{rule}: unknown action {action!r}, treated as alert only")


def lower_admission_cap(argv: Sequence[str] | None) -> tuple[str, ...] | None:
    """`argv` with `--max-num-active-seqs` a quarter below the cap in force now (its own
    value, else `--max-num-seqs`); None when neither is on the command line (vLLM's default
    depends on the device) or the cap is already 1."""
    if argv is None:
        return None
    for flag in (ADMISSION_CAP_FLAG, "--max-num-seqs"):
        text = flag_value(argv, flag)
        if text is not None and text.isdigit() and int(text) > 1:
            lower = max(1, int(int(text) * ADMISSION_CAP_STEP_RATIO))
            return set_flag(argv, ADMISSION_CAP_FLAG, min(lower, int(text) - 1))
    return None


def manual_plan(reason: str) -> LadderPlan:
    """An operator's restart: no light step, the same flags."""
    return LadderPlan("manual", "restart", ("restart",), reason)


def describe_change(current: Sequence[str] | None, new: Sequence[str]) -> str:
    """The flags `new` sets differently from `current`, e.g. "--max-num-seqs 32 (was 64)",
    secrets masked; all of `new` when `current` is unknown."""
    if current is None:
        return "flags: " + " ".join(mask_argv(new))
    before = {name: value for name, value in canonical_flags(mask_argv(current))}
    after = {name: value for name, value in canonical_flags(mask_argv(new))}
    parts = [
        f"{name} {value}".rstrip() + (f" (was {before[name] or 'set'})" if name in before else "")
        for name, value in after.items()
        if name and before.get(name) != value
    ]
    parts += [f"{name} removed" for name in before if name and name not in after]
    return ", ".join(parts) or "the same flags"


def _larger_budget_first(facts: AlertFacts) -> str | None:
    """Why a lower admission cap is the wrong first advice for these facts, or None."""
    if facts.admission_refused:
        return "a queue limit already refuses requests, and a lower cap would refuse more"
    if facts.thrash is False:
        return (
            "no thrash (the preemptions were a burst spread over many requests), and a lower "
            "cap would cost throughput for a passing burst"
        )
    return None


def _light(rule: str, enabled: bool) -> tuple[LadderStep, ...]:
    return ("reset_prefix_cache",) if enabled and rule in LIGHT_STEP_RULES else ()
