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

# the controls that work on a built page with no kernel (their states are drawn
# ahead, see Pages); labkit.cli.page_assets leaves them enabled
LIVE_CLASS = "labkit-live"


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


class Pages(W.Stack):
    """A widget's states drawn ahead, one shown at a time: nested W.Stacks, one
    level per control, each level's `selected_index` linked in the browser
    (`jslink`) to its control. So on a static page (the site, a deck) those
    controls switch the figure and its caption with no kernel behind them.

    draw(key) -> (caption html, figure) draws the state at key, a tuple with
    one index per level. In a kernel a state is drawn when first shown;
    `fill()` draws them all (the widget's first state, the one a built page
    keeps) and `forget()` drops them when another control changes them all.
    A drawn state is kept as its picture only: one matplotlib Figure a state
    would hold hundreds of MB for the ring's 31 steps at N = 16."""

    def __init__(self, sizes: tuple[int, ...], draw):
        self.sizes, self._draw_state = tuple(sizes), draw
        self.drawn: set[tuple] = set()
        self._figure: tuple | None = None  # (key, Figure) of the last drawn
        self.leaves: dict[tuple, W.VBox] = {}
        self.links: list[W.Link] = []
        super().__init__(self._build(()), selected_index=0)
        self.key = (0,) * len(self.sizes)

    def _build(self, prefix: tuple) -> list:
        level = len(prefix)
        if level == len(self.sizes) - 1:
            for i in range(self.sizes[level]):
                self.leaves[prefix + (i,)] = W.VBox([W.HTML(), W.Output()])
            return [self.leaves[prefix + (i,)] for i in range(self.sizes[level])]
        return [W.Stack(self._build(prefix + (i,)), selected_index=0)
                for i in range(self.sizes[level])]

    def stacks(self, level: int) -> list[W.Stack]:
        """Every stack at `level` (0: this one)."""
        found = [self]
        for _ in range(level):
            found = [c for s in found for c in s.children]
        return found

    def link(self, level: int, control: W.Widget, trait: str = "value") -> None:
        """The browser shows state control.<trait> at `level`, kernel or not."""
        for s in self.stacks(level):
            self.links.append(W.jslink((control, trait), (s, "selected_index")))

    def show(self, key: tuple) -> None:
        """Select and, if not drawn yet, draw the state at key."""
        key = tuple(key)
        if key not in self.drawn:
            caption, fig = self._draw_state(key)
            html, out = self.leaves[key].children
            html.value = caption
            show_output(out, fig)
            self.drawn.add(key)
            self._figure = (key, fig)
        stack = self
        for i in key:  # what jslink does in a browser, for a kernel on its own
            stack.selected_index = i
            stack = stack.children[i]
        self.key = key

    def fill(self) -> None:
        """Draw every state, the shown one last (it stays shown)."""
        shown = self.key
        for key in self.leaves:
            if key != shown:
                self.show(key)
        self.show(shown)

    def forget(self) -> None:
        """Drop every drawn state: another control has changed them all."""
        for html, out in (leaf.children for leaf in self.leaves.values()):
            html.value, out.outputs = "", ()
        self.drawn.clear()
        self._figure = None

    def close(self) -> None:
        """Close every widget of these pages (their stacks, leaves and links),
        so a kernel lets go of the pages a new N replaced."""
        for link in self.links:
            link.close()
        for leaf in self.leaves.values():
            for w in (*leaf.children, leaf):
                w.close()
        for level in range(len(self.sizes) - 1, -1, -1):
            for s in self.stacks(level):
                W.Stack.close(s)

    @property
    def caption(self) -> W.HTML:
        return self.leaves[self.key].children[0]

    @property
    def figure(self):
        """The chart shown (drawn again if it was drawn before another)."""
        if self.key not in self.drawn:
            return None
        if self._figure is None or self._figure[0] != self.key:
            self._figure = (self.key, self._draw_state(self.key)[1])
        return self._figure[1]


