"""labkit.parallel.sharded_checkpoint: a training state (parameters, AdamW state,
step) saved with torch.distributed.checkpoint from 4 gloo ranks, loaded on 2 ranks
and in one process, for labkit's FullyShardedDataParallel and PyTorch's FSDP2.
TinyGPT (GPT-2 layout: tied embedding and head; a cross-attention that never gets
a gradient, so it has no optimizer state). Training 2 steps, saving, and 2 more
steps from the checkpoint is compared with 4 uninterrupted steps and with one
process (labkit.numerics.Oracle); what DCP writes, with the closed form."""

import math

import pytest
import torch

from tests.models import TiedFrozenNet, TinyGPT, V

import labkit
from labkit.numerics import Oracle, rel_err
from labkit.parallel.sharded_checkpoint import (
    checkpoint_bytes,
    load_full_state_dict,
    load_sharded,
    save_sharded,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N, RESUME_N = 4, 2  # ranks that save, ranks that load
SAVED, STEPS = 2, 4  # the checkpoint's step, the last step
ROWS = 8  # sequences in the global batch (each of 8 tokens)
WRAPPERS = ("ours", "fsdp2")


def _batch(step):
    """The global batch of `step`: the step counter decides the data."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 37, (ROWS, 8), generator=g)


def _optimizer(params):
    # eps 1e-6 (BERT's; Llama's is 1e-5), not 1e-8: the attention key bias has
    # a gradient of exactly 0 (softmax ignores a shift shared by all keys), which
    # float32 leaves at about 1e-9 of rounding; with eps 1e-8 Adam turns that into
    # steps of up to lr, so one process's own error from float64 is about 1e-4
    # and a resume 2 steps short is only ~20 x that (with 1e-6: about 1e-6, and
    # > 1000 x)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def _model():
    torch.manual_seed(0)
    return TinyGPT()


def _wrap(how, world_size, model=None):
    """(model, wrapped, sync, optimizer) on `world_size` ranks."""
    m = model or _model()
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        w, sync = fully_shard(m, mesh=mesh), (lambda: None)
    else:
        from labkit.parallel.fsdp import FullyShardedDataParallel

        w = FullyShardedDataParallel(m)
        sync = w.finish_gradient_synchronization
    return m, w, sync, _optimizer([p for p in w.parameters() if p.requires_grad])


def _full(how, m, w):
    """Every parameter whole, by every name (tied: both)."""
    if how == "fsdp2":
        return {k: p.full_tensor().detach().clone()
                for k, p in m.named_parameters(remove_duplicate=False)}
    return w.gather_full_params()


def _train(rank, world_size, run, start, stop):
    m, w, sync, opt = run
    for step in range(start, stop):
        ids = _batch(step)[rank * ROWS // world_size:(rank + 1) * ROWS // world_size]
        opt.zero_grad()
        w(input_ids=ids, labels=ids).backward()
        sync()
        opt.step()


def _dtensor_pieces(rank, world_size, m, full):
    """labkit's shard of each parameter, padding cut, equals DTensor's Shard(0)
    piece of the flat parameter (what DCP is told it holds): the names that
    differ."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    differ = []
    for name, shard in m.named_parameters():
        numel = full[name].numel()
        if shard.dim() != 1 or shard.numel() != math.ceil(numel / world_size):
            continue  # not sharded (a replicated parameter)
        real = shard.detach()[:max(0, min(shard.numel(), numel - rank * shard.numel()))]
        piece = distribute_tensor(full[name].reshape(-1), mesh, [Shard(0)]).to_local()
        differ += [] if torch.equal(real, piece) else [name]
    return differ


def _odd_sizes(rank, world_size, path, save):
    """TiedFrozenNet (sizes 156, 300, 25, 300, 12, 2: most not multiples of 4, so
    the last ranks' pieces are shorter or empty; a frozen layer, a buffer), one
    AdamW step on 4 ranks, saved; or loaded (on 2)."""
    import torch.nn.functional as F

    from labkit.parallel.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    m = TiedFrozenNet()
    w = FullyShardedDataParallel(m)
    opt = _optimizer([p for p in w.parameters() if p.requires_grad])
    if save:
        tok = torch.arange(8 * 5).remainder(V).view(8, 5)[rank::world_size]
        F.cross_entropy(w(tok).flatten(0, 1), tok.flatten()).backward()
        w.finish_gradient_synchronization()
        opt.step()
        save_sharded(f"{path}/odd", w, opt, step=1)
    else:
        load_sharded(f"{path}/odd", w, opt)
    full = w.gather_full_params()
    return {"full": full, "scale": m.scale.clone(),
            "pieces": _dtensor_pieces(rank, world_size, m, full)}


def _save_and_continue(rank, world_size, path):
    """On 4 ranks: 2 steps, save, 2 more (the uninterrupted run); and a fresh
    model loading the checkpoint on the same 4 ranks, then 2 steps."""
    out = {"odd": _odd_sizes(rank, world_size, path, save=True)}
    for how in WRAPPERS:
        run = _wrap(how, world_size)
        _train(rank, world_size, run, 0, SAVED)
        save_sharded(f"{path}/{how}", run[1], run[3], step=SAVED)
        out[how, "saved"] = _full(how, run[0], run[1])
        if how == "ours":
            out["pieces"] = _dtensor_pieces(rank, world_size, run[0], out[how, "saved"])
        _train(rank, world_size, run, SAVED, STEPS)
        out[how, "uninterrupted"] = _full(how, run[0], run[1])
        again = _wrap(how, world_size)
        step = load_sharded(f"{path}/{how}", again[1], again[3])
        _train(rank, world_size, again, step, STEPS)
        out[how, "same ranks"] = _full(how, again[0], again[1])
    return out


def _error(fn):
    try:
        fn()
    except BaseException as e:  # DCP's CheckpointException is not an Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {e}"
    return None


DAMAGED = ("truncated", "zeroed .metadata", "truncated, empty marker", "no marker")


def _damage(path):
    """Copies of labkit's FSDP checkpoint of TinyGPT, each damaged as a copy or
    a disk can."""
    import shutil

    for name in DAMAGED:
        shutil.copytree(path / "ours", path / name)
    for name in ("truncated", "truncated, empty marker"):
        f = path / name / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
    md = path / "zeroed .metadata" / ".metadata"
    md.write_bytes(bytes(md.stat().st_size))  # the same size, no pickle
    (path / "truncated, empty marker" / ".labkit-complete").write_text("")
    (path / "no marker" / ".labkit-complete").unlink(missing_ok=True)  # as dcp.save


def _damage_said(e: str, path, name: str) -> None:
    """What loading a DAMAGED copy must say: which file, what is wrong."""
    where = f"{path / name}"
    want = {"truncated": (f"'{where}/__1_0.distcp' is ", "when its save finished: "
                          "it is truncated", "Copy the checkpoint again"),
            "zeroed .metadata": (f"'{where}/.metadata' cannot be read (Unpickling"
                                 "Error", "the file is damaged"),
            "truncated, empty marker": (f"'{where}/__1_0.distcp' is ", ".metadata "
                                        "lists", "it is truncated"),
            "no marker": (f"'{where}' has no .labkit-complete",
                          "its save did not finish")}[name]
    assert e.startswith("ValueError: ") and all(w in e for w in want), (name, e)


def _resume(rank, world_size, path):
    """On 2 ranks: a fresh model, the checkpoint loaded, 2 steps; and the
    mistakes a user makes."""
    out = {"odd": _odd_sizes(rank, world_size, path, save=False)}
    for how in WRAPPERS:
        run = _wrap(how, world_size)
        step = load_sharded(f"{path}/{how}", run[1], run[3])
        out[how, "step"] = step
        out[how, "loaded"] = _full(how, run[0], run[1])
        if how == "ours":
            out["pieces"] = _dtensor_pieces(rank, world_size, run[0],
                                            out[how, "loaded"])
            out["no state"] = sorted(n for n, p in run[0].named_parameters()
                                     if p not in run[3].state)
        _train(rank, world_size, run, step, STEPS)
        out[how, "resumed"] = _full(how, run[0], run[1])
    def load(how, into="ours", model=None):
        _, w, _, opt = _wrap(into, world_size, model)
        return _error(lambda: load_sharded(f"{path}/{how}", w, opt))

    torch.manual_seed(0)
    out["errors"] = {"names": load("ours", model=TinyGPT(layers=3)),
                     "shapes": load("ours", model=TinyGPT(d=32)),
                     "into FSDP2": load("ours", into="fsdp2"),
                     "no such path": load("nothing")}
    out["errors"].update({name: load(name) for name in DAMAGED})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints")
    with labkit.Cluster(N, timeout=120) as c:
        saved = c.run(_save_and_continue, str(path)).values
    _damage(path)
    with labkit.Cluster(RESUME_N, timeout=120) as c:
        resumed = c.run(_resume, str(path)).values
    return path, saved, resumed


# -------------------------------------------------------------------- one process


def _params(m):
    return {k: v.detach().clone()
            for k, v in m.named_parameters(remove_duplicate=False)}


def _one_process(dtype=torch.float32, pieces=(1,) * STEPS, fresh_at=None, start=None):
    """TinyGPT trained by AdamW in one process: step k's global batch, its gradient
    summed from pieces[k] equal parts; fresh_at: a new AdamW from that step (its
    state lost); start: (plain state_dict, step) to continue from."""
    m = _model().to(dtype)
    opt, first = _optimizer(m.parameters()), 0
    if start is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        full, first = start
        set_state_dict(m, opt, model_state_dict=full["model"],
                       optim_state_dict=full["optim"],
                       options=StateDictOptions(strict=False))
    for step in range(first, STEPS):
        if step == fresh_at:
            opt = _optimizer(m.parameters())
        opt.zero_grad()
        for part in _batch(step).chunk(pieces[step]):
            (m(input_ids=part, labels=part) / pieces[step]).backward()
        opt.step()
    return _params(m)


@pytest.fixture(scope="module")
def oracle():
    """4 AdamW steps: exact in float64; one process in float32 on the whole batch,
    in quarters (the 4 ranks' split), and in quarters then halves (4 ranks, then
    2)."""
    quarters, then_halves = (N,) * STEPS, (N,) * SAVED + (RESUME_N,) * (STEPS - SAVED)
    return Oracle(_one_process(torch.float64),
                  {"whole batch": _one_process(),
                   "4 quarters": _one_process(pieces=quarters),
                   "quarters, then halves": _one_process(pieces=then_halves)})


# -------------------------------------------------------------------------- tests


@pytest.mark.parametrize("how", WRAPPERS)
def test_continuing_on_2_ranks_matches_an_uninterrupted_run(runs, oracle, how):
    _, saved, resumed = runs
    # power: the checkpoint itself (2 steps short), and a resume that lost the
    # AdamW state, are far outside what rounding allows
    for wrong, what in ((saved[0][how, "saved"], f"{how}: the checkpoint's weights"),
                        (_one_process(fresh_at=SAVED), "2 steps, then a fresh AdamW")):
        print(f"{what}: {oracle.resolves(wrong, what):.1e} from float64")
    print(oracle)
    for rank, r in enumerate(saved):
        print(oracle.check(r[how, "uninterrupted"],
                           f"{how}, 4 uninterrupted steps, rank {rank}"))
        # the same 4 ranks from the checkpoint: the same operations in the same
        # order as the uninterrupted run, so the same bits
        differ = [k for k, v in r[how, "same ranks"].items()
                  if not torch.equal(v, r[how, "uninterrupted"][k])]
        assert not differ, f"{how}, rank {rank}: 4 -> 4 ranks changed {differ}"
    never = sorted(k for k, got in _gradients().items() if not got)
    for rank, r in enumerate(resumed):
        assert r[how, "step"] == SAVED, f"{how}: step {r[how, 'step']}, {SAVED} saved"
        if how == "ours":  # no gradient, no AdamW state: none loaded either
            assert r["no state"] == never, f"rank {rank}: no state for {r['no state']}"
        # loading moves values, computes nothing: the saved weights, to the bit
        differ = [k for k, v in saved[0][how, "saved"].items()
                  if not torch.equal(r[how, "loaded"][k], v)]
        assert not differ, f"{how}, rank {rank} of 2: loaded {differ} differently"
        print(oracle.check(r[how, "resumed"],
                           f"{how}, 2 steps on 4 ranks + 2 on 2, rank {rank}"))
        apart = rel_err(r[how, "resumed"], saved[0][how, "uninterrupted"])
        # both within `allowed` of float64, so within twice that of each other
        assert apart <= 2 * oracle.allowed, (
            f"{how}, rank {rank}: resumed and uninterrupted differ by {apart:.1e}, "
            f"more than 2 x the {oracle.allowed:.1e} each may be from float64")
        print(f"{how}, rank {rank}: resumed - uninterrupted {apart:.1e}")


@pytest.mark.parametrize("how", WRAPPERS)
def test_one_process_loads_a_plain_state_dict(runs, oracle, how):
    path, saved, _ = runs
    full = load_full_state_dict(path / how)
    gathered = saved[0][how, "saved"]
    assert full["step"] == SAVED, f"{how}: step {full['step']}, {SAVED} expected"
    assert full["model"].keys() == gathered.keys(), (
        f"{how}: {sorted(full['model'].keys() ^ gathered.keys())} differ")
    # whole tensors in the parameters' own shapes, the gathered values to the bit
    differ = [k for k, v in gathered.items() if not torch.equal(full["model"][k], v)]
    assert not differ, f"{how}: {differ} differ from the ranks' gathered parameters"
    tied = full["model"]["lm_head.weight"], full["model"]["wte.weight"]
    assert torch.equal(*tied), f"{how}: lm_head.weight is not wte.weight"
    # the AdamW state by parameter name, in their shapes; the cross-attention
    # never had a gradient, so it has none
    state = full["optim"]["state"]
    trained = {k for k, v in _gradients().items() if v} - {"lm_head.weight"}
    assert state.keys() == trained, f"{how}: state for {sorted(state.keys() ^ trained)}"
    for k, st in state.items():
        shapes = {n: tuple(v.shape) for n, v in st.items()}
        shape = tuple(gathered[k].shape)
        want = {"step": (), "exp_avg": shape, "exp_avg_sq": shape}
        assert shapes == want, f"{how}: {k}'s state: shapes {shapes}, {want} expected"
        assert st["step"].item() == SAVED, f"{how}: {k} took {st['step']} steps"
    # and one process trains on from it as the ranks did
    go_on = _one_process(start=(full, SAVED))
    print(oracle.check(go_on, f"{how}: 2 steps on 4 ranks, 2 in one process"))


def _gradients():
    """Which parameters get a gradient (by name): the cross-attention does not."""
    m = _model()
    ids = _batch(0)
    m(input_ids=ids, labels=ids).backward()
    return {k: p.grad is not None
            for k, p in m.named_parameters(remove_duplicate=False)}


def test_shards_are_dtensor_pieces(runs):
    # labkit's layout (flatten, pad to N*s, rank r keeps [r*s, (r+1)*s)) without
    # its padding is DTensor's Shard(0) of the flat parameter, on 4 ranks and on 2
    _, saved, resumed = runs
    for n, results in ((N, saved), (RESUME_N, resumed)):
        for rank, r in enumerate(results):
            for model in ("pieces", "odd"):
                pieces = r[model] if model == "pieces" else r[model]["pieces"]
                assert pieces == [], f"{model}, {n} ranks, rank {rank}: {pieces} differ"


def test_odd_sizes_frozen_layer_and_buffer(runs):
    path, saved, resumed = runs
    want = saved[0]["odd"]
    full = load_full_state_dict(path / "odd")
    plain = TiedFrozenNet()  # the names and shapes of the model's own state_dict
    plain.load_state_dict(full["model"])  # strict: every name, buffer included
    got = {"1 process": {**full["model"]}} | {
        f"rank {rank} of 2": {**r["odd"]["full"], "scale": r["odd"]["scale"]}
        for rank, r in enumerate(resumed)}
    for where, values in got.items():
        differ = [k for k, v in {**want["full"], "scale": want["scale"]}.items()
                  if not torch.equal(values[k], v)]
        assert not differ, f"TiedFrozenNet, {where}: {differ} differ from the saved"
    assert full["step"] == 1 and "frozen.weight" not in full["optim"]["state"], (
        full["step"], sorted(full["optim"]["state"]))


@pytest.mark.parametrize("how", WRAPPERS)
def test_each_rank_writes_its_shards(runs, how):
    path, _, _ = runs
    grads = _gradients()
    model = _model()
    unique = {id(p): p for p in model.parameters()}  # tied: once
    psi = sum(p.numel() for p in unique.values())
    names = {k: p for k, p in model.named_parameters()}  # tied: its first name
    stepped = [p for k, p in names.items() if grads[k]]
    adam = sum(p.numel() for p in stepped)
    # parameters, AdamW's m and v (fp32), a 4-byte step per stepped parameter;
    # FSDP2 saves the tied weight under both names
    dup = model.lm_head.weight.numel() if how == "fsdp2" else 0
    closed = 4 * (psi + dup) + 4 * 2 * adam + 4 * len(stepped)
    written = checkpoint_bytes(path / how)
    got = written.tensor_bytes
    assert got == closed, (f"{how}: {got:,} B of tensors written, 4(Ψ + 2Ψ_adam) + "
                           f"4 x {len(stepped)} steps = {closed:,} B expected")
    # a rank writes at most its DTensor piece of each sharded tensor (ours: of
    # the flat tensor, ceil(numel / N) elements; FSDP2: ceil(rows / N) rows) plus
    # the tensors written once (the steps; DCP picks a rank for each)
    def piece(shape):
        if how == "ours":
            return math.ceil(math.prod(shape) / N)
        return math.ceil(shape[0] / N) * math.prod(shape[1:])

    shapes = [p.shape for p in stepped] * 2 + [p.shape for p in unique.values()]
    shapes += [model.lm_head.weight.shape] * (how == "fsdp2")
    most = 4 * sum(piece(shape) for shape in shapes) + 4 * len(stepped)
    for f in written.files:
        # DCP wrote exactly the items .metadata lists; each tensor chunk in
        # torch.save's container (its framing)
        assert f.size == f.listed, f"{how}: {f.name} {f.size:,} B, {f.listed:,} listed"
        assert f.tensor_bytes <= most, (
            f"{how}: {f.name} holds {f.tensor_bytes:,} B of tensors, {most:,} at most")
        print(f"{how} {f.name}: {f.size:,} B = {f.tensor_bytes:,} B of tensors "
              f"({f.tensor_bytes / got:.0%}) + {f.framing:,} B of framing for "
              f"{f.tensors} tensor chunks and {f.objects} objects")
    print(f"{how}: tensors {got:,} B = closed form; .metadata {written.metadata:,} B")


def test_mistakes_say_what_is_wrong(runs, tmp_path):
    _, _, resumed = runs
    for r in resumed:
        e = r["errors"]
        assert "in the model, not in the checkpoint: blocks.2." in e["names"], e
        assert "shapes differ: blocks.0.cross_kv.bias: saved (32,), this model's " \
            "(64,)" in e["shapes"], e["shapes"]
        assert "saved from labkit's FullyShardedDataParallel" in e["into FSDP2"], e
        assert e["no such path"].startswith("FileNotFoundError: no checkpoint at"), e
    with pytest.raises(FileNotFoundError, match="has no .metadata"):
        load_full_state_dict(tmp_path)


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_checkpoint_names_the_file(runs, name):
    # on the 2 ranks (load_sharded) and in one process (load_full_state_dict)
    path, _, resumed = runs
    for r in resumed:
        _damage_said(r["errors"][name], path, name)
    _damage_said(_error(lambda: load_full_state_dict(path / name)), path, name)


def test_save_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    # save_sharded replaces the whole folder: never over what it did not write
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"mine' holds what no checkpoint holds "
                       r"\(notes.txt\)"):
        save_sharded(tmp_path / "mine", torch.nn.Linear(2, 2))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    # in one process (no process group), a save over a save replaces it whole
    for k in (1, 2):
        save_sharded(tmp_path / "one", torch.nn.Linear(2, 2), step=k)
    assert load_full_state_dict(tmp_path / "one")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "one"]


