"""labkit.parallel.diloco: DiLoCo and Streaming DiLoCo on 4 gloo ranks, 2 hosts of 2
ranks, against a one-process reference that runs the same algorithm with explicit
loops; the bytes a rank sends, measured with the traffic ledger, against data
parallelism's; the refusals; and torchft's regression fixture for Streaming
DiLoCo."""

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.numerics import Oracle, rel_err

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N, HOSTS = 4, 2  # ranks 0, 1 are host 0; ranks 2, 3 host 1
K = 8  # inner steps in every run
ROWS = 4  # rows each rank draws a step
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
# the outer optimizer: Nesterov momentum, lr 0.7, momentum 0.9 (Douillard et al.
# 2023, arXiv 2311.08105, sec. 3)
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9}
CONFIGS = {
    "H=4": {"H": 4, "F": 1, "bits": None, **PAPER},
    "H=4, F=2": {"H": 4, "F": 2, "bits": None, **PAPER},
    "H=4, 8-bit": {"H": 4, "F": 1, "bits": 8, **PAPER},
    # inner SGD, outer SGD at lr 1 without momentum: data parallelism (see below)
    "H=1": {"H": 1, "F": 1, "bits": None, "outer_lr": 1.0, "outer_momentum": 0.0,
            "sgd": 0.1},
}
_GROUPS: dict = {}  # in each rank: the host groups, built once (new_group: collective)


def _model():
    torch.manual_seed(0)
    # 96, 16, 256, 16, 256, 16, 48, 3 elements: two fragments cut after the third
    # (368 of 707, the running sum nearest 707/2)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def _inner(config, params):
    if "sgd" in config:
        return torch.optim.SGD(params, lr=config["sgd"])
    return torch.optim.AdamW(params, **ADAMW)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _hosts():
    import torch.distributed as dist

    if "hosts" not in _GROUPS:
        _GROUPS["hosts"] = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return _GROUPS["hosts"]


