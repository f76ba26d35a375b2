"""A logical-scale twin of a published layout: one rank built from PyTorch's own
parts (a fake process group at the published world size, DTensor tensor
parallelism, FSDP2 or its DDP twin `replicate`) over fake tensors, read off for
the bytes it holds and the collectives one micro-batch issues; `compare` puts
that beside the closed-form calculator (labkit.theory.layout).

May import torch and labkit.theory. Non-obvious: the model is created under
FakeTensorMode but sharded outside it (DeviceMesh computes coordinates with real
integer tensors; nonzero() has no fake kernel), then run under it.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from labkit.conventions import GRADIENT, OPTSTATE, PARAMETER
from labkit.theory import (
    MODELS,
    PUBLISHED_RUNS,
    Estimate,
    Layout,
    ModelConfig,
    estimate,
    layer_traffic,
    ring_bytes_per_rank,
    stage_layer_counts,
    stage_params,
    zero_breakdown,
    zero_traffic,
)


@dataclass(frozen=True)
class Recipe:
    """How a published run places and wraps its model, beyond the Layout.

    The stages' layers are the calculator's (theory.stage_layer_counts: one
    fewer on the end stages where layers + 2 divide by PP). tied_head: the last
    stage keeps its own copy of the word embeddings as the output head (Megatron's tied
    embeddings). vocab_multiple: the vocabulary is padded to a multiple of this
    times TP (1: no padding). reduce_dtype: the dtype gradients are reduced in.
    """

    tied_head: bool
    vocab_multiple: int
    reduce_dtype: torch.dtype


# Llama Team 2024 ("The Llama 3 Herd of Models", arXiv 2407.21783), sec. 3.3.2:
# one Transformer layer fewer on the first and the last pipeline stage, which
# hold the embedding and the output head (126 = 16 x 8 - 2); sec. 3.3.4: the
# FSDP reduce-scatter of the gradients is done in FP32.
# Megatron-LM (NVIDIA/Megatron-LM, megatron/training/tokenizer/tokenizer.py,
# _vocab_size_with_padding): the vocabulary is padded to a multiple of
# make_vocab_size_divisible_by (default 128) x TP; with tied embeddings the last
# stage holds a copy of the word embeddings for the output layer
# (megatron/core/models/common/language_module, shared_embedding_or_output_weight).
# Narayanan et al. 2021 train in fp16: 2-byte gradients, reduced as such here.
RECIPES = {
    "llama3-405b": Recipe(False, 1, torch.float32),
    "gpt3-175b": Recipe(True, 128, torch.bfloat16),
}


def padded_vocab(vocab: int, tp: int, multiple: int) -> int:
    """The vocabulary rows a run holds: `vocab` rounded up to multiple x tp."""
    step = multiple * tp
    return -(-vocab // step) * step


# -- the model: a Llama- or GPT-style stage at the real width

class _Norm(nn.Module):
    def __init__(self, hidden: int, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden)) if kind == "layernorm" else None

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (x.float() * scale).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.head, self.group = c.hidden // c.heads, c.heads // c.kv_heads
        # one fused q, k, v projection, as Megatron's linear_qkv: its input's
        # gradient is summed over TP once, not once per projection
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * self.head,
                             bias=c.biases)
        self.o = nn.Linear(c.hidden, c.hidden, bias=c.biases)

    def forward(self, x):
        b, s, _ = x.shape
        kv = self.qkv(x).shape[-1] // (self.group + 2)  # this rank's share
        q, k, v = (t.reshape(b, s, -1, self.head).transpose(1, 2) for t in
                   self.qkv(x).split([self.group * kv, kv, kv], dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gated = c.gated_mlp  # gate and up fused, as Megatron's linear_fc1
        self.up = nn.Linear(c.hidden, (2 if c.gated_mlp else 1) * c.ffn,
                            bias=c.biases)
        self.down = nn.Linear(c.ffn, c.hidden, bias=c.biases)

    def forward(self, x):
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, c: ModelConfig, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.norm1, self.norm2 = _Norm(c.hidden, c.norm), _Norm(c.hidden, c.norm)
        self.attn, self.mlp = _Attention(c), _MLP(c)

    def _forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x):
        if self.recompute:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class _Stage(nn.Module):
    """One pipeline stage: embedding (first), blocks, final norm and head (last)."""

    def __init__(self, c: ModelConfig, layers: int, first: bool, last: bool,
                 vocab: int, recompute: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, c.hidden) if first else None
        self.positions = (nn.Embedding(c.learned_positions, c.hidden)
                          if first and c.learned_positions else None)
        self.blocks = nn.ModuleList(_Block(c, recompute) for _ in range(layers))
        self.norm = _Norm(c.hidden, c.norm) if last else None
        self.head = nn.Linear(c.hidden, vocab, bias=False) if last else None

    def forward(self, x):
        if self.embed is not None:
            tokens = x
            x = self.embed(tokens)
            if self.positions is not None:
                x = x + self.positions(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _tp_plan(c: ModelConfig) -> dict:
    """Megatron's split: qkv and up (gate) by columns, o and down by rows."""
    return {"attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


# -- recording the collectives

@dataclass(frozen=True)
class Collective:
    """Collectives of one kind in one micro-batch's forward and backward.

    bytes: the payload of one call (an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor); sent: bytes one rank sends for all `count`
    calls by the ring algorithm (ring_bytes_per_rank)."""

    op: str
    dim: str
    group_size: int
    bytes: int
    count: int
    phase: str  # forward, backward, step
    part: str  # where the stage was: stage (FSDP's root), embedding, layer, head

    @property
    def sent(self) -> float:
        return self.count * ring_bytes_per_rank(self.op, self.bytes, self.group_size)


_C10D = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_":
         "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "allreduce_": "all_reduce", "all_reduce": "all_reduce",
         "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter"}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


