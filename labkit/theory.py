"""Closed forms, and nothing else: no torch.distributed, no measurement.

Units are explicit: sizes in bytes, times in seconds, bandwidths in bytes/second.
Use labkit.units (GB = 1e9, GiB = 2**30) to convert; nothing here mixes them.
Every formula names its source; tests/test_theory.py checks each against a
published number.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.conventions import BUS_FACTOR

# ----------------------------------------------------------------- collectives
#
# Bus factors: nccl-tests, doc/PERFORMANCE.md ("busBw = algBw * factor"):
#   all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
#   broadcast, reduce 1. For the ring algorithms the factor times the array size S
#   is also the number of bytes each rank sends (Patarasuk & Yuan 2009, "Bandwidth
#   optimal all-reduce algorithms for clusters of workstations": 2(n-1)/n * S is
#   the lower bound for all-reduce, reached by the ring). The table lives in
#   labkit.conventions, shared with the traffic ledger.

_FACTORS = {op: f for op, f in BUS_FACTOR.items()
            if op not in ("send", "recv", "barrier")}

# Steps (message latencies) of the ring algorithms (Thakur, Rabenseifner & Gropp
# 2005, "Optimization of Collective Communication Operations in MPICH", sec. 4):
# ring all-gather takes n-1 steps; ring all-reduce is a reduce-scatter then an
# all-gather, 2(n-1) steps; a pipelined chain broadcast n-1 steps.
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "scatter": lambda n: n - 1,
    "gather": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "reduce": lambda n: n - 1,
}
COLLECTIVES = tuple(_FACTORS)


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {n!r}")
    return n


def _check_op(op: str) -> str:
    if op not in _FACTORS:
        raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")
    return op


def _check_size(size) -> float:
    if size < 0:
        raise ValueError(f"a size in bytes cannot be negative, got {size}")
    return size


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n ranks (2(n-1)/n for all-reduce)."""
    return _FACTORS[_check_op(op)](_check_n(n))


def ring_bytes_per_rank(op: str, size: float, n: int) -> float:
    """Bytes each rank sends in the ring algorithm for an S-byte array:
    all-reduce 2(n-1)/n * S, all-gather / reduce-scatter (n-1)/n * S."""
    return bus_factor(op, n) * _check_size(size)


def ring_steps(op: str, n: int) -> int:
    """Sequential message steps of the ring algorithm (2(n-1) for all-reduce)."""
    return _STEPS[_check_op(op)](_check_n(n))


