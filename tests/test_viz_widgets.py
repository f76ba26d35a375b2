"""labkit.viz.widgets, headless: set a control's value, read back what was drawn."""

import ipywidgets as W
import pytest

from labkit import theory, viz
from labkit.viz import widgets
from labkit.viz.widgets import LIVE_CLASS


def test_ring_stepper_headless():
    w = viz.ring_stepper(4)
    assert w.step.max == 6 and w.last.phase == "start"
    w.step.value = 3
    assert (w.last.phase, w.last.step) == ("reduce-scatter", 3)
    assert "0.75·M" in w.info.value
    w.world_size.value = 16
    assert w.step.max == 30
    w.step.value = 30
    assert (w.last.phase, w.last.step) == ("all-gather", 15)
    assert len(w.last.holds) == 16


def _gb_bars(fig):
    # stacked params + grads + optimizer per column, in GB
    ax = fig.axes[0]
    parts = [[p.get_height() for p in c.patches] for c in ax.containers]
    return [sum(col) for col in zip(*parts)]


def test_zero_explorer_headless():
    w = viz.zero_explorer()
    assert [round(v.total / 1e9, 1) for v in w.last.values()] == [120.0, 31.4, 16.6,
                                                                   1.9]
    w.dp_size.value = 8
    assert w.last["ZeRO-3"].total == pytest.approx(16 * 7.5e9 / 8)
    w.model.value = "llama3-8b"
    assert w.psi() == 8_030_261_248
    assert w.last["DP"].total == pytest.approx(16 * 8_030_261_248)
    w.stage.value = 1
    assert "ZeRO-1 keeps" in w.info.value


def test_zero_explorer_follows_precision_and_k():
    # Ψ = 7.5e9 on N = 64. fp32 params and grads (4 + 4) with K = 12: DP 20Ψ = 150
    # GB; ZeRO-1 8Ψ + 12Ψ/64 = 61.40625; ZeRO-2 4Ψ + 16Ψ/64 = 31.875; ZeRO-3 20Ψ/64
    w = viz.zero_explorer()
    w.precision.value = "fp32"
    assert _gb_bars(w.figure) == pytest.approx([150.0, 61.40625, 31.875, 2.34375])
    assert [v.total for v in w.last.values()] == pytest.approx(
        [theory.zero_memory(7.5e9, 64, s, 12, param_bytes=4, grad_bytes=4)
         for s in range(4)])
    # ZeRO-3 sends 3 * 63/64 * Ψ elements of 4 bytes: 88.59 GB
    assert "<b>2.34 GB</b>" in w.info.value and "sends 88.59 GB" in w.info.value
    # fp32 Adam (K = 8): the 16 bytes per parameter of bytes_per_param("adam", "fp32")
    w.k.value = 8
    assert _gb_bars(w.figure) == pytest.approx([120.0, 60.9375, 31.40625, 1.875])
    # back to bf16 (2 + 2) with K = 8: 12Ψ = 90 GB for DP; traffic halves to 44.30 GB
    w.precision.value = "mixed"
    assert _gb_bars(w.figure) == pytest.approx([90.0, 30.9375, 16.171875, 1.40625])
    assert w.last["DP"].total == pytest.approx(90e9)
    assert "<b>1.41 GB</b>" in w.info.value and "sends 44.30 GB" in w.info.value


def test_placement_explorer_headless():
    w = viz.placement_explorer(preset="ZeRO-3")
    p, cost, verdict = w.last
    assert verdict.ok and p.P == "ShardedWithGather"
    w.modes["P"].value = "Replicated"  # now it is ZeRO-2, and says so
    assert w.preset.value == "ZeRO-2" and w.last[2].ok
    w.modes["O"].value = "Replicated"  # replicated optimizer, sharded gradients
    assert w.preset.value == "custom" and not w.last[2].ok
    assert "incorrect" in w.verdict.value
    w.preset.value = "DP"
    assert w.last[0].O == "Replicated" and w.last[2].ok
    assert w.last[1].traffic_total == pytest.approx(2 * 63 / 64 * 7.5e9 * 2)


def test_zero_explorer_model_sets_psi_and_text_and_chart_agree():
    w = viz.zero_explorer(dp_size=8, stage=3)
    w.model.value = "gpt2-small"
    psi = theory.param_count("gpt2-small")                    # 124,439,808
    assert w.params.value == psi and w.psi() == psi           # the slider follows
    assert "Ψ = 124 million parameters on N = 8" in w.info.value
    ax = w.figure.axes[0]
    bars = _gb_bars(w.figure)
    assert bars == pytest.approx([16 * psi / 1e9, (4 + 12 / 8) * psi / 1e9,
                                  (2 + 14 / 8) * psi / 1e9, 16 * psi / 8 / 1e9])
    assert bars == pytest.approx([v.total / 1e9 for v in w.last.values()])
    assert f"<b>{16 * psi / 8 / 1e9:.3g} GB</b>" in w.info.value    # 0.249 GB
    assert max(bars) <= ax.get_ylim()[1] <= 1.2 * max(bars)  # 2 GB bars fill it
    # a hand-moved slider is no longer GPT-2: the dropdown says custom
    w.params.value = 1e10
    assert w.model.value == "custom" and w.psi() == 1e10
    assert "Ψ = 10 billion" in w.info.value
    assert _gb_bars(w.figure)[0] == pytest.approx(160.0)
    # and picking a model again moves the slider back
    w.model.value = "llama3-70b"
    assert w.params.value == theory.param_count("llama3-70b")
    # float noise from the front end keeps the model ...
    w.params.value = (1 + 1e-12) * theory.param_count("llama3-70b")
    assert w.model.value == "llama3-70b"
    assert w.psi() == theory.param_count("llama3-70b")
    # ... but a Ψ typed into the readout, even 0.8 % off the model's, is the
    # student's: 04's exercise types 7e10 with llama3-70b (70.6e9) selected
    w.dp_size.value, w.stage.value, w.precision.value = 14, 3, "mixed"
    w.params.value = 7e10
    assert w.model.value == "custom" and w.psi() == 7e10
    assert "<b>80.00 GB</b>" in w.info.value and "which fits" in w.info.value