@contextmanager
def _one_thread():
    """One torch thread, in the ranks and in the reference alike: the 8-bit run is
    compared bit for bit, so both must compute each gradient the same way."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _train(rank, world_size, config):
    import torch.distributed as dist

    from labkit.parallel import DiLoCo

    with _one_thread():
        model = _model()
        opt = _inner(config, model.parameters())
        diloco = DiLoCo(model, opt, sync_every=config["H"], num_fragments=config["F"],
                        bits=config["bits"], outer_lr=config["outer_lr"],
                        outer_momentum=config["outer_momentum"],
                        host_group=_hosts()[dist.get_rank() // 2])
        synced = []
        for step in range(1, K + 1):
            opt.zero_grad()
            x, y = _batch(rank, step)
            F.mse_loss(model(x), y).backward()
            synced.append(diloco.step())
        out = {"params": _snapshot(model), "synced": synced,
               "inner_steps": diloco.inner_steps, "fragments": diloco.fragments,
               "fragment_at": [diloco.fragment_at(s) for s in range(13)]}
        diloco.close()
    return out


@pytest.fixture(scope="module")
def trained(cluster):
    return {name: cluster.run(_train, c).values for name, c in CONFIGS.items()}


# ------------------------------------------------------- the one-process reference


def _quantized(x, bits, block=64):
    """x rounded as the wrapper's codes stand for: per block of `block` values,
    scale = max|x|/q and x ≈ scale·round(x/scale), q = 2^(bits-1) - 1."""
    q = 2 ** (bits - 1) - 1
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(dim=1) / q
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe[:, None]).clamp(-q, q)
    return (codes * scale[:, None]).reshape(-1)


def _quantized_mean(xs, bits, block=64):
    """The mean of the ranks' vectors xs as quantized_average forms it: each rank's
    chunk j quantised, rank j's mean of them (in rank order), quantised again."""
    n, k = len(xs), xs[0].numel()
    c = -(-k // (n * block)) * block
    padded = [torch.cat([x, x.new_zeros(n * c - k)]).view(n, c) for x in xs]
    chunks = [_quantized(torch.stack([_quantized(p[j], bits, block) for p in padded])
                         .sum(0) / n, bits, block) for j in range(n)]
    return torch.cat(chunks)[:k]


def _host_gradient(model, host, step, order):
    """The host's mean gradient in .grad: its two ranks' gradients, then their mean
    ("ranks"), or one backward over both ranks' rows ("host batch")."""
    batches = [_batch(r, step) for r in (2 * host, 2 * host + 1)]
    dtype = next(model.parameters()).dtype
    if order == "host batch":
        x, y = (torch.cat(t).to(dtype) for t in zip(*batches))
        F.mse_loss(model(x), y).backward()
        return
    grads = []
    for x, y in batches:
        model.zero_grad()
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, g0, g1 in zip(model.parameters(), *grads):
        p.grad = (g0 + g1) / 2


def _reference(config, dtype=torch.float64, order="ranks"):
    """DiLoCo in one process with explicit loops: each host a copy of the model with
    its own inner optimizer, stepped on its ranks' mean gradient; at a fragment's
    turn, the outer step on θ_start with Δ = θ_start - θ averaged over the ranks.
    Returns each host's parameters."""
    H, nf, bits = config["H"], config["F"], config["bits"]
    lr, mu = config["outer_lr"], config["outer_momentum"]
    model = _model().to(dtype)
    names = [n for n, _ in model.named_parameters()]
    frags = [names] if nf == 1 else [names[:3], names[3:]]  # see _model
    hosts = [copy.deepcopy(model) for _ in range(HOSTS)]
    opts = [_inner(config, h.parameters()) for h in hosts]
    wide = torch.promote_types(dtype, torch.float32)

    def flat(h, frag):
        return torch.cat([dict(h.named_parameters())[n].detach().reshape(-1).to(wide)
                          for n in frag])

    start = [flat(model, frag) for frag in frags]
    momentum = [torch.zeros_like(s) for s in start]
    for step in range(1, K + 1):
        for h, (host, opt) in enumerate(zip(hosts, opts)):
            opt.zero_grad()
            _host_gradient(host, h, step, order)
            opt.step()
        for f, frag in enumerate(frags):
            if (step - (f + 1) * H // nf) % H:  # its turn: (step - (f+1)H/F) % H == 0
                continue
            deltas = [start[f] - flat(host, frag) for host in hosts]
            per_rank = [deltas[r // 2] for r in range(N)]  # each rank sends its host's
            if bits:
                mean = _quantized_mean(per_rank, bits)
            elif order == "host batch":
                mean = (deltas[0] + deltas[1]) / 2
            else:
                mean = sum(per_rank[1:], per_rank[0]) / N
            momentum[f].mul_(mu).add_(mean)  # Nesterov, as torch.optim.SGD
            start[f].add_(mean.add(momentum[f], alpha=mu), alpha=-lr)
            with torch.no_grad():
                for host in hosts:
                    at, params = 0, dict(host.named_parameters())
                    for n in frag:
                        p = params[n]
                        p.copy_(start[f][at:at + p.numel()].view_as(p))
                        at += p.numel()
    return [_snapshot(h) for h in hosts]


def _oracles(config):
    """One Oracle a host: float64 exact; float32 with each rank's batch, then the
    means (as the ranks), and with each host's batch at once."""
    exact = _reference(config)
    runs = {o: _reference(config, torch.float32, o) for o in ("ranks", "host batch")}
    return [Oracle(exact[h], {o: r[h] for o, r in runs.items()}) for h in range(HOSTS)]


def _data_parallel(dtype=torch.float64, pieces=1):
    """One process, SGD on all 4 ranks' rows each step, the gradient summed from
    `pieces` equal parts."""
    model = _model().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=CONFIGS["H=1"]["sgd"])
    for step in range(1, K + 1):
        x, y = (torch.cat(t).to(dtype) for t in zip(*[_batch(r, step)
                                                        for r in range(N)]))
        opt.zero_grad()
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            (F.mse_loss(model(xs), ys) / pieces).backward()
        opt.step()
    return _snapshot(model)


def _check(oracle, got, what):
    a = oracle.check(got, what)
    print(f"{a}  margin {a.margin:.2f}")
    return a


# ------------------------------------------------------------------ against one process


def test_h1_is_data_parallelism_over_all_ranks(trained):
    # H = 1, inner SGD (lr η), outer SGD at lr 1 without momentum: every host steps
    # θ - η·g_h, the outer step sets θ to their mean, θ - η·mean(g_h): one SGD step
    # on the mean gradient of all 4 ranks, as data parallelism over the world takes
    oracle = Oracle(_data_parallel(), {"whole batch": _data_parallel(torch.float32),
                                       "4 quarters": _data_parallel(torch.float32, N)})
    print(oracle)
    oracle.resolves(_snapshot(_model()), "H=1: the untrained model")
    for rank, r in enumerate(trained["H=1"]):
        assert r["synced"] == [0] * K, f"H=1, rank {rank}: synced {r['synced']}"
        _check(oracle, r["params"], f"H=1 vs data parallelism, rank {rank}")


@pytest.mark.parametrize("name", ["H=4", "H=4, F=2"])
def test_matches_the_one_process_reference(trained, name):
    config = CONFIGS[name]
    oracles = _oracles(config)
    print(oracles[0])
    for h, oracle in enumerate(oracles):
        oracle.resolves(_snapshot(_model()), f"{name}, host {h}: the untrained model")
        plain = {**config, "outer_lr": 1.0, "outer_momentum": 0.0}  # averaging only
        oracle.resolves(_reference(plain)[h], f"{name}, host {h}: plain averaging")
    for rank, r in enumerate(trained[name]):
        _check(oracles[rank // 2], r["params"], f"{name}, rank {rank}")
        assert r["inner_steps"] == K, f"{name}, rank {rank}: {r['inner_steps']} steps"
    # the two ranks of a host hold the same parameters, bit for bit
    for a, b in ((0, 1), (2, 3)):
        pa, pb = trained[name][a]["params"], trained[name][b]["params"]
        differ = [k for k in pa if not torch.equal(pa[k], pb[k])]
        assert not differ, f"{name}: rank {b}'s {differ} differ from rank {a}'s"


def test_the_fragments_and_their_schedule(trained):
    names = list(_snapshot(_model()))
    for rank, r in enumerate(trained["H=4, F=2"]):
        # balanced by numel in model order: 368 and 339 of 707 elements
        assert r["fragments"] == [names[:3], names[3:]], (
            f"rank {rank}: fragments {r['fragments']}, expected cut after "
            f"{names[2]!r}")
        # fragment f syncs where (step - (f+1)·H/F) % H == 0: 0 at 2, 6, 10; 1 at
        # 4, 8, 12 (torchft's order)
        want = [None, None, 0, None, 1, None, 0, None, 1, None, 0, None, 1]
        assert r["fragment_at"] == want, f"rank {rank}: {r['fragment_at']}"
        assert r["synced"] == want[1:K + 1], f"rank {rank}: synced {r['synced']}"
    for rank, r in enumerate(trained["H=4"]):
        want = [None, None, None, None, 0, None, None, None, 0] + [None] * 3 + [0]
        assert r["fragment_at"] == want, f"H=4, rank {rank}: {r['fragment_at']}"


def test_8_bit_matches_a_reference_that_quantises_the_same_way(trained):
    config = CONFIGS["H=4, 8-bit"]
    with _one_thread():
        ref = _reference(config, torch.float32)
    # the same float32 operations in the same order (the quantised sum in rank
    # order is the wrapper's own; gloo's fp32 sum of two gradients is a + b):
    # bit for bit. Rounding to 8 bits is not continuous, so a float64 reference
    # would round some values to another level: no Oracle applies
    for rank, r in enumerate(trained["H=4, 8-bit"]):
        want = ref[rank // 2]
        differ = {k: f"{(v - want[k]).abs().max():.1e}" for k, v in r["params"].items()
                  if not torch.equal(v, want[k])}
        assert not differ, (f"8-bit, rank {rank}: max-abs difference from the "
                            f"reference {differ}, expected bit for bit")
    # what quantising cost: the distance from the unquantised run, against the
    # rounding allowed for that run
    oracle = _oracles({**config, "bits": None})[0]
    lost = rel_err(trained["H=4, 8-bit"][0]["params"], oracle.exact)
    print(f"8-bit vs unquantised (float64), after {K} inner steps, 2 outer: "
          f"{lost:.1e} (rounding allows {oracle.allowed:.1e})")
    assert lost > oracle.allowed, (
        f"8-bit: {lost:.1e} from the unquantised run, expected more than its "
        f"{oracle.allowed:.1e} rounding allowance (was anything quantised?)")


def _average_quantized(rank, world_size, bits):
    from labkit.parallel import quantized_average

    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    return quantized_average(x, bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_what_the_quantised_all_reduce_loses(cluster, bits):
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * (r + 1)
          for r in range(N)]
    got = cluster.run(_average_quantized, bits).values
    for rank, g in enumerate(got[1:], 1):
        assert torch.equal(g, got[0]), f"{bits}-bit: rank {rank}'s mean differs"
    want = _quantized_mean(xs, bits)
    assert torch.equal(got[0], want), (
        f"{bits}-bit: max-abs {(got[0] - want).abs().max():.1e} from the reference "
        "that quantises the same way, expected bit for bit")
    # each value: half a level of its block in each rank's chunk (averaged), half
    # a level of the reduced chunk, and float32's rounding of the sum of 4
    q, c = 2 ** (bits - 1) - 1, 256  # 1000 values: 4 chunks of 256, padded
    exact = torch.stack([x.double() for x in xs]).mean(0)

    def half_level(v):  # per value: max|block| / 2q
        v = torch.cat([v, v.new_zeros(N * c - v.numel())]).view(-1, 64)
        return (v.abs().amax(1, keepdim=True) / (2 * q)).expand(-1, 64).reshape(-1)

    sent = sum(half_level(x.double()) for x in xs) / N
    reduced = half_level(exact.abs() + sent[:1000])
    unit = torch.finfo(torch.float32).eps / 2
    bound = (sent + reduced)[:1000] + (N + 2) * unit * sum(x.abs() for x in xs) / N
    err = (got[0].double() - exact).abs()
    worst = (err / bound).max().item()
    print(f"{bits}-bit all-reduce of 4 x 1000 values: {rel_err(got[0], exact):.1e} "
          f"from the exact mean; worst value {worst:.2f} of its bound")
    assert worst <= 1, (f"{bits}-bit: a value {worst:.2f} x its bound (half a "
                        "level twice, plus float32's sum) from the exact mean")


# ------------------------------------------------------------------------ the bytes
W, LAYERS = 64, 4  # 4 layers of 64 x 64, no bias: 16384 elements, 8192 a fragment
STEPS = 8
BLOCK = 64
TRAFFIC = {"ddp world": None, "ddp host": None,
           "H=4": {"sync_every": 4}, "H=4, F=2": {"sync_every": 4, "num_fragments": 2},
           "H=4, 8-bit": {"sync_every": 4, "bits": 8},
           "H=4, 4-bit": {"sync_every": 4, "bits": 4}}


def _traffic(rank, world_size, mode):
    import torch.distributed as dist

    from labkit import ledger
    from labkit.parallel import DataParallel, DiLoCo

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(W, W, bias=False) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    host = _hosts()[dist.get_rank() // 2]
    if mode.startswith("ddp"):  # one bucket: one all-reduce of every gradient
        group = host if mode == "ddp host" else None
        dp = DataParallel(model, bucket_mib=1024, group=group)
    else:
        diloco = DiLoCo(model, opt, host_group=host, block=BLOCK, **TRAFFIC[mode])
    steps = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(ROWS, W, generator=g)
        opt.zero_grad()
        with ledger.traffic() as t:
            model(x).square().mean().backward()
            if mode.startswith("ddp"):
                dp.finish_gradient_synchronization()
                opt.step()
            else:
                diloco.step()
        steps.append(t)
    (dp if mode.startswith("ddp") else diloco).close()
    return steps


@pytest.fixture(scope="module")
def traffic(cluster):
    return {mode: cluster.run(_traffic, mode).values for mode in TRAFFIC}


def _bytes(t, field="bus_bytes", **where):
    return t.sum(field, **where)


def test_outer_bytes_are_data_parallelisms_over_h(traffic):
    from labkit.parallel import DiLoCo

    n = W * W * LAYERS
    allreduce = 2 * (N - 1) / N * 4 * n  # one fp32 all-reduce over 4 ranks
    inner, outer = DiLoCo.INNER_PHASE, DiLoCo.OUTER_PHASE
    for rank in range(N):
        ddp = [_bytes(t, op="all_reduce") for t in traffic["ddp world"][rank]]
        host = [_bytes(t, op="all_reduce") for t in traffic["ddp host"][rank]]
        assert ddp == [allreduce] * STEPS, f"rank {rank}: DDP sent {ddp} a step"
        for mode in ("H=4", "H=4, F=2", "H=4, 8-bit", "H=4, 4-bit"):
            steps = traffic[mode][rank]
            # inside the host: DDP over the host's 2 ranks, every step
            got = [_bytes(t, phase=inner) for t in steps]
            assert got == host, (
                f"{mode}, rank {rank}: inner bytes {got}, DDP's in the host {host}")
            assert all(r.group_ranks == ((0, 1) if rank < 2 else (2, 3))
                       for t in steps for r in t.records if r.phase == inner)
            assert all(r.group_ranks == (0, 1, 2, 3)
                       for t in steps for r in t.records if r.phase == outer)
        # over all ranks: every H = 4 steps, the same all-reduce as DDP's
        out = [_bytes(t, phase=outer) for t in traffic["H=4"][rank]]
        assert out == [0, 0, 0, allreduce] * 2, f"rank {rank}: outer bytes {out}"
        assert sum(out) / STEPS == sum(ddp) / STEPS / 4, (
            f"rank {rank}: outer bytes per inner step {sum(out) / STEPS:,.0f}, DDP's "
            f"÷ H = {sum(ddp) / STEPS / 4:,.0f} expected")
        # Streaming, F = 2: a half every 2 steps; the peak ÷ 2, the average the same
        frag = [_bytes(t, phase=outer) for t in traffic["H=4, F=2"][rank]]
        assert frag == [0, allreduce / 2] * 4, f"rank {rank}: F=2 outer bytes {frag}"
        assert max(frag) == max(out) / 2 and sum(frag) == sum(out), (
            f"rank {rank}: F=2 peak {max(frag):,.0f}, total {sum(frag):,.0f}; "
            f"{max(out) / 2:,.0f} and {sum(out):,.0f} expected")
        for bits in (8, 4):
            # the quantised all-to-all and all-gather: × b/32 plus one fp32 scale
            # per block of 64 (16384 values: 4 chunks of whole blocks, no padding)
            want = allreduce * bits / 32 + 2 * (N - 1) / N * 4 * n / BLOCK
            q = [_bytes(t, phase=outer) for t in traffic[f"H=4, {bits}-bit"][rank]]
            assert q == [0, 0, 0, want] * 2, (
                f"rank {rank}, {bits}-bit: outer bytes {q}, {want:,.0f} a sync "
                "expected")
            ops = sorted({r.op for t in traffic[f"H=4, {bits}-bit"][rank]
                          for r in t.records if r.phase == outer})
            assert ops == ["all_gather", "all_to_all"], f"{bits}-bit: ops {ops}"
    for mode in TRAFFIC:  # what rank 0 wrote to its sockets, for the record
        wire = sum(_bytes(t, "wire_bytes") for t in traffic[mode][0])
        bus = sum(_bytes(t) for t in traffic[mode][0])
        print(f"{mode:12s} rank 0, {STEPS} steps: bus {bus:>9,.0f} B, "
              f"wire {wire:>9,.0f} B")


# ----------------------------------------------------------------------- refusals


def test_bad_arguments_and_no_process_group():
    from labkit.parallel import DiLoCo

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, match in [({"sync_every": 0}, "sync_every"),
                      ({"sync_every": 2.0}, "sync_every"),
                      ({"sync_every": 4, "num_fragments": 3}, "must divide"),
                      ({"sync_every": 2, "num_fragments": 4}, "must divide"),
                      ({"sync_every": 4, "bits": 2}, "bits must be one of"),
                      ({"sync_every": 4, "bits": 16}, "bits must be one of"),
                      ({"sync_every": 4, "block": 12}, "multiple of 8")]:
        with pytest.raises(ValueError, match=match):
            DiLoCo(model, opt, **kw)
    with pytest.raises(RuntimeError, match="process group"):
        DiLoCo(model, opt, sync_every=4)


def _mistakes(rank, world_size):
    from labkit.parallel import DiLoCo

    def error(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)

    torch.manual_seed(rank)  # each rank its own weights
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=2, host_group=_hosts()[rank // 2])
    out = {"weights": _snapshot(model)}  # rank 0's, broadcast
    other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    out["stray"] = error(lambda: DiLoCo(model, other, sync_every=2))
    out["fragments"] = error(lambda: DiLoCo(model, opt, sync_every=4, num_fragments=4))
    out["early"] = error(diloco.step)
    model(torch.ones(1, 3)).sum().backward()
    out["bare"] = error(opt.step)
    diloco.close()
    return out


def test_mistakes_say_what_happened(cluster):
    torch.manual_seed(0)
    rank0 = _snapshot(nn.Linear(3, 2))
    for rank, r in enumerate(cluster.run(_mistakes).values):
        assert "not the module's trainable parameters" in r["stray"], r["stray"]
        assert "cannot split 2 parameters into 4" in r["fragments"], r["fragments"]
        assert "before backward" in r["early"], r["early"]
        assert "call diloco.step()" in r["bare"], r["bare"]
        # weights that differ at construction: rank 0's on every rank, as DataParallel
        assert all(torch.equal(r["weights"][k], rank0[k]) for k in rank0), (
            f"rank {rank}: weights after construction differ from rank 0's")


# ------------------------------------------------------ torchft's regression fixture
# pytorch/torchft, test_fixtures/torchft.diloco_regression_test.
# DiLoCoMockedUpdateTest.test_diloco_mocked_updates_0.json (its "history", the
# same on both replicas): 2 replicas, 2 one-element layers starting at 1, every
# gradient 2, inner step p -= 1·grad, outer p -= 2·Δ (no momentum), sync_every 6,
# 2 fragments, fragment_sync_delay 0, fragment_update_alpha 0. Each layer's weight
# before inner step 1, ..., after inner step 15:
TORCHFT_HISTORY = {
    "layers.0.weight": [1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41,
                        -43, -45, -59],
    "layers.1.weight": [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49,
                        -51, -53],
}


def _torchft_mock(rank, world_size):
    from labkit.parallel import DiLoCo

    model = nn.Module()
    model.layers = nn.Module()
    # torchft's fragment i syncs first after (i+1)·H/F steps, as ours does
    for i in ("0", "1"):
        model.layers.add_module(i, nn.Linear(1, 1, bias=False))
        nn.init.ones_(model.layers.get_submodule(i).weight)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = DiLoCo(model, opt, sync_every=6, num_fragments=2, outer_lr=2.0,
                    outer_momentum=0.0, host_group=_hosts()[rank // 2])
    history = {n: [p.item()] for n, p in model.named_parameters()}
    for _ in range(15):
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
        diloco.step()
        for n, p in model.named_parameters():
            history[n].append(p.item())
    diloco.close()
    return history, diloco.fragments


def test_torchft_streaming_diloco_fixture(cluster):
    for rank, (history, fragments) in enumerate(cluster.run(_torchft_mock).values):
        assert fragments == [["layers.0.weight"], ["layers.1.weight"]], fragments
        for name, want in TORCHFT_HISTORY.items():
            # small integers: float32 holds every value exactly
            assert history[name] == [float(v) for v in want], (
                f"rank {rank}, {name}: {history[name]}, torchft's fixture {want}")