def alpha_beta_time(op: str, size: float, n: int, alpha: float, beta: float) -> float:
    """The α-β (latency-bandwidth) model of a ring collective:
    t = steps * α + bytes_per_rank / β  (Thakur et al. 2005, sec. 2; β in bytes/s)."""
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 s and beta > 0 bytes/s, got {alpha}, {beta}")
    return ring_steps(op, n) * alpha + ring_bytes_per_rank(op, size, n) / beta


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted α-β model of one collective on n ranks."""

    op: str
    n: int
    alpha: float  # seconds per step (latency)
    beta: float  # bytes per second (bandwidth)

    def time(self, size: float) -> float:
        return alpha_beta_time(self.op, size, self.n, self.alpha, self.beta)


def fit_alpha_beta(op: str, n: int, sizes, seconds) -> AlphaBeta:
    """Least-squares fit of t = steps*α + bytes_per_rank/β to measured (size, t).

    Both terms are linear in (α, 1/β); negative estimates are clamped to the
    smallest physical value (α = 0; β from the largest size alone)."""
    sizes, seconds = list(sizes), list(seconds)
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("need at least two (size, seconds) points of equal length")
    k = ring_steps(op, n)
    xs = [ring_bytes_per_rank(op, s, n) for s in sizes]
    # ordinary least squares for t = c + b*x, then α = c / steps, β = 1 / b
    m, sx, st = len(xs), sum(xs), sum(seconds)
    sxx = sum(x * x for x in xs)
    sxt = sum(x * t for x, t in zip(xs, seconds))
    den = m * sxx - sx * sx
    if den == 0:
        raise ValueError("sizes must not all be equal")
    b = (m * sxt - sx * st) / den
    c = (st - b * sx) / m
    if c < 0:  # no negative latency: refit through the origin
        c, b = 0.0, sxt / sxx
    if b <= 0:  # no infinite bandwidth: take the largest message alone
        big = max(range(m), key=lambda i: xs[i])
        b = max(seconds[big] - c, 1e-12) / xs[big]
    return AlphaBeta(op, n, alpha=c / k if k else 0.0, beta=1.0 / b)


# ------------------------------------------------------------ bytes per parameter
#
# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models", sec. 3.1: mixed-precision Adam keeps fp16/bf16 parameters and
# gradients (2 + 2 bytes) and fp32 master weights, momentum and variance (K = 12):
# 16 bytes per parameter. Megatron-LM's distributed-optimizer table (README,
# "Distributed Optimizer"): fp16 params and grads with fp32 main grads: 20 bytes;
# bf16 params with fp32 grads: 18; fp32 params and grads: 16.

_OPT_STATE = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}  # fp32 bytes


@dataclass(frozen=True)
class BytesPerParam:
    params: int
    grads: int
    optimizer: int  # K: master weights + the optimizer's own state
    grad_accum: int = 0  # an fp32 copy of the gradients, where one is kept

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.grad_accum


def bytes_per_param(optimizer: str = "adam", precision: str = "mixed",
                    fp32_grad_accum: bool = False) -> BytesPerParam:
    """Model-state bytes per parameter.

    precision "mixed": 16-bit params and grads, fp32 master weights (4) in the
    optimizer state; "fp32": everything fp32, no master copy. Adam/AdamW keep m and
    v (8 bytes), SGD with momentum 4, plain SGD nothing. fp32_grad_accum adds an
    fp32 gradient buffer (4), as Megatron's fp16 path does: 2 + 2 + 4 + 12 = 20.
    """
    if optimizer not in _OPT_STATE:
        raise ValueError(f"optimizer must be one of {sorted(_OPT_STATE)}, "
                         f"not {optimizer!r}")
    if precision == "mixed":
        return BytesPerParam(2, 2, 4 + _OPT_STATE[optimizer],
                             4 if fp32_grad_accum else 0)
    if precision == "fp32":
        if fp32_grad_accum:
            raise ValueError("fp32 training already accumulates gradients in fp32")
        return BytesPerParam(4, 4, _OPT_STATE[optimizer])
    raise ValueError(f"precision must be 'mixed' or 'fp32', not {precision!r}")


# ------------------------------------------------------------------------- ZeRO


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes of model state per device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def _check_params(psi) -> float:
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or psi < 0:
        raise ValueError(f"a parameter count must be a number >= 0, got {psi!r}")
    return psi


def _check_stage(stage) -> int:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain data parallel), 1, 2 or 3, "
                         f"got {stage!r}")
    return stage


def zero_breakdown(params: float, n_devices: int, stage: int, k: float = 12,
                   param_bytes: float = 2, grad_bytes: float = 2) -> ZeroMemory:
    """Per-device model states under ZeRO (Rajbhandari et al. 2020, sec. 5.1, fig. 1):
    stage 0 (DP) (2+2+K)Ψ; 1: 2Ψ+2Ψ+KΨ/N; 2: 2Ψ+(2+K)Ψ/N; 3: (2+2+K)Ψ/N."""
    psi, n, stage = _check_params(params), _check_n(n_devices), _check_stage(stage)
    if k < 0 or param_bytes < 0 or grad_bytes < 0:
        raise ValueError("bytes per parameter cannot be negative")
    p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
    return ZeroMemory(p / n if stage >= 3 else p, g / n if stage >= 2 else g,
                      o / n if stage >= 1 else o)


def zero_memory(params: float, n_devices: int, stage: int, k: float = 12,
                **kw) -> float:
    """Bytes of model state per device for ZeRO `stage` (0 = plain DP).
    Ψ = 7.5e9, N = 64, K = 12 gives the paper's 120 / 31.4 / 16.6 / 1.9 GB."""
    return zero_breakdown(params, n_devices, stage, k, **kw).total