# ----------------------------------------------- a save cut short, damaged files


def _linear_saved(rank, world_size, path, plus, step, flags=None):
    """Linear(5, 6) (0.weight: 30 elements, 8 a rank, rank 3's 6) in labkit's
    FSDP, every weight + `plus`, saved at `step`. flags: rank 3 is killed
    (SIGKILL) in its write, once every other rank has written its shard."""
    import os
    import signal
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    from labkit.parallel.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    w = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(5, 6)))
    with torch.no_grad():
        for p in w.parameters():
            p.add_(plus)
    if flags is not None:
        write = FileSystemWriter.write_data

        def written(self, plan, planner):  # ranks 0-2: write, then say so
            done = write(self, plan, planner)
            done.wait()
            open(os.path.join(flags, str(rank)), "w").close()
            return done

        def killed(self, plan, planner):  # rank 3: dies once the others wrote
            while len(os.listdir(flags)) < world_size - 1:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = killed if rank == 3 else written
    save_sharded(path, w, step=step)
    return w.gather_full_params()


def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path):
    target, flags = tmp_path / "ckpt", tmp_path / "flags"
    flags.mkdir()
    (tmp_path / "notes.txt").write_text("mine")  # beside it: never touched
    with labkit.Cluster(4, timeout=60) as c:
        old = c.run(_linear_saved, str(target), 0.0, 1).values[0]
        with pytest.raises(labkit.RankError, match="rank 3"):
            c.run(_linear_saved, str(target), 1.0, 2, str(flags))
        # what is at `target` is the whole first save, never a mix of the two
        full = load_full_state_dict(target)
        mixed = (full["model"]["0.weight"] != old["0.weight"]).sum().item()
        assert mixed == 0, (f"0.weight: {mixed} of 30 elements from the save that "
                            "was cut short, the rest from the previous one")
        assert full["step"] == 1, f"step {full['step']} loaded, 1 saved before"
        # the unfinished save's folder is refused, by name
        unfinished = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.")]
        assert [p.name for p in unfinished] == ["ckpt.saving"], unfinished
        for p in unfinished:
            with pytest.raises(ValueError, match=f"{p.name}.* did not finish"):
                load_full_state_dict(p)
        # and a complete save replaces the checkpoint, and only it
        new = c.run(_linear_saved, str(target), 1.0, 2).values[0]
    full = load_full_state_dict(target)
    assert full["step"] == 2 and torch.equal(full["model"]["0.weight"],
                                             new["0.weight"]), full["step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt", "flags", "notes.txt"], sorted(p.name for p in tmp_path.iterdir())
    assert (tmp_path / "notes.txt").read_text() == "mine"
