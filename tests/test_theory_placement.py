"""labkit.theory.placement: the named placements against the ZeRO paper's and the
placement-semantics abstract's figures; the correctness conditions."""

import pytest
import torch

from labkit import ledger, theory

# ZeRO paper (Rajbhandari et al. 2020), fig. 1 and sec. 7: Ψ = 7.5B, N = 64, K = 12.
# GB of model state per device, and traffic in units of Ψ (2-byte elements, times
# the ring's 63/64): DP and ZeRO-1/2 2Ψ, ZeRO-3 3Ψ. FSDP is ZeRO-3 by another name.
PUBLISHED = {"DP": (120.0, 2), "ZeRO-1": (31.4, 2), "ZeRO-2": (16.6, 2),
             "ZeRO-3": (1.9, 3), "FSDP": (1.9, 3)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_placements_reproduce_the_zero_paper(name):
    gb, psis = PUBLISHED[name]
    p = theory.PLACEMENTS[name]
    cost = p.cost(7.5e9, 64)
    assert round(cost.persistent_total / 1e9, 1) == gb
    assert cost.traffic_total == pytest.approx(psis * 7.5e9 * 63 / 64 * 2)
    assert cost.pcie == 0 and p.check().ok


@pytest.mark.parametrize("name", ["ZeRO-3", "FSDP"])
def test_placement_paper_abstract_figures(name):
    # Mehta 2026, abstract: "ZeRO-3 uses 8x less memory than data parallelism at
    # 1.5x communication cost" (N = 8 here)
    dp = theory.PLACEMENTS["DP"].cost(1e9, 8)
    z3 = theory.PLACEMENTS[name].cost(1e9, 8)
    assert dp.persistent_total / z3.persistent_total == pytest.approx(8)
    assert z3.traffic_total / dp.traffic_total == pytest.approx(1.5)


def test_seventy_billion_parameters_need_1120_gb():
    # Mehta 2026, intro: a 70B model needs ~1120 GB of model state (16 bytes each)
    assert theory.PLACEMENTS["DP"].cost(70e9, 1).persistent_total == 1120e9


@pytest.mark.parametrize("name, grad, param", [
    ("DP", "all_reduce", None),
    ("ZeRO-1", "reduce_scatter", "all_gather"),  # shard updated, then gathered
    ("ZeRO-2", "reduce_scatter", "all_gather"),
    ("ZeRO-3", "reduce_scatter", None),  # gathered layer by layer instead
    ("FSDP", "reduce_scatter", None),
    ("ZeRO-Offload", "reduce_scatter", "all_gather"),
])
def test_resolved_syncs_follow_from_the_modes(name, grad, param):
    p = theory.PLACEMENTS[name]
    assert (p.resolved_grad_sync(), p.resolved_param_sync()) == (grad, param)


def test_explicit_syncs_override_the_modes():
    p = theory.Placement("Replicated", "Sharded", "Sharded", "Replicated",
                         grad_sync=None, param_sync=None)
    assert (p.resolved_grad_sync(), p.resolved_param_sync()) == (None, None)
    # DP with a reduce-scatter: each replica would step on a shard's gradient only
    odd = theory.Placement(grad_sync="reduce_scatter")
    assert odd.resolved_grad_sync() == "reduce_scatter"
    assert set(odd.cost(1e9, 4).traffic) == {"reduce_scatter (gradients)"}


def test_peak_includes_gathered_layers_and_activations():
    z3 = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8, activations=1e9,
                                          gather_fraction=1 / 10)
    assert z3.persistent["A"] == 0 and z3.peak["A"] == 1e9
    assert z3.peak["P"] == pytest.approx(2e9 / 8 + 0.1 * 2e9 * 7 / 8)