def zero_traffic(params: float, n_devices: int, stage: int,
                 elem_bytes: float = 2) -> dict[str, float]:
    """Bytes each rank sends per step, by collective (ring algorithms, exact
    (N-1)/N factors). DP: all-reduce of the gradients, 2Ψ; ZeRO-1/2: reduce-scatter
    of the gradients + all-gather of the updated parameters, also 2Ψ; ZeRO-3: an
    all-gather of the parameters in forward and again in backward + the
    reduce-scatter, 3Ψ (Rajbhandari et al. 2020, sec. 7.2-7.3)."""
    psi, n, stage = _check_params(params), _check_n(n_devices), _check_stage(stage)
    share = (n - 1) / n * psi * elem_bytes
    if stage == 0:
        return {"all_reduce (gradients)": 2 * share}
    if stage in (1, 2):
        return {"reduce_scatter (gradients)": share,
                "all_gather (parameters)": share}
    return {"all_gather (parameters, forward)": share,
            "all_gather (parameters, backward)": share,
            "reduce_scatter (gradients)": share}


# ------------------------------------------------------------------ activations


def activation_memory(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                      sp: bool = False, recompute: str = "none",
                      attention_scores: bool = True) -> float:
    """Activation bytes per transformer layer, 16-bit activations (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", table 2):

        none, t = 1           sbh (34 + 5as/h)
        tensor parallel t     sbh (10 + 24/t + 5as/(ht))
        + sequence parallel   sbh/t (34 + 5as/h)
        selective recompute   drops the 5as/h attention term
        full recompute        2sbh, the layer's input only (/t with sequence parallel)

    attention_scores=False drops the 5as/h term too (FlashAttention never stores
    the s x s scores)."""
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden),
                    ("heads", heads), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    if heads % tp or hidden % tp:
        raise ValueError(f"tensor parallel {tp} must divide heads {heads} and "
                         f"hidden {hidden}")
    if sp and seq % tp:
        raise ValueError(f"sequence parallel needs seq {seq} divisible by tp {tp}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', "
                         f"not {recompute!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 5 * a * s / h if attention_scores and recompute == "none" else 0.0
    if sp or t == 1:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


# --------------------------------------------------------------------- pipelines


@dataclass(frozen=True)
class Bubble:
    of_total: float  # idle fraction of the whole step
    of_ideal: float  # idle time relative to the ideal (bubble-free) compute time


def pipeline_bubble(p: int, m: int, v: int = 1) -> Bubble:
    """Pipeline bubble for p stages, m micro-batches, v interleaved chunks per stage.

    Idle time is (p-1)/v micro-batch slots against m of work (GPipe, Huang et al.
    2019; 1F1B and the interleaved schedule, Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec.
    2.2): of_ideal = (p-1)/(v m); of_total = (p-1)/(v m + p - 1), which for v = 1
    is (p-1)/(m+p-1)."""
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {x!r}")
    return Bubble(of_total=(p - 1) / (v * m + p - 1), of_ideal=(p - 1) / (v * m))


def activations_in_flight(schedule: str, p: int, m: int) -> int:
    """Micro-batches whose activations the first stage holds at its peak: GPipe
    runs all m forwards first (m); 1F1B starts backwards after p (min(p, m))."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
    pipeline_bubble(p, m)  # validates p and m
    return m if schedule == "gpipe" else min(p, m)


# ------------------------------------------------------------------------ models


@dataclass(frozen=True)
class ModelConfig:
    """A transformer's shape, enough to count its parameters exactly."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # MLP inner size (a dense layer's, for MoE models)
    vocab: int
    gated_mlp: bool = True  # SwiGLU: 3 matrices; GELU MLP: 2
    biases: bool = False
    norm: str = "rmsnorm"  # "layernorm" has a bias too
    tied_embeddings: bool = False
    learned_positions: int = 0  # rows of a learned position table (GPT-2/3)
    seq: int = 2048  # training context, for activation estimates
    # mixture of experts (DeepSeek-V3 style): the first `dense_layers` are dense
    experts: int = 0
    shared_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    # multi-head latent attention (DeepSeek-V2/V3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0


