"""Widgets: ipywidgets that only bind controls to plots and theory.

Each returns an ipywidgets container; its controls are attributes, so a test (or a
lecturer's script) can set `.value` and read what was drawn (`.last`).
"""

from __future__ import annotations

import base64

import ipywidgets as W
from IPython.core.interactiveshell import InteractiveShell

from labkit import theory
from labkit.comm import ring_steps
from labkit.units import GB
from labkit.viz.diagrams import ring_grid
from labkit.viz.theory_charts import placement_bars, zero_bars


def show_output(out: W.Output, obj) -> None:
    """Make `obj` the one output of `out`, set as widget state in the kernel: no
    display message for a front end to route back into the widget (nbclient's
    Output mimic answers those on the shell socket mid-cell and then misses the
    cell's execute_reply until its timeout: jupyter/nbclient#312)."""
    data, metadata = InteractiveShell.instance().display_formatter.format(obj)
    data = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
            for k, v in data.items()}  # as on iopub; raw bytes would go as buffers
    out.outputs = ({"output_type": "display_data", "data": data,
                    "metadata": metadata},)


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
        chunks = "chunk" if self.step.value == 1 else "chunks"
        self.info.value = (f"after step {self.step.value} of {2 * (n - 1)}: each rank "
                           f"has sent {self.step.value} {chunks} of M/{n} = "
                           f"{sent:.3g}·M (the whole run: 2(N-1)/N·M = "
                           f"{2 * (n - 1) / n:.3g}·M)")
        show_output(self.out, ring_grid(st))


def ring_stepper(n: int = 4) -> RingStepper:
    """A widget stepping through the N x N chunk grid of ring all-reduce."""
    return RingStepper(n)


# ------------------------------------------------------------------ ZeRO explorer


_POWERS_OF_TWO = [2**i for i in range(0, 11)]
DEVICE_MEMORY = 80 * GB  # an H100's HBM, the dashed line


def _gb(nbytes: float) -> str:
    v = nbytes / GB
    return f"{v:,.2f}" if v >= 1 else f"{v:.3g}"


def _params_text(psi: float) -> str:
    return f"{psi / 1e9:,.3g} billion" if psi >= 1e9 else f"{psi / 1e6:,.3g} million"


class ZeroExplorer(W.VBox):
    """Per-device model states for DP and ZeRO-1/2/3 side by side.

    Picking a model sets the Ψ slider to its parameter count; moving the slider
    away from it makes the model "custom". N takes any whole number (the smallest N
    that fits is rarely a power of two), typed or slid."""

    def __init__(self, model: str = "custom", params: float = 7.5e9, n: int = 64,
                 k: int = 12, stage: int = 3, precision: str = "mixed"):
        self.model = W.Dropdown(options=["custom", *theory.MODELS], value="custom",
                                description="model")
        self.params = W.FloatLogSlider(value=params, base=10, min=8, max=12,
                                       step=0.05, description="Ψ (params)",
                                       continuous_update=False, readout_format=".3g")
        self.n = W.IntSlider(value=n, min=1, max=1024, description="devices N",
                             continuous_update=False)
        self.k = W.IntSlider(value=k, min=0, max=20, description="K (bytes)",
                             continuous_update=False)
        self.stage = W.IntSlider(value=stage, min=0, max=3, description="stage",
                                 continuous_update=False)
        self.precision = W.Dropdown(options=[("bf16 + fp32 master", "mixed"),
                                             ("fp32", "fp32")], value=precision,
                                    description="precision")
        self.info = W.HTML()
        self.out = W.Output()
        self.last: dict[str, theory.ZeroMemory] = {}
        self.figure = None  # the chart drawn last
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        self.params.observe(self._on_params, names="value")
        for w in (self.n, self.k, self.stage, self.precision):
            w.observe(self._draw, names="value")
        super().__init__([W.HBox([self.model, self.precision]),
                          W.HBox([self.params, self.n]), W.HBox([self.k, self.stage]),
                          self.info, self.out])
        if model != "custom":
            self.model.value = model  # sets Ψ and draws
        else:
            self._draw()

    def psi(self) -> float:
        if self.model.value == "custom":
            return self.params.value
        return float(theory.param_count(self.model.value))

    def _on_model(self, change=None) -> None:
        if self.model.value != "custom":
            self._syncing = True  # the slider follows the model: one draw, not two
            try:
                self.params.value = self.psi()
            finally:
                self._syncing = False
        self._draw()

    def _on_params(self, change=None) -> None:
        if self._syncing:
            return
        # a value typed into the readout (7e10 for a 70.6e9 model: 0.8 % off) or
        # a slider step (12 %) is the student's own Ψ; only float noise is not
        if self.model.value != "custom" and abs(self.params.value / self.psi()
                                                 - 1) > 1e-9:
            self.model.unobserve(self._on_model, names="value")
            self.model.value = "custom"  # a hand-picked Ψ is no longer that model
            self.model.observe(self._on_model, names="value")
        self._draw()

    def _draw(self, change=None) -> None:
        psi, n, k = self.psi(), self.n.value, self.k.value
        b = 2 if self.precision.value == "mixed" else 4
        labels = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
        self.last = {lab: theory.zero_breakdown(psi, n, s, k, param_bytes=b,
                                                grad_bytes=b)
                     for s, lab in enumerate(labels)}
        chosen = labels[self.stage.value]
        mine = self.last[chosen].total
        traffic = sum(theory.zero_traffic(psi, n, self.stage.value, b).values())
        fits = "fits" if mine <= DEVICE_MEMORY else "does not fit"
        self.info.value = (
            f"Ψ = {_params_text(psi)} parameters on N = {n}: {chosen} keeps "
            f"<b>{_gb(mine)} GB</b> of model state per device, which {fits} in "
            f"an {DEVICE_MEMORY / GB:,.0f} GB device (DP: "
            f"{_gb(self.last['DP'].total)} GB), and sends {_gb(traffic)} GB per step.")
        self.figure = zero_bars(self.last, highlight=chosen, capacity=DEVICE_MEMORY)
        show_output(self.out, self.figure)


