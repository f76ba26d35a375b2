"""What both ledgers share: the phase rule, `phase()`, the one-ledger-per-kind
guard and pickling (only the data travels back from a rank, never the hooks)."""

from __future__ import annotations

import contextlib

from labkit import probe
from labkit.probe import in_backward


def current_phase(explicit: list[str], in_optimizer: bool, in_forward: bool) -> str:
    """A label set with `ledger.phase(...)` wins; then the optimizer step, the
    backward pass (autograd is running a graph task), a module's forward, "other"."""
    if explicit:
        return explicit[-1]
    if in_optimizer:
        return "optimizer"
    if in_backward():
        return "backward"
    return "forward" if in_forward else "other"


def recording(kind: str) -> Ledger | None:
    """The ledger of this kind recording in this process, if one is."""
    return probe.listening(kind)


class Ledger:
    """Base of both ledgers. Subclasses set `kind` and `fields` (what pickles)."""

    kind = "ledger"
    fields: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self._phases: list[str] = []
        self._module_stack: list[str] = []  # names of the modules running forward
        self._in_optimizer = 0
        self._hook_handles: list = []

    def _current_phase(self) -> str:
        return current_phase(self._phases, bool(self._in_optimizer),
                             bool(self._module_stack))

    def _install_phase_hooks(self, names: dict[int, str] | None = None) -> None:
        """Global module and optimizer hooks that tell forward, optimizer and other
        apart (names: id(module) -> the name to record, else its class name)."""
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        names = names or {}

        def pre(mod, args):
            self._module_stack.append(names.get(id(mod), type(mod).__name__))

        def post(mod, args, out):
            if self._module_stack:
                self._module_stack.pop()

        def opt_pre(opt, args, kwargs):
            self._in_optimizer += 1

        def opt_post(opt, args, kwargs):
            self._in_optimizer -= 1

        self._hook_handles = [
            nn_module.register_module_forward_pre_hook(pre),
            nn_module.register_module_forward_hook(post, always_call=True),
            optim.register_optimizer_step_pre_hook(opt_pre),
            optim.register_optimizer_step_post_hook(opt_post),
        ]

    def _remove_phase_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label what happens inside this block (overrides forward/backward/...)."""
        self._phases.append(str(name))
        self._phase_entered()
        try:
            yield self
        finally:
            self._phases.pop()

    def _phase_entered(self) -> None:
        """Called when a `phase()` block opens (the memory ledger observes there)."""

    def _claim(self) -> None:
        """Listen to labkit.probe: one recording ledger of each kind per process
        (nesting is refused)."""
        probe.listen(self.kind, self)

    def _release(self) -> None:
        probe.stop_listening(self.kind, self)

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.fields}

    def __setstate__(self, state):
        self.__init__()
        self.__dict__.update(state)