class RingStepper(W.VBox):
    """Step through ring all-reduce on N = world_size ranks (simulated), one
    chunk grid a step. Every step of the first N is drawn ahead, so on a built
    page the step slider works without a kernel; N needs one."""

    def __init__(self, world_size: int = 4, max_world_size: int = 16):
        self.world_size = W.IntSlider(value=world_size, min=2, max=max_world_size,
                                      description="ranks N", continuous_update=False)
        self.step = W.IntSlider(value=0, min=0, max=2 * (world_size - 1),
                                description="step")
        self.step.add_class(LIVE_CLASS)
        self.world_size.observe(self._new_world_size, names="value")
        self.step.observe(self._draw, names="value")
        self.pages = self._pages()
        self.pages.fill()
        super().__init__([W.HBox([self.world_size, self.step]), self.pages])

    def _pages(self) -> Pages:
        n = self.world_size.value
        steps = self._steps = ring_steps(n)
        pages = Pages((len(steps),), lambda key: self._state(n, steps, key[0]))
        pages.link(0, self.step)
        pages.show((self.step.value,))
        return pages

    @property
    def info(self) -> W.HTML:
        return self.pages.caption

    @property
    def last(self):
        """The RingStep shown."""
        return self._steps[self.pages.key[0]]

    def _new_world_size(self, change=None) -> None:
        self.step.max = 2 * (self.world_size.value - 1)
        self.step.value = min(self.step.value, self.step.max)
        old, self.pages = self.pages, self._pages()
        self.children = [self.children[0], self.pages]
        old.close()

    def _draw(self, change=None) -> None:
        if self.step.value < len(self.pages.leaves):  # not while N shrinks
            self.pages.show((self.step.value,))

    @staticmethod
    def _state(n: int, steps, k: int):
        chunks = "chunk" if k == 1 else "chunks"
        caption = (f"after step {k} of {2 * (n - 1)}: each rank has sent {k} "
                   f"{chunks} of M/{n} = {k / n:.3g}·M (the whole run: "
                   f"2(N-1)/N·M = {2 * (n - 1) / n:.3g}·M)")
        return caption, ring_grid(steps[k])


def ring_stepper(world_size: int = 4) -> RingStepper:
    """A widget stepping through the N x N chunk grid of ring all-reduce on
    N = world_size ranks."""
    return RingStepper(world_size)


# ------------------------------------------------------------------ ZeRO explorer


_POWERS_OF_TWO = [2**i for i in range(0, 11)]
DEVICE_MEMORY = 80 * GB  # an H100's HBM, the dashed line


def _gb(nbytes: float) -> str:
    v = nbytes / GB
    return f"{v:,.2f}" if v >= 1 else f"{v:.3g}"


def _params_text(psi: float) -> str:
    return f"{psi / 1e9:,.3g} billion" if psi >= 1e9 else f"{psi / 1e6:,.3g} million"


PRECISIONS = [("bf16 + fp32 master", "mixed"), ("fp32", "fp32")]
STAGES = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