MODELS = {
    # Radford et al. 2019; HF "gpt2": 124,439,808 parameters
    "gpt2-small": ModelConfig("GPT-2 small", 12, 768, 12, 12, 3072, 50257,
                              gated_mlp=False, biases=True, norm="layernorm",
                              tied_embeddings=True, learned_positions=1024, seq=1024),
    # Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, 2048 context
    "gpt3-175b": ModelConfig("GPT-3 175B", 96, 12288, 96, 96, 4 * 12288, 50257,
                             gated_mlp=False, biases=True, norm="layernorm",
                             tied_embeddings=True, learned_positions=2048),
    # Llama Team 2024, "The Llama 3 Herd of Models", table 3; vocabulary 128,256
    "llama3-8b": ModelConfig("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, seq=8192),
    "llama3-70b": ModelConfig("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256,
                              seq=8192),
    "llama3-405b": ModelConfig("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256,
                               seq=8192),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 4.2 (and its config)
    "deepseek-v3": ModelConfig("DeepSeek-V3", 61, 7168, 128, 128, 18432, 129280,
                               seq=4096, experts=256, shared_experts=1,
                               experts_per_token=8, expert_ffn=2048, dense_layers=3,
                               q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128,
                               qk_rope_dim=64, v_head_dim=128),
}

PUBLISHED_PARAMS = {  # what each source reports, for the tests
    "gpt2-small": 124e6, "gpt3-175b": 175e9, "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "deepseek-v3": 671e9,
}


def _attention_params(c: ModelConfig) -> int:
    h = c.hidden
    if c.kv_lora_rank:  # multi-head latent attention
        qk = c.qk_nope_dim + c.qk_rope_dim
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.heads * qk
        kv = (h * (c.kv_lora_rank + c.qk_rope_dim) + c.kv_lora_rank
              + c.kv_lora_rank * c.heads * (c.qk_nope_dim + c.v_head_dim))
        return q + kv + c.heads * c.v_head_dim * h
    head = h // c.heads
    q_out, kv_out = h, 2 * c.kv_heads * head
    n = h * (q_out + kv_out) + h * h
    return n + (q_out + kv_out + h if c.biases else 0)


def _mlp_params(c: ModelConfig, inner: int) -> int:
    mats = 3 if c.gated_mlp else 2
    return mats * c.hidden * inner + ((inner + c.hidden) if c.biases else 0)


def param_count(config: ModelConfig | str, active: bool = False) -> int:
    """Parameters of a model, counted from its shape; active=True counts only those
    one token uses (for MoE: the shared and the top-k routed experts)."""
    c = MODELS[config] if isinstance(config, str) else config
    norm = c.hidden * (2 if c.norm == "layernorm" else 1)
    embed = c.vocab * c.hidden * (1 if c.tied_embeddings else 2)
    embed += c.learned_positions * c.hidden
    total = embed + norm  # + the final norm
    for layer in range(c.layers):
        total += _attention_params(c) + 2 * norm
        if c.experts and layer >= c.dense_layers:
            routed = c.experts_per_token if active else c.experts
            total += (routed + c.shared_experts) * _mlp_params(c, c.expert_ffn)
            total += c.experts * c.hidden + c.experts  # router weights and bias
        else:
            total += _mlp_params(c, c.ffn)
    return total


# ------------------------------------------------------------ placement semantics
#
# Mehta 2026, "Placement Semantics for Distributed Deep Learning" (arXiv 2601.02311):
# a strategy is where it places four training states - parameters P, optimizer
# state O, gradients G, activations A - each in one of five modes; two conditions,
# gradient integrity and state consistency, are necessary and sufficient for the
# result to match single-device training. We could read only the paper's abstract;
# the byte and traffic accounting below is the ZeRO paper's (sec. 5 and 7), written
# per mode, and reproduces the abstract's figures (ZeRO-3: 8x less memory than DP
# at 1.5x the communication, N = 8) and the 1120 GB of model state of a 70B model.

MODES = ("Replicated", "Sharded", "ShardedWithGather", "Materialized", "Offloaded")
_MODE_NOTES = {
    "Replicated": "every device holds all of it",
    "Sharded": "each device holds 1/N and never the whole",
    "ShardedWithGather": "each device holds 1/N; gathered whole just when used",
    "Materialized": "nothing kept: created when needed, freed after",
    "Offloaded": "kept in host memory, moved over PCIe when used",
}


@dataclass(frozen=True)
class PlacementCost:
    persistent: dict[str, float]  # state -> bytes kept on each device between steps
    peak: dict[str, float]  # state -> bytes at its largest during a step
    traffic: dict[str, float]  # collective -> bytes each device sends per step
    pcie: float  # bytes each device moves to or from host memory per step

    @property
    def persistent_total(self) -> float:
        return sum(self.persistent.values())

    @property
    def peak_total(self) -> float:
        return sum(self.peak.values())

    @property
    def traffic_total(self) -> float:
        return sum(self.traffic.values())


@dataclass(frozen=True)
class Verdict:
    ok: bool
    problems: tuple[str, ...]

    def __str__(self) -> str:
        return "correct" if self.ok else "incorrect: " + "; ".join(self.problems)


@dataclass(frozen=True)
class Placement:
    """Where P, O, G and A live. grad_sync ("all_reduce", "reduce_scatter" or
    None) and param_sync ("all_gather" or None) default to what the modes need."""

    P: str = "Replicated"
    O: str = "Replicated"  # noqa: E741
    G: str = "Replicated"
    A: str = "Replicated"
    grad_sync: str | None = "auto"
    param_sync: str | None = "auto"
    name: str = ""

    def __post_init__(self):
        for state in "POGA":
            if getattr(self, state) not in MODES:
                raise ValueError(f"{state} must be one of {MODES}, "
                                 f"not {getattr(self, state)!r}")
        if self.grad_sync not in ("auto", "all_reduce", "reduce_scatter", None):
            raise ValueError(f"grad_sync must be 'all_reduce', 'reduce_scatter' or "
                             f"None, not {self.grad_sync!r}")
        if self.param_sync not in ("auto", "all_gather", None):
            raise ValueError(f"param_sync must be 'all_gather' or None, "
                             f"not {self.param_sync!r}")

    # what the modes imply ----------------------------------------------------

    def _owned_optimizer(self) -> bool:  # each device updates only its shard
        return self.O in ("Sharded", "ShardedWithGather", "Offloaded")

    def gradient_sync(self) -> str | None:
        if self.grad_sync != "auto":
            return self.grad_sync
        sharded = self._owned_optimizer() or self.G in ("Sharded", "ShardedWithGather")
        return "reduce_scatter" if sharded else "all_reduce"

    def parameter_sync(self) -> str | None:
        if self.param_sync != "auto":
            return self.param_sync
        # replicated parameters updated shard by shard must be gathered again
        return "all_gather" if self.P == "Replicated" and self._owned_optimizer() \
            else None

    # the two correctness conditions ---------------------------------------------

    def check(self) -> Verdict:
        """Gradient integrity: every gradient the optimizer applies is reduced over
        the whole global batch. State consistency: after the step every device's
        view of the parameters is the same. Plus: a data-parallel forward needs the
        whole of each layer's parameters at some point."""
        problems = []
        if self.gradient_sync() is None:
            what = "sharded gradients" if self.G in ("Sharded", "ShardedWithGather") \
                else "gradients"
            problems.append(
                f"gradient integrity: {what} are never reduced across devices, so "
                "each device applies the gradient of its own micro-batch only")
        if self.P == "Replicated" and self._owned_optimizer() and \
                self.parameter_sync() is None:
            problems.append(
                "state consistency: each device updates only its shard of the "
                "replicated parameters and nothing gathers the rest, so the "
                "replicas drift apart")
        if self.gradient_sync() == "reduce_scatter" and self.O == "Replicated":
            problems.append(
                "state consistency: the optimizer is replicated but each device "
                "holds the reduced gradient of its shard only; the replicas update "
                "with different gradients")
        if self.P == "Sharded":
            problems.append(
                "parameters are sharded and never gathered: no device can run a "
                "layer's forward on its own batch (that needs tensor parallelism, "
                "chapter 09, or ShardedWithGather)")
        return Verdict(not problems, tuple(problems))

    # memory and traffic -----------------------------------------------------------

    def cost(self, params: float, n_devices: int, *, k: float = 12,
             param_bytes: float = 2, grad_bytes: float = 2, activations: float = 0.0,
             gather_fraction: float = 1.0) -> PlacementCost:
        """Bytes per device (persistent and peak) and traffic per step for Ψ =
        `params` on N devices. `activations`: one device's activation bytes when
        Replicated (its own micro-batch). `gather_fraction`: the largest share of a
        gathered state held whole at once (1/L when gathering one of L layers)."""
        psi, n = _check_params(params), _check_n(n_devices)
        if not 0 < gather_fraction <= 1:
            raise ValueError(
                f"gather_fraction must be in (0, 1], got {gather_fraction}")
        if activations < 0:
            raise ValueError("activations cannot be negative")
        full = {"P": param_bytes * psi, "O": k * psi, "G": grad_bytes * psi,
                "A": float(activations)}
        persistent, peak = {}, {}
        for state, size in full.items():
            mode = getattr(self, state)
            keep = {"Replicated": size, "Sharded": size / n,
                    "ShardedWithGather": size / n, "Materialized": 0.0,
                    "Offloaded": 0.0}[mode]
            transient = {"ShardedWithGather": gather_fraction * size * (1 - 1 / n),
                         "Materialized": gather_fraction * size,
                         "Offloaded": gather_fraction * size / n}.get(mode, 0.0)
            if state == "A":  # activations live only inside a step
                keep, transient = 0.0, keep + transient
            persistent[state], peak[state] = keep, keep + transient
        share = (n - 1) / n * psi
        traffic = {}
        sync = self.gradient_sync()
        if sync == "all_reduce":
            traffic["all_reduce (gradients)"] = 2 * share * grad_bytes
        elif sync == "reduce_scatter":
            traffic["reduce_scatter (gradients)"] = share * grad_bytes
        if self.P == "ShardedWithGather":
            traffic["all_gather (parameters, forward)"] = share * param_bytes
            traffic["all_gather (parameters, backward)"] = share * param_bytes
        if self.parameter_sync() == "all_gather":
            traffic["all_gather (parameters, after the step)"] = share * param_bytes
        pcie = 0.0
        if self.O == "Offloaded":  # gradients down, updated parameters back up
            pcie += (grad_bytes + param_bytes) * psi / n
        if self.P == "Offloaded":
            pcie += 2 * param_bytes * psi / n
        return PlacementCost(persistent, peak, traffic, pcie)

    def describe(self) -> str:
        return "\n".join(f"{s}: {getattr(self, s):<18} {_MODE_NOTES[getattr(self, s)]}"
                         for s in "POGA")


PLACEMENTS = {
    "DP": Placement("Replicated", "Replicated", "Replicated", "Replicated", name="DP"),
    "ZeRO-1": Placement("Replicated", "Sharded", "Replicated", "Replicated",
                        name="ZeRO-1"),
    "ZeRO-2": Placement("Replicated", "Sharded", "Sharded", "Replicated",
                        name="ZeRO-2"),
    "ZeRO-3": Placement("ShardedWithGather", "Sharded", "Sharded", "Replicated",
                        name="ZeRO-3"),
    "FSDP": Placement("ShardedWithGather", "Sharded", "Sharded", "Replicated",
                      name="FSDP"),
    "ZeRO-Offload": Placement("Replicated", "Offloaded", "Sharded", "Replicated",
                              name="ZeRO-Offload"),
}
