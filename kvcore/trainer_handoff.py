"""Sending a Trainer's gradients from PyTorch's gradient hooks, as soon as backprop produced them.

DDP overlaps its allreduce with the backward pass: a bucket of gradients leaves as soon as every
gradient in it exists. ``HandOff`` does the same for ``kvcore.Trainer``: each parameter's hook
(``torch_adapter.watch_gradients``) marks its gradient ready, and once a group of the Trainer's
(``Trainer._groups``, the same groups every step) is complete it is sent at once
(``send``, the Trainer's: summed through the collectives, or pushed to the store); ``step`` sends
what is left and waits.

Runs on the thread that runs backward (PyTorch's hooks); an error is kept and raised at ``step``,
never inside PyTorch's backward.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["HandOff"]


class HandOff:
    """Sends a group's gradients from PyTorch's gradient hooks, as soon as backprop produced them all.

    Armed after the first step (keys initialised, optimizer set); each step takes what was sent
    (``take``) and arms it again. A gradient produced twice in one step (two backward passes) is
    refused at the next ``step``: it may have been sent half-summed.
    """

    def __init__(self, params: Sequence[Any], groups: Sequence[tuple[Sequence[int], int]],
                 send: Callable[[int], Any]) -> None:
        """``params``: the Trainer's Parameters; ``groups``: ``(parameter indices, priority)`` per
        group; ``send(g)``: send group ``g``, returning its handle (None when a gradient is missing
        after all: ``step`` then sends the group and names it)."""
        self.params = params
        self.groups = groups
        self.group_of = {i: g for g, (indices, _) in enumerate(groups) for i in indices}
        self.send = send
        self.armed = False
        self.watched = False
        self.sent: dict[int, Any] = {}
        self.seen: set[int] = set()
        self.left = [len(indices) for indices, _ in groups]
        self.error: BaseException | None = None
        self.twice: str | None = None

    def arm(self) -> None:
        """Start a step: hooks send groups from now on."""
        if not self.watched:
            sources = [p.source for p in self.params]
            if not any(s is not None for s in sources):
                return
            from .torch_adapter import watch_gradients

            watch_gradients(sources, self.ready)
            self.watched = True
        self.sent = {}
        self.seen = set()
        self.left = [len(indices) for indices, _ in self.groups]
        self.armed = True

    def ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is complete (a hook, on the thread that runs backward)."""
        if not self.armed:
            return
        if i in self.seen:
            self.twice = self.params[i].name
            return
        self.seen.add(i)
        g = self.group_of[i]
        self.left[g] -= 1
        if self.left[g] or self.error is not None:
            return
        try:
            handle = self.send(g)
            if handle is not None:  # else a gradient is missing after all: step sends the group (and names it)
                self.sent[g] = handle
        except Exception as exc:  # raised at step(), not inside PyTorch's backward
            self.error = exc

    def take(self, explicit: bool) -> dict[int, Any]:
        """What the hooks sent this step (disarmed until ``arm``).

        Raises:
            ValueError: gradients were sent and ``step`` was given others, or a gradient came twice.
        """
        sent, self.armed = self.sent, False
        self.sent = {}
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.twice is not None:
            name, self.twice = self.twice, None
            raise ValueError(
                f"parameter {name!r} got a gradient twice before step() (two backward passes), but its group "
                "was already sent after the first; create the Trainer with overlap=False to accumulate gradients")
        if sent and explicit:
            raise ValueError("step() was given gradients, but the parameters' own were already sent as backprop "
                             "produced them; call step() without grads, or create the Trainer with overlap=False")
        return sent