def test_correctness_conditions_explain_what_breaks():
    no_rs = theory.Placement("Replicated", "Sharded", "Sharded", "Replicated",
                             grad_sync=None)
    v = no_rs.check()
    assert not v.ok and "gradient integrity" in str(v) and "sharded gradients" in str(v)
    drift = theory.Placement("Replicated", "Sharded", "Replicated", "Replicated",
                             param_sync=None)
    assert "state consistency" in str(drift.check())
    mixed = theory.Placement("Replicated", "Replicated", "Sharded", "Replicated")
    assert "replicas update with different gradients" in str(mixed.check())
    assert "tensor parallelism" in str(theory.Placement(P="Sharded").check())
    with pytest.raises(ValueError, match="P must be one of"):
        theory.Placement(P="Everywhere")
    with pytest.raises(ValueError, match="grad_sync"):
        theory.Placement(grad_sync="broadcast")
    with pytest.raises(ValueError, match="gather_fraction"):
        theory.PLACEMENTS["DP"].cost(1e9, 8, gather_fraction=0)


def test_offloaded_optimizer_state_never_occupies_the_device():
    # ZeRO-Offload (Ren et al. 2021, sec. 4): the optimizer step runs on the CPU,
    # so the device holds none of O, at rest or during the step; gradients go
    # down and updated fp16/bf16 parameters come up: (2 + 2) Ψ / N bytes of PCIe
    cost = theory.PLACEMENTS["ZeRO-Offload"].cost(1e9, 8)
    assert cost.persistent["O"] == 0 and cost.peak["O"] == 0
    assert cost.pcie == (2 + 2) * 1e9 / 8


def test_parameters_materialized_from_a_sharded_master_copy_are_gathered():
    # P Materialized keeps no parameters between steps; with O Sharded the only
    # copy of the weights is each device's 1/N of the fp32 master, so building a
    # layer's whole parameters (forward, and again in backward) is an all-gather
    # of the others' shards: ZeRO-3's traffic, without its persistent shard of P
    mat = theory.Placement("Materialized", "Sharded", "Sharded", "Replicated")
    z3 = theory.PLACEMENTS["ZeRO-3"]
    assert mat.gathers_parameters() and z3.gathers_parameters()
    assert mat.check().ok
    cost, ref = mat.cost(1e9, 8), z3.cost(1e9, 8)
    assert cost.traffic == ref.traffic
    assert cost.traffic["all_gather (parameters, forward)"] == 7 / 8 * 1e9 * 2
    assert cost.traffic["all_gather (parameters, backward)"] == 7 / 8 * 1e9 * 2
    assert cost.persistent["P"] == 0 and cost.peak["P"] == 2e9  # one layer: all
    # the same from an offloaded (per-device shard on the host) optimizer, whose
    # CPU step leaves the new weights on the host: they cross PCIe when a layer
    # runs, forward and backward, as Offloaded P does; gradients come down once
    off = theory.Placement("Materialized", "Offloaded", "Sharded").cost(1e9, 8)
    assert off.traffic == ref.traffic and off.pcie == (2 + 2 * 2) * 1e9 / 8
    assert off == theory.Placement("Offloaded", "Offloaded", "Sharded").cost(1e9, 8)
    # from a replicated master copy every device casts its own: nothing to gather
    local = theory.Placement("Materialized", "Replicated", "Replicated")
    assert not local.gathers_parameters() and local.check().ok
    assert set(local.cost(1e9, 8).traffic) == {"all_reduce (gradients)"}


def test_nothing_to_materialize_parameters_from_is_rejected():
    v = theory.Placement("Materialized", "Materialized").check()
    assert not v.ok and "nothing to rebuild them from" in str(v)