class _Recorder(TorchDispatchMode):
    """Records each c10d / functional collective: its op, group and payload."""

    def __init__(self, groups: dict[str, tuple[str, int]]):
        super().__init__()
        self.groups, self.calls = groups, []
        self.phase, self.part = "forward", "stage"

    def _group(self, args):
        for a in args:
            if isinstance(a, str) and a in self.groups:
                return self.groups[a]
            if isinstance(a, torch.ScriptObject) or isinstance(a, dist.ProcessGroup):
                name = dist.ProcessGroup.unbox(a).group_name \
                    if isinstance(a, torch.ScriptObject) else a.group_name
                if name in self.groups:
                    return self.groups[name]
        raise RuntimeError(f"collective on a group the twin did not make: {args!r}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _C10D.get(func._opname) if func.namespace in (
            "c10d", "_c10d_functional") else None
        if op is not None:
            dim, size = self._group(list(args) + list(kwargs.values()))
            if op == "all_gather":
                payload = _nbytes(args[0])  # output
            elif op == "reduce_scatter":
                payload = _nbytes(args[1] if func.namespace == "c10d" else args[0])
            else:
                payload = _nbytes(args[0])
            self.calls.append((op, dim, size, payload, self.phase, self.part))
        return func(*args, **kwargs)


def _tally(calls) -> list[Collective]:
    out: dict[tuple, int] = {}
    for call in calls:
        out[call] = out.get(call, 0) + 1
    return [Collective(*call[:4], count, *call[4:]) for call, count in out.items()]


def _tag(recorder: _Recorder, model: nn.Module) -> None:
    """Hooks that tell the recorder which part of the stage is running."""
    parts = [(block, "layer") for block in model.blocks]
    parts += [(m, name) for m, name in ((model.embed, "embedding"),
                                        (model.head, "head")) if m is not None]
    for module, name in parts:
        def mark(*_, name=name):
            recorder.part = name
        module.register_forward_pre_hook(mark)
        if name != "embedding":  # its input is token ids: no gradient flows in
            module.register_full_backward_pre_hook(mark)