def test_zero_explorer_finds_n_that_is_not_a_power_of_two():
    w = viz.zero_explorer(params=70e9, stage=3, dp_size=13)
    assert "does not fit in an 80 GB device" in w.info.value
    w.dp_size.value = 14                                       # 16 * 70e9 / 14 = 80e9
    assert w.last["ZeRO-3"].total == 80e9
    assert "<b>80.00 GB</b>" in w.info.value and "which fits" in w.info.value
    w.model.value = "llama3-70b"
    assert "does not fit" in w.info.value
    w.dp_size.value = 15
    assert "which fits" in w.info.value


def test_zero_explorer_starts_from_a_model():
    w = viz.zero_explorer(model="llama3-8b", dp_size=8)
    assert w.model.value == "llama3-8b"
    assert w.params.value == theory.param_count("llama3-8b")
    assert w.last["DP"].total == pytest.approx(16 * theory.param_count("llama3-8b"))


def test_ring_stepper_says_one_chunk():
    w = viz.ring_stepper(4)
    w.step.value = 1
    assert "has sent 1 chunk of M/4" in w.info.value



def _static_view(w, values):
    """What a page with no kernel shows once its live controls hold `values`
    ({control: value of the linked trait}): follow each browser-side link from
    its control to its stacks, as the widget manager would, and return the
    caption of the state then selected, or None if that state is not drawn."""
    index = {}
    for link in w.pages.links:
        (control, trait), (stack, _) = link.source, link.target
        index[stack.model_id] = values.get(control, getattr(control, trait))
    node = w.pages
    while not isinstance(node.children[0], W.HTML):
        node = node.children[index[node.model_id]]
    html = node.children[0].value
    return html or None


def test_ring_stepper_steps_work_without_a_kernel():
    # every step of N = 4 is drawn ahead and the step slider selects it in the
    # browser; the caption a page shows for step k is the kernel's for step k
    w = viz.ring_stepper(4)
    assert w.step.value == 0
    shown = {k: _static_view(w, {w.step: k}) for k in range(7)}
    for k in range(7):
        assert f"after step {k} of 6" in shown[k], (k, shown[k])
        w.step.value = k
        assert w.info.value == shown[k]
    assert (LIVE_CLASS not in w.world_size._dom_classes
            and LIVE_CLASS in w.step._dom_classes)
    # a new N (kernel only) draws its steps as they are shown, and the kernel
    # lets go of the old N's pages (stacks, pictures, links)
    before = w.pages
    w.world_size.value = 6
    assert before.comm is None and before.links[0].comm is None
    assert all(leaf.comm is None and leaf.children[1].comm is None
               for leaf in before.leaves.values())
    assert _static_view(w, {w.step: 9}) is None
    w.step.value = 9
    assert "after step 9 of 10" in _static_view(w, {w.step: 9})


def test_zero_explorer_stage_and_precision_work_without_a_kernel():
    w = viz.zero_explorer(params=7.5e9, dp_size=64, stage=2)
    static = {(p, s): _static_view(w, {w.precision: p, w.stage: s})
              for p in range(2) for s in range(4)}
    assert all(static.values()), "every stage and precision drawn ahead"
    for (p, s), caption in static.items():  # the page agrees with the kernel
        w.precision.index, w.stage.value = p, s
        assert w.info.value == caption, ((p, s), caption, w.info.value)
        assert f"{widgets.STAGES[s]} keeps" in caption
    assert LIVE_CLASS in w.stage._dom_classes + w.precision._dom_classes
    assert LIVE_CLASS not in w.dp_size._dom_classes + w.params._dom_classes
    # N moved in a kernel: the states drawn for the old N are dropped, not shown
    w.dp_size.value = 8
    assert _static_view(w, {w.precision: 0, w.stage: 0}) is None
    assert "on N = 8" in w.info.value
    # the chart shown is the one drawn for the state shown, even one drawn
    # before another (a kernel keeps one Figure, not one a state)
    w.stage.value = 0
    w.stage.value = 3
    assert w.precision.value == "fp32"  # 4 + 4 + 12 bytes: 20 Ψ / N
    assert _gb_bars(w.figure)[3] == pytest.approx(20 * 7.5e9 / 8 / 1e9)
