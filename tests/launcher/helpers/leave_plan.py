"""``$LEAVE`` as the elastic test helpers read it: comma-separated ``rank:step`` items (that worker
sends itself SIGTERM after the pulls of that step) or ``rank:+n`` (after the pulls of its n-th step,
counted from the step it started at: a joiner then leaves after as many steps however late it joined,
where a step named outright may have passed before a slow machine let it join)."""

import os


def leave_step(rank: int, first_step: int) -> int | None:
    """The step after whose pulls the worker of ``rank`` that starts at ``first_step`` leaves, or None."""
    for item in os.environ.get("LEAVE", "").split(","):
        if not item:
            continue
        who, _, when = item.partition(":")
        if int(who) == rank:
            return first_step + int(when[1:]) - 1 if when.startswith("+") else int(when)
    return None