# -- the report

@dataclass
class TwinReport:
    """What one rank of a published layout holds and sends, read off PyTorch.

    held: bytes by labkit.conventions category as FSDP2 keeps them: PARAMETER
    the 16-bit compute copy it holds between forward and backward, GRADIENT
    the reduced fp32 shard, OPTSTATE the fp32 master shard plus AdamW's exp_avg
    and exp_avg_sq (created by one fake optimizer step). padding: bytes of the
    fp32 shards beyond an exact 1/DP split (FSDP2's dim-0 chunks and padding).
    params: this rank's elements before ZeRO (TP-local, unpadded); layer_params:
    one transformer layer's. collectives: one micro-batch's, by (op, dim, group,
    payload, phase, part); part is exact for TP, a unit's neighbour's for DP
    (FSDP2 prefetches the next unit's all-gather)."""

    run: str
    layout: Layout
    rank: int
    coords: dict[str, int]
    stage_layers: list[int]
    seq: int
    microbatch: int
    params: int
    layer_params: int
    held: dict[str, int]
    padding: float
    shards: dict[str, tuple]
    collectives: list[Collective] = field(default_factory=list)
    pipeline_bytes: int = 0  # the stage's boundary tensor (one send, one receive)

    @property
    def stage(self) -> int:
        return self.coords["pp"]

    def sent(self, dim: str, op: str | None = None, phase: str | None = None,
             part: str | None = None) -> float:
        """Ring bytes this rank sends over `dim` in one micro-batch (of `op`, in
        `phase` and `part` where given)."""
        return sum(c.sent for c in self.collectives if c.dim == dim
                   and op in (None, c.op) and phase in (None, c.phase)
                   and part in (None, c.part))


_LOCK = threading.Lock()


