"""How every kernel in this package picks its implementation: ``auto``, a named one, or the reference.

A kernel declares one `Dispatch`: its implementations in auto's order of preference, the reference last, each
with a predicate that says for one call why it cannot run here ("" when it can: its package imports, the
tensors are on its device, the shapes fit). ``resolve(impl, x=tensor, **call)`` returns the name to run:

- ``"auto"`` (replaced by the kernel's environment variable when that is set): the first implementation that
  can run, so auto comes down to the reference when nothing else is available;
- a named implementation: that one when it can run, else a one-line `KernelChoiceError` saying what it needs
  and which implementations can run here. A dispatch with ``strict=False`` (attention, whose
  ``ARCHSCALE_ATTN_IMPL`` is a preference) runs the reference instead;
- an implementation that can run but does not take a call's arguments (mamba-ssm's scan has no initial state)
  ``steps_aside`` to ``instead``: a routing rule of that kernel, not an error.

The predicates read their module's globals at call time, so a test can monkeypatch an optional kernel in or
out. ``x`` is the tensor whose device decides (the kernel's first input); the other keywords are the kernel's
own (``d_state``, ``initial_state``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from archscale.errors import UserError


class KernelChoiceError(UserError, ValueError):
    """An unknown or unavailable implementation was asked for (by argument or environment variable): one line
    (exit 2 from the CLI), and a ValueError too, as the kernels' other argument checks are."""


def runs_anywhere(**call) -> str:
    return ""


def never(**call) -> bool:
    return False


@dataclass(frozen=True)
class Impl:
    name: str
    unavailable: Callable[..., str] = runs_anywhere  # why it cannot run this call here; "" when it can
    in_auto: Callable[..., bool] | None = None       # auto considers it only when this holds (None: always)
    steps_aside: Callable[..., bool] = never         # calls it does not take ...
    instead: str = ""                                # ... run this implementation instead


def cuda_impl(name: str, loaded: Callable[[], object], package: str, **kw) -> Impl:
    """An implementation from an optional CUDA package: runs when `x` is on CUDA and `loaded()` (the package's
    function, None when it does not import) is there."""

    def unavailable(x, **_) -> str:
        return "" if x.is_cuda and loaded() is not None else f"needs the {package} package and CUDA tensors"

    return Impl(name, unavailable, **kw)


@dataclass(frozen=True)
class Dispatch:
    kernel: str                  # its name in messages, e.g. "selective_scan"
    impls: tuple[Impl, ...]      # auto's order of preference; the last is the reference (it runs anywhere)
    env_var: str = ""            # when set, replaces impl="auto" (an explicit name is never overridden)
    aliases: Mapping[str, str] = field(default_factory=dict)  # names taken for a sibling kernel's sake -> ours
    strict: bool = True          # a named implementation that cannot run is an error (else: the reference)

    @property
    def reference(self) -> str:
        return self.impls[-1].name

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *(i.name for i in self.impls), *self.aliases)

    def available(self, **call) -> list[str]:
        """The implementations that can run this call here, in auto's order."""
        return [i.name for i in self.impls if not i.unavailable(**call)]

    def resolve(self, impl: str = "auto", **call) -> str:
        source = ""
        if impl == "auto" and self.env_var:
            forced = os.environ.get(self.env_var, "").strip()
            if forced:
                impl, source = forced, f" (from {self.env_var})"
        if impl not in self.choices:
            what = (f"{self.env_var}={impl!r} is not an implementation of {self.kernel}" if source
                    else f"{self.kernel}: unknown impl {impl!r}")
            raise KernelChoiceError(f"{what}; choose one of {', '.join(self.choices)}")
        impl = self.aliases.get(impl, impl)
        chosen = self._auto(call) if impl == "auto" else self._named(impl, source, call)
        return chosen.instead if chosen.steps_aside(**call) else chosen.name

    def _auto(self, call: dict) -> Impl:
        for i in self.impls:
            if (i.in_auto is None or i.in_auto(**call)) and not i.unavailable(**call):
                return i
        return self.impls[-1]

    def _named(self, name: str, source: str, call: dict) -> Impl:
        impl = next(i for i in self.impls if i.name == name)
        why = impl.unavailable(**call)
        if not why:
            return impl
        if not self.strict:
            return self.impls[-1]
        here = [n for n in self.available(**call) if n != name]
        raise KernelChoiceError(f"{self.kernel}: impl={name!r}{source} {why}; "
                                f"available here: {', '.join(here)} (or 'auto')")