def test_offloaded_parameters_are_fetched_whole_for_forward_and_backward():
    # P Offloaded keeps nothing on the device between uses, but a layer runs on all
    # of its weights: at the peak the device holds the layer being computed, whole.
    # They reach it for forward and again for backward (ZeRO-Infinity, Rajbhandari
    # et al. 2021, sec. 4.1: parameters are loaded at least twice per step)
    psi, n, layer = 1e9, 8, 1 / 10
    z3 = theory.PLACEMENTS["ZeRO-3"].cost(psi, n, gather_fraction=layer)
    # beside a sharded optimizer each host keeps the 1/N its device updates: fetched
    # per pass, the rest all-gathered (ZeRO-3's traffic); the device's step writes
    # its new 1/N back to the host
    p = theory.Placement("Offloaded", "Sharded", "Sharded", "Replicated")
    cost = p.cost(psi, n, gather_fraction=layer)
    assert p.check().ok and p.resolved_param_sync() is None
    assert cost.persistent["P"] == 0 and cost.peak["P"] == layer * 2 * psi
    assert cost.peak["P"] == z3.peak["P"] - z3.persistent["P"] * (1 - layer)
    assert cost.traffic == z3.traffic
    assert cost.pcie == (2 + 1) * 2 * psi / n
    # with the optimizer on the host too (ZeRO-Infinity's CPU offload): gradients
    # down once, parameters up per pass, and nothing written back
    inf = theory.Placement("Offloaded", "Offloaded", "Sharded").cost(psi, n)
    assert inf.traffic == z3.traffic and inf.peak["P"] == 2 * psi
    assert inf.pcie == (2 + 2 * 2) * psi / n
    # beside a replicated optimizer every host keeps the whole: no all-gather, the
    # whole model over PCIe twice, and the whole update written back
    rep = theory.Placement("Offloaded", "Replicated", "Replicated")
    cost = rep.cost(psi, n, gather_fraction=layer)
    assert rep.check().ok and not rep.gathers_parameters()
    assert set(cost.traffic) == {"all_reduce (gradients)"}
    assert cost.peak["P"] == layer * 2 * psi and cost.pcie == 3 * 2 * psi