def zero_explorer(**kw) -> ZeroExplorer:
    """Sliders for Ψ (or a model), N, K, stage and precision -> ZeRO's bars."""
    return ZeroExplorer(**kw)


# ------------------------------------------------------------- placement explorer


class PlacementExplorer(W.VBox):
    """Pick a mode for each of P, O, G, A: memory, traffic, and the verdict."""

    def __init__(self, preset: str = "ZeRO-3", params: float = 7.5e9, n: int = 64,
                 activations: float = 8e9):
        self.preset = W.Dropdown(options=["custom", *theory.PLACEMENTS], value=preset,
                                 description="preset")
        self.modes = {s: W.Dropdown(options=theory.MODES, description=s,
                                    layout=W.Layout(width="260px")) for s in "POGA"}
        self.params = W.FloatLogSlider(value=params, base=10, min=8, max=12,
                                       step=0.05, description="Ψ (params)",
                                       continuous_update=False, readout_format=".3g")
        self.n = W.SelectionSlider(options=_POWERS_OF_TWO, value=n,
                                   description="devices N", continuous_update=False)
        self.activations = activations
        self.verdict = W.HTML()
        self.out = W.Output()
        self.last = None  # (Placement, PlacementCost, Verdict)
        self._applying = False
        self._apply_preset()
        self.preset.observe(self._on_preset, names="value")
        for w in (*self.modes.values(), self.params, self.n):
            w.observe(self._draw, names="value")
        super().__init__([W.HBox([self.preset, self.params, self.n]),
                          W.HBox(list(self.modes.values())[:2]),
                          W.HBox(list(self.modes.values())[2:]), self.verdict,
                          self.out])
        self._draw()

    def _apply_preset(self) -> None:
        if self.preset.value == "custom":
            return
        p = theory.PLACEMENTS[self.preset.value]
        self._applying = True
        for s in "POGA":
            self.modes[s].value = getattr(p, s)
        self._applying = False

    def _on_preset(self, change=None) -> None:
        self._apply_preset()
        self._draw()

    def placement(self) -> theory.Placement:
        return theory.Placement(*(self.modes[s].value for s in "POGA"))

    def _draw(self, change=None) -> None:
        if self._applying:
            return
        if change is not None and change["owner"] in self.modes.values():
            match = [k for k, p in theory.PLACEMENTS.items()
                     if all(getattr(p, s) == self.modes[s].value for s in "POGA")]
            self.preset.unobserve(self._on_preset, names="value")
            self.preset.value = match[0] if match else "custom"
            self.preset.observe(self._on_preset, names="value")
        p = self.placement()
        cost = p.cost(self.params.value, self.n.value, activations=self.activations,
                      gather_fraction=1 / 32)
        verdict = p.check()
        self.last = (p, cost, verdict)
        rows = "".join(f"<li>{k}: {v / GB:,.2f} GB</li>" for k, v in
                       cost.traffic.items()) or "<li>none</li>"
        color = "green" if verdict.ok else "crimson"
        problems = "".join(f"<li>{x}</li>" for x in verdict.problems)
        self.verdict.value = (
            f"<b style='color:{color}'>{'correct' if verdict.ok else 'incorrect'}"
            f"</b><ul>{problems}</ul>traffic per device per step "
            f"({cost.traffic_total / GB:,.2f} GB):<ul>{rows}</ul>"
            + (f"PCIe to host: {cost.pcie / GB:,.2f} GB per step" if cost.pcie else ""))
        show_output(self.out, placement_bars(cost))


def placement_explorer(**kw) -> PlacementExplorer:
    """Dropdowns for the modes of P, O, G, A -> memory, traffic and the verdict."""
    return PlacementExplorer(**kw)