def _check(run: str, layout: Layout | None, rank, world_size, seq, microbatch):
    if not isinstance(run, str) or run not in RECIPES:
        raise ValueError(f"run must be one of {sorted(RECIPES)}, not {run!r}")
    layout = PUBLISHED_RUNS[run].layout if layout is None else layout
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, not {type(layout).__name__}")
    if layout.cp > 1 or layout.ep > 1 or layout.zero == 1:
        raise ValueError(f"the twin builds TP, PP and DP with ZeRO 0, 2 or 3 only; "
                         f"{layout} has CP {layout.cp}, EP {layout.ep}, ZeRO "
                         f"{layout.zero}")
    if world_size is not None and world_size != layout.gpus:
        raise ValueError(f"world_size {world_size} does not match the layout's "
                         f"tp x pp x dp = {layout.gpus}")
    for name, value in (("rank", rank), ("microbatch", microbatch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= rank < layout.gpus:
        raise ValueError(f"rank must be in [0, {layout.gpus}), got {rank}")
    seq = PUBLISHED_RUNS[run].seq if seq is None else seq
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq must be a positive int, got {seq!r}")
    if microbatch < 1:
        raise ValueError(f"microbatch must be >= 1, got {microbatch}")
    return layout, seq


def twin(run: str, layout: Layout | None = None, *, rank: int = 0,
         world_size: int | None = None, seq: int | None = None,
         microbatch: int = 1) -> TwinReport:
    """Build rank `rank` of `run` (a key of RECIPES, its published Layout by
    default) in this process and read off what it holds and sends.

    A fake process group of tp·pp·dp ranks and a (dp, pp, tp) DeviceMesh, the
    rank's pipeline stage at the real width on fake tensors, DTensor TP
    (Megatron's split, norms and row biases replicated, vocabulary-parallel
    embedding and head), then FSDP2 over DP (ZeRO-2: reshard_after_forward
    False; ZeRO-3: True) or `replicate` (ZeRO-0), bf16 compute, each block its
    own unit. One micro-batch of `microbatch` x `seq` tokens runs forward and
    backward (full recomputation checkpoints each block), then one AdamW step.
    Ranks are numbered TP fastest, then PP, then DP (the mesh's order).
    The process group is destroyed before returning; RuntimeError if one
    exists already (another twin, or the caller's own)."""
    layout, seq = _check(run, layout, rank, world_size, seq, microbatch)
    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("another twin() is running in this process; one at a time")
    try:
        if dist.is_initialized():
            raise RuntimeError("a default process group exists already; twin() "
                               "makes and destroys its own fake one")
        _clear_dtensor_caches()
        dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                world_size=layout.gpus)
        try:
            return _build(run, layout, rank, seq, microbatch)
        finally:
            dist.destroy_process_group()
            _clear_dtensor_caches()
    finally:
        _LOCK.release()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions by spec, and a DeviceMesh compares equal
    across process groups of the same shape: a cached spec would carry another
    rank's (or a destroyed group's) mesh into the next twin. Clear them."""
    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def _fsdp_params(units):
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # torch's FSDP2 internals
        if group is not None:
            yield from group.fsdp_params


def _local(t) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _build(run: str, layout: Layout, rank: int, seq: int, b: int) -> TwinReport:
    recipe, c = RECIPES[run], MODELS[PUBLISHED_RUNS[run].model]
    # ranks TP fastest, then PP, then DP: Llama 3's [TP, CP, PP, DP] order
    # (Llama Team 2024, sec. 3.3.2) and labkit.theory.layout's ORDER
    mesh = init_device_mesh("cpu", (layout.dp, layout.pp, layout.tp),
                            mesh_dim_names=("dp", "pp", "tp"))
    coords = dict(zip(("dp", "pp", "tp"), mesh.get_coordinate()))
    counts = stage_layer_counts(c, layout)
    stage = coords["pp"]
    first, last = stage == 0, stage == layout.pp - 1
    vocab = padded_vocab(c.vocab, layout.tp, recipe.vocab_multiple)
    mode = FakeTensorMode()
    with mode:
        model = _Stage(c, counts[stage], first, last, vocab,
                       layout.recompute == "full")
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _tp_plan(c))
    if first:
        parallelize_module(model.embed, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate()))
    if last:
        parallelize_module(model.head, tp_mesh, ColwiseParallel())
    tp_local = {name: _local(p).numel() for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=recipe.reduce_dtype)
    units = list(model.blocks) + [model]
    for unit in units:
        if layout.zero == 0:
            replicate(unit, mesh=dp_mesh, mp_policy=policy)
        else:
            fully_shard(unit, mesh=dp_mesh, mp_policy=policy,
                        reshard_after_forward=layout.zero == 3)
    names = {id(p): name for name, p in model.named_parameters()}
    fsdp = {names[id(fp.sharded_param)]: fp for fp in _fsdp_params(units)}
    shards = {name: (tuple(fp.padded_sharded_param_size), tuple(fp.sharded_size))
              for name, fp in fsdp.items()}
    fp32 = 4
    master = sum(math.prod(p) for p, _ in shards.values()) * fp32
    params = sum(tp_local.values())
    # what the fp32 shards hold beyond an exact 1/DP split (FSDP2's chunks of
    # ceil(rows / DP) rows, the last ranks' padded): 0 with ZeRO-0
    padding = (master / fp32 - params / layout.dp) * fp32 if layout.zero else 0.0
    layer_params = sum(n for name, n in tp_local.items()
                       if name.startswith("blocks.0."))

    groups = {mesh[d].get_group().group_name: (d, mesh[d].size())
              for d in ("pp", "dp", "tp")}
    recorder = _Recorder(groups)
    _tag(recorder, model)
    with mode, recorder:
        if first:
            x = torch.zeros(b, seq, dtype=torch.long)
        else:
            x = torch.zeros(b, seq, c.hidden, dtype=torch.bfloat16,
                            requires_grad=True)
        with warnings.catch_warnings():  # nothing writes in place into y
            warnings.filterwarnings("ignore", "FSDP2-wrapped module")
            y = model(x)
        compute_copy = sum(_nbytes(_local(p)) for p in model.parameters()
                           if p.dtype == torch.bfloat16)
        boundary = 0 if last else _nbytes(y)
        recorder.phase = "backward"
        y.backward(torch.ones_like(y))
        grads = sum(math.prod(shards[name][0]) * fp.sharded_param.grad.element_size()
                    for name, fp in fsdp.items())
        recorder.phase = "step"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        optimizer.step()
        state = sum(_nbytes(_local(t)) for s in optimizer.state.values()
                    for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))
    if layout.zero == 3:  # resharded after forward: the copy lives one unit at a time
        compute_copy = max(_nbytes(_local(p)) for p in model.parameters())
    if not first:
        boundary = max(boundary, _nbytes(x))
    return TwinReport(run, layout, rank, coords, counts, seq, b, params,
                      layer_params,
                      {PARAMETER: compute_copy, GRADIENT: grads,
                       OPTSTATE: master + state},
                      padding, shards, _tally(recorder.calls), boundary)


# -- the comparison with the calculator

@dataclass(frozen=True)
class Row:
    """One figure, twin beside calculator: difference = twin - calculator."""

    item: str
    twin: float
    calculator: float
    why: str

    @property
    def difference(self) -> float:
        return self.twin - self.calculator


def calculator(report: TwinReport) -> Estimate:
    """The calculator's estimate of the report's run and layout."""
    r = PUBLISHED_RUNS[report.run]
    return estimate(MODELS[r.model], report.layout, r.cluster, r.global_batch_tokens,
                    report.seq)


def compare(report: TwinReport, est: Estimate | None = None) -> list[Row]:
    """The twin's figures beside the calculator's closed forms for the same
    stage (theory.stage_params, zero_breakdown, zero_traffic, layer_traffic;
    for the busiest stage, `est`'s figures: by default calculator(report)),
    each with why they differ where they do: elements held, bytes by category,
    one layer's and the stage's DP and TP ring bytes, the pipeline's bytes per
    micro-batch."""
    est = calculator(report) if est is None else est
    layout, r = report.layout, PUBLISHED_RUNS[report.run]
    c, recipe = MODELS[r.model], RECIPES[report.run]
    psi = stage_params(c, layout, report.stage)
    m, n = layout.microbatches, layout.dp
    states = zero_breakdown(psi, n, layout.zero, param_bytes=2, grad_bytes=2)
    whole = "norms" + (", row biases and the position table" if c.biases else "")
    stage = (f"stage {report.stage} holds {report.stage_layers[report.stage]} "
             f"layers{' + the embedding' if report.stage == 0 else ''}"
             f"{' + the head' if report.stage == layout.pp - 1 else ''}, as the "
             f"calculator's stage does; TP keeps {whole} whole on every TP "
             "rank where the calculator divides them by TP")
    if recipe.vocab_multiple > 1:
        stage += (f"; the vocabulary is padded to "
                  f"{padded_vocab(c.vocab, layout.tp, recipe.vocab_multiple)}")
    if recipe.tied_head:
        stage += "; the last stage holds its own copy of the tied embeddings"
    zero_name = {0: "all_reduce (gradients)", 2: "reduce_scatter (gradients)",
                 3: "reduce_scatter (gradients)"}[layout.zero]
    grad_op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    layer_ag = [col for col in report.collectives if col.dim == "dp"
                and col.op == "all_gather" and col.phase == "forward"]
    one_layer_ag = next((col for col in layer_ag
                         if col.bytes == report.layer_params * 2), None)
    reduce_bytes = torch.finfo(recipe.reduce_dtype).bits // 8
    calc_tp_layer = layer_traffic(report.microbatch, report.seq, c.hidden,
                                  layout.tp).bytes_per_rank
    full = layout.recompute == "full"
    rows = [
        Row("elements held before ZeRO", report.params, psi, stage),
        Row(PARAMETER + " bytes (16-bit copy)", report.held[PARAMETER],
            states.parameter,
            "both 2 bytes per element; the difference is the elements' (above)"
            + ("; ZeRO-3 keeps one unit's copy at a time" if layout.zero == 3
               else "")),
        Row(GRADIENT + " bytes", report.held[GRADIENT], states.gradient,
            "FSDP2 keeps the reduced gradient in the sharded parameter's dtype, "
            "fp32 (4 bytes), where the calculator counts 2; plus FSDP2's padding "
            "and the elements' difference"),
        Row(OPTSTATE + " bytes", report.held[OPTSTATE], states.optstate,
            "fp32 master shard (FSDP2's sharded parameter, padded) + AdamW's "
            "exp_avg and exp_avg_sq (unpadded local shards): 12 bytes per "
            "element as the calculator's K = 12; the difference is padding and "
            "the elements'"),
        Row("FSDP2 padding bytes (fp32 shards)", report.padding, 0.0,
            f"FSDP2 pads dim 0 of each parameter to a multiple of DP {n}; the "
            "calculator divides exactly"),
    ]
    if layout.zero:
        rows.append(Row(
            "DP all_gather of one layer, ring bytes sent",
            one_layer_ag.sent / one_layer_ag.count if one_layer_ag else float("nan"),
            zero_traffic(report.layer_params, n, layout.zero)[
                "all_gather (parameters)"] if layout.zero < 3 else
            zero_traffic(report.layer_params, n, 3)[
                "all_gather (parameters, forward)"],
            "the same thing: (N-1)/N of the layer's 16-bit elements"))
        rows.append(Row(
            "DP all_gather per micro-batch, ring bytes sent",
            report.sent("dp", "all_gather", "forward"),
            # one all-gather of the stage's weights (ZeRO-2's, once a step)
            zero_traffic(psi, n, 2)["all_gather (parameters)"],
            "the stage's elements (TP's whole norms); FSDP2 gathers every "
            "micro-batch's forward, the calculator once a step (ZeRO-2)"))
    rows.append(Row(
        f"DP {grad_op} per micro-batch, ring bytes sent",
        report.sent("dp", grad_op, "backward"),
        zero_traffic(psi, n, layout.zero, 2)[zero_name],
        f"the gradients reduce in {recipe.reduce_dtype} ({reduce_bytes} bytes) "
        "where the calculator counts 2; and TP's whole norms"
        + ("" if layout.zero else "; replicate() reduces every "
                     "micro-batch, Megatron's DDP once a step")))
    rows.append(Row(
        "TP ring bytes of one layer per micro-batch",
        report.sent("tp", part="layer") / report.stage_layers[report.stage],
        calc_tp_layer * (1.5 if full else 1),
        "the same thing: 4 all-reduces of b·s·h 16-bit elements"
        + ("; with full recomputation the calculator adds the 2 of the "
           "recomputed forward, torch.utils.checkpoint (non-reentrant) stops "
           "recomputing once the saved tensors are back, before the MLP's "
           "all-reduce: 1" if full else "")))
    layers = report.stage_layers[report.stage]
    rows.append(Row(
        "TP ring bytes per micro-batch", report.sent("tp"),
        calc_tp_layer * (1.5 if full else 1) * layers,
        f"the calculator's layer figure x the stage's {layers} layers (its "
        "Estimate charges every stage ceil(layers / PP)); the vocabulary-"
        "parallel embedding all-reduces its output forward, the head its "
        "input's gradient backward, which the calculator leaves out"))
    if layout.pp > 1:
        sends = 2 - (report.stage in (0, layout.pp - 1))
        rows.append(Row(
            "PP bytes sent per micro-batch", sends * report.pipeline_bytes,
            est.traffic["pp"] / m,
            "the twin sends the stage's whole boundary tensor (no pipelining "
            "library ran: its shape is the stage's output) and the first and "
            "last stage one direction only; the calculator sends 1/TP of it "
            f"(scatter-gather) x interleave {layout.interleave}, both ways"))
    return rows
