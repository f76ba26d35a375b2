"""Widgets: ipywidgets that only bind controls to plots and theory.

Each returns an ipywidgets container; its controls are attributes, so a test (or a
lecturer's script) can set `.value` and read what was drawn (`.last`).
"""

from __future__ import annotations

import ipywidgets as W
from IPython.display import display

from labkit import plots
from labkit.collectives import ring_steps


class RingStepper(W.VBox):
    """Step through ring all-reduce on N ranks (simulated), one chunk grid a step."""

    def __init__(self, n: int = 4, max_n: int = 16):
        self.n = W.IntSlider(value=n, min=2, max=max_n, description="ranks N",
                             continuous_update=False)
        self.step = W.IntSlider(value=0, min=0, max=2 * (n - 1), description="step")
        self.info = W.HTML()
        self.out = W.Output()
        self.last = None  # the RingStep drawn last
        self._steps = ring_steps(n)
        self.n.observe(self._new_n, names="value")
        self.step.observe(self._draw, names="value")
        super().__init__([W.HBox([self.n, self.step]), self.info, self.out])
        self._draw()

    def _new_n(self, change=None) -> None:
        self._steps = ring_steps(self.n.value)
        self.step.max = 2 * (self.n.value - 1)
        self.step.value = min(self.step.value, self.step.max)
        self._draw()

    def _draw(self, change=None) -> None:
        st = self._steps[self.step.value]
        self.last = st
        n = self.n.value
        sent = self.step.value * 1.0 / n
        self.info.value = (f"after step {self.step.value} of {2 * (n - 1)}: each rank "
                           f"has sent {self.step.value} chunks of M/{n} = "
                           f"{sent:.3g}·M (the whole run: 2(N-1)/N·M = "
                           f"{2 * (n - 1) / n:.3g}·M)")
        self.out.clear_output(wait=True)
        with self.out:
            display(plots.ring_grid(st))


def ring_stepper(n: int = 4) -> RingStepper:
    """A widget stepping through the N x N chunk grid of ring all-reduce."""
    return RingStepper(n)