class ZeroExplorer(W.VBox):
    """Per-device model states for DP and ZeRO-1/2/3 side by side.

    Picking a model sets the Ψ slider to its parameter count; moving the slider
    away from it makes the model "custom". N (dp_size, the data-parallel degree)
    takes any whole number (the smallest N that fits is rarely a power of two),
    typed or slid. Every stage and precision of the first Ψ, N and K is drawn
    ahead, so on a built page those two controls work without a kernel."""

    def __init__(self, model: str = "custom", params: float = 7.5e9,
                 dp_size: int = 64, k: int = 12, stage: int = 3,
                 precision: str = "mixed"):
        self.model = W.Dropdown(options=["custom", *theory.MODELS], value="custom",
                                description="model")
        self.params = W.FloatLogSlider(value=params, base=10, min=8, max=12,
                                       step=0.05, description="Ψ (params)",
                                       continuous_update=False, readout_format=".3g")
        self.dp_size = W.IntSlider(value=dp_size, min=1, max=1024,
                                   description="devices N", continuous_update=False)
        self.k = W.IntSlider(value=k, min=0, max=20, description="K (bytes)",
                             continuous_update=False)
        self.stage = W.IntSlider(value=stage, min=0, max=3, description="stage",
                                 continuous_update=False)
        self.precision = W.Dropdown(options=PRECISIONS, value=precision,
                                    description="precision")
        for live in (self.stage, self.precision):
            live.add_class(LIVE_CLASS)
        self.pages = Pages((len(PRECISIONS), len(STAGES)), self._state)
        self.pages.link(0, self.precision, "index")
        self.pages.link(1, self.stage)
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        self.params.observe(self._on_params, names="value")
        for w in (self.dp_size, self.k):
            w.observe(self._redraw, names="value")
        for w in (self.stage, self.precision):
            w.observe(self._draw, names="value")
        super().__init__([W.HBox([self.model, self.precision]),
                          W.HBox([self.params, self.dp_size]),
                          W.HBox([self.k, self.stage]),
                          self.pages])
        if model != "custom":
            self.model.value = model  # sets Ψ and draws
        self._draw()
        self.pages.fill()

    def psi(self) -> float:
        if self.model.value == "custom":
            return self.params.value
        return float(theory.param_count(self.model.value))

    @property
    def info(self) -> W.HTML:
        return self.pages.caption

    @property
    def figure(self):
        """The chart shown."""
        return self.pages.figure

    @property
    def last(self) -> dict[str, theory.ZeroMemory]:
        """Each stage's model states at the precision shown."""
        return self._breakdowns(self.precision.index)

    def _breakdowns(self, precision: int) -> dict[str, theory.ZeroMemory]:
        b = 2 if PRECISIONS[precision][1] == "mixed" else 4
        return {lab: theory.zero_breakdown(self.psi(), self.dp_size.value, s,
                                           self.k.value, param_bytes=b,
                                           grad_bytes=b)
                for s, lab in enumerate(STAGES)}

    def _on_model(self, change=None) -> None:
        if self.model.value != "custom":
            self._syncing = True  # the slider follows the model: one draw, not two
            try:
                self.params.value = self.psi()
            finally:
                self._syncing = False
        self._redraw()

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
        self._redraw()

    def _redraw(self, change=None) -> None:
        """Ψ, N or K moved: every drawn state is out of date."""
        self.pages.forget()
        self._draw()

    def _draw(self, change=None) -> None:
        self.pages.show((self.precision.index, self.stage.value))

    def _state(self, key: tuple[int, int]):
        precision, stage = key
        psi, n = self.psi(), self.dp_size.value
        last = self._breakdowns(precision)
        chosen = STAGES[stage]
        mine = last[chosen].total
        b = 2 if PRECISIONS[precision][1] == "mixed" else 4
        traffic = sum(theory.zero_traffic(psi, n, stage, b).values())
        fits = "fits" if mine <= DEVICE_MEMORY else "does not fit"
        caption = (
            f"Ψ = {_params_text(psi)} parameters on N = {n}: {chosen} keeps "
            f"<b>{_gb(mine)} GB</b> of model state per device, which {fits} in "
            f"an {DEVICE_MEMORY / GB:,.0f} GB device (DP: "
            f"{_gb(last['DP'].total)} GB), and sends {_gb(traffic)} GB per step.")
        return caption, zero_bars(last, highlight=chosen, capacity=DEVICE_MEMORY)


def zero_explorer(**kw) -> ZeroExplorer:
    """Sliders for Ψ (or a model), N (dp_size), K, stage and precision -> ZeRO's
    bars."""
    return ZeroExplorer(**kw)


# ------------------------------------------------------------- placement explorer


class PlacementExplorer(W.VBox):
    """Pick a mode for each of P, O, G, A: memory, traffic, and the verdict."""

    def __init__(self, preset: str = "ZeRO-3", params: float = 7.5e9,
                 dp_size: int = 64, activations: float = 8e9):
        self.preset = W.Dropdown(options=["custom", *theory.PLACEMENTS], value=preset,
                                 description="preset")
        self.modes = {s: W.Dropdown(options=theory.MODES, description=s,
                                    layout=W.Layout(width="260px")) for s in "POGA"}
        self.params = W.FloatLogSlider(value=params, base=10, min=8, max=12,
                                       step=0.05, description="Ψ (params)",
                                       continuous_update=False, readout_format=".3g")
        self.dp_size = W.SelectionSlider(options=_POWERS_OF_TWO, value=dp_size,
                                         description="devices N",
                                         continuous_update=False)
        self.activations = activations
        self.verdict = W.HTML()
        self.out = W.Output()
        self.last = None  # (Placement, PlacementCost, Verdict)
        self._applying = False
        self._apply_preset()
        self.preset.observe(self._on_preset, names="value")
        for w in (*self.modes.values(), self.params, self.dp_size):
            w.observe(self._draw, names="value")
        super().__init__([W.HBox([self.preset, self.params, self.dp_size]),
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
        cost = p.cost(self.params.value, self.dp_size.value,
                      activations=self.activations, gather_fraction=1 / 32)
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