def _kept_vs_rebuilt(optimizer_cls, steps=5, **kw):
    """The same steps with one optimizer kept throughout, and with a new one (its
    state Materialized: built from nothing) every step."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    start = torch.nn.Linear(8, 4)
    runs = []
    for rebuild in (False, True):
        model = torch.nn.Linear(8, 4)
        model.load_state_dict(start.state_dict())
        opt = optimizer_cls(model.parameters(), **kw)
        for _ in range(steps):
            if rebuild:
                opt = optimizer_cls(model.parameters(), **kw)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        runs.append(model.weight.detach().clone())
    return runs, start.weight.detach()


def test_materialized_optimizer_state_breaks_state_consistency():
    # Adam's m and v are running averages over every step so far: rebuilt from
    # nothing each step, they give a different update from step 2 on (here off by
    # about half as much as training moved the weights)
    (kept, rebuilt), start = _kept_vs_rebuilt(torch.optim.Adam, lr=5e-2)
    moved = (kept - start).abs().max()
    assert (rebuilt - kept).abs().max() > 0.05 * moved
    v = theory.Placement("Replicated", "Materialized").check()
    assert not v.ok and v.problems[0].startswith("state consistency")
    assert "m and v" in str(v)
    for p in ("Offloaded", "ShardedWithGather"):
        assert not theory.Placement(p, "Materialized", "Sharded").check().ok
    # plain SGD keeps no state (k = 0): rebuilt or kept, the same steps
    (kept, rebuilt), _ = _kept_vs_rebuilt(torch.optim.SGD, lr=1e-1)
    assert torch.equal(kept, rebuilt)
    assert theory.Placement("Replicated", "Materialized").check(k=0).ok
    both = theory.Placement("Materialized", "Materialized").check(k=0)
    assert not both.ok and "nothing to rebuild them from" in str(both)
    with pytest.raises(ValueError, match="k cannot be negative"):
        theory.Placement().check(k=-1)


def test_offloaded_gradients_are_made_on_the_device_then_moved_down_and_back_up():
    # backward makes each layer's whole gradient on the device; it is reduced, and
    # only then can the device's part go down to host memory. Nothing stays on the
    # device between steps, but at the peak one layer's gradient is whole there
    psi, n, layer = 1e9, 8, 1 / 10
    dp = theory.PLACEMENTS["DP"].cost(psi, n, gather_fraction=layer)
    for o in theory.MODES:
        cost = theory.Placement("Replicated", o, "Offloaded").cost(
            psi, n, gather_fraction=layer)
        assert cost.persistent["G"] == 0
        assert cost.peak["G"] == layer * dp.peak["G"] == layer * 2 * psi
    # beside an optimizer that steps on the device the gradient comes back up for
    # the step: twice the device's part. Sharded O: the reduce-scattered 1/N, and
    # the collectives are ZeRO-2's
    z2 = theory.Placement("Replicated", "Sharded", "Offloaded")
    cost = z2.cost(psi, n)
    assert z2.check().ok and cost.traffic == theory.PLACEMENTS["ZeRO-2"].cost(
        psi, n).traffic
    assert cost.pcie == 2 * (2 * psi / n)
    # replicated O: every device steps on the whole all-reduced gradient
    dp_off = theory.Placement("Replicated", "Replicated", "Offloaded")
    cost = dp_off.cost(psi, n)
    assert dp_off.check().ok and set(cost.traffic) == {"all_reduce (gradients)"}
    assert cost.pcie == 2 * (2 * psi)
    # ZeRO-3 with its gradient shard on the host: 1/N down and up
    assert theory.Placement("ShardedWithGather", "Sharded", "Offloaded").cost(
        psi, n).pcie == 2 * (2 * psi / n)
    # beside an offloaded optimizer (ZeRO-Offload proper: gradients and the step
    # on the CPU) the gradient goes down once and the CPU steps where it landed:
    # the PCIe of ZeRO-Offload, without its 1/N of G on the device
    zo = theory.PLACEMENTS["ZeRO-Offload"].cost(psi, n)
    g_off = theory.Placement("Replicated", "Offloaded", "Offloaded").cost(psi, n)
    assert g_off.pcie == zo.pcie == (2 + 2) * psi / n
    assert g_off.persistent["G"] == 0 < zo.persistent["G"] == 2 * psi / n


def test_offloaded_activations_cross_pcie_twice_and_keep_one_layer_on_device():
    # activation offloading, measured: every tensor forward saves for backward is
    # copied to host memory as it is saved (down) and copied back when backward
    # reads it (up). Four Linear+GELU layers, 8 x 64 fp32 activations: a layer
    # saves its Linear's output and its GELU's, the last its output (7 units)
    width, rows = 64, 8
    unit = rows * width * 4
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers[:-1])
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved = {"down": 0, "up": 0}

    def down(t):
        if t.grad_fn is None or t.untyped_storage().data_ptr() in weights:
            return t  # the input, the target and the weights: not activations
        moved["down"] += t.nbytes
        with ledger.on_host("Activation"):
            return ("host", t.detach().clone())

    def up(saved):
        if not isinstance(saved, tuple):
            return saved
        moved["up"] += saved[1].nbytes
        return saved[1].clone()

    plain = [p.grad for p in _grads(model, x, y)]
    with ledger.memory(model) as mem:
        with torch.autograd.graph.saved_tensors_hooks(down, up):
            got = [p.grad for p in _grads(model, x, y)]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))  # the same backward
    acts = 7 * unit
    assert mem.host_peak["Activation"] == moved["down"] == moved["up"] == acts
    # on the device at most one layer's two activations at once: 2 of 7 units,
    # each device its own micro-batch's whole, so not 1/N of them: whatever N
    assert mem.peak["Activation"] == 2 * unit
    psi = sum(p.numel() for p in model.parameters())
    for n in (4, 1):
        cost = theory.Placement(A="Offloaded").cost(
            psi, n, k=8, param_bytes=4, grad_bytes=4, activations=acts,
            gather_fraction=2 / 7)
        assert cost.persistent["A"] == 0 and cost.peak["A"] == mem.peak["Activation"]
        assert cost.pcie == moved["down"] + moved["up"]  # P, O, G: none over PCIe


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return list(model.parameters())
