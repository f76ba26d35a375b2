"""The course's transformer in one process: the modules every parallel technique
splits, in one activation layout and with one attention.

    layer = TransformerLayer(h, a)                # [s, b, h] -> [s, b, h]
    model = TinyGPT(vocab=64, seq=16, hidden=32, heads=4)    # (b, s) -> (b, s, V)
    loss = lm_loss(model(tokens), targets)

Imports torch and labkit.theory. Activations are [s, b, h], sequence first, as
Megatron-LM lays them out, so a sequence shard is a slice of dim 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.theory import RECOMPUTE  # the modes the closed form prices

__all__ = ["MLP", "Embedding", "GPTBlock", "Head", "SelfAttention", "TinyGPT",
           "TransformerLayer", "attention", "dropout", "lm_loss", "merge_heads",
           "split_heads"]


# -- functions ----------------------------------------------------------------------


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that keeps a 1-byte (bool) mask for backward, as fused GPU kernels
    do; F.dropout on CPU keeps a mask of x's dtype (2 bytes in bf16)."""
    if not training or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]  # x's shape


def attention(q, k, v, causal: bool = False, scale: float | None = None,
              p: float = 0.0, training: bool = True, positions=None):
    """softmax(q kᵀ·scale [+ causal mask]), dropout p, times v: (..., s, d) each ->
    (..., s, d); scale 1/√d unless given. Every s x s score is materialized, and
    autograd keeps q and k (for q kᵀ), the softmax output, the dropout mask and
    output, and v. The causal mask is added (-inf above the diagonal), which keeps
    nothing for backward, where a masked_fill would keep its mask.
    positions: (q_pos (c,), k_pos (s,)), each row's place in the sequence, for
    rows that are not the sequence's first in order (a context-parallel rank's
    chunks, allgather_attention): a query sees the keys at or before it.
    Written out, not fused, so that autograd keeps what Korthikanti et al. 2022
    count in table 2; ring attention's blocks are the one attention that does
    not call it (it is their reference)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., c, s)
    if causal and positions is None:  # q's rows are the sequence's first rows
        rows, cols = scores.shape[-2:]
        mask = torch.full((rows, cols), float("-inf"), dtype=scores.dtype,
                          device=scores.device).triu(1)  # (c, s)
        scores = scores + mask  # (..., c, s)
    elif causal:
        q_pos, k_pos = (t.to(scores.device) for t in positions)  # (c,), (s,)
        mask = torch.zeros(q_pos.shape[0], k_pos.shape[0], dtype=scores.dtype,
                           device=scores.device)  # (c, s)
        mask.masked_fill_(q_pos[:, None] < k_pos[None, :], float("-inf"))
        scores = scores + mask  # (..., c, s)
    probs = dropout(torch.softmax(scores, dim=-1), p, training)  # (..., s, s)
    return torch.matmul(probs, v)  # (..., s, d)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[s, b, n·d] -> (b, n, s, d), a view: the heads become a batch dimension.
    n is read from x, so a tensor-parallel rank's n/t heads split the same way."""
    s, b = x.shape[:2]
    return x.view(s, b, -1, head_dim).permute(1, 2, 0, 3)  # (b, n, s, d)


def merge_heads(o: torch.Tensor) -> torch.Tensor:
    """(b, n, s, d) -> [s, b, n·d] (a copy): the heads side by side again."""
    b, n, s, d = o.shape
    return o.permute(2, 0, 1, 3).reshape(s, b, n * d)  # (s, b, n·d)


def lm_loss(logits, targets):
    """Next-token cross entropy, the mean over every position: (b, s, V), (b, s)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # ()


def head_dim_of(hidden: int, heads: int) -> int:
    """hidden / heads, the width of one attention head, or a ValueError when heads
    do not divide hidden; SelfAttention's and the tensor-parallel one's rule."""
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden = {hidden} is not divisible by heads = {heads}: "
                         "every head needs hidden / heads features")
    return hidden // heads


def check_recompute(recompute: str) -> str:
    """`recompute` if it is one of RECOMPUTE (what a layer may recompute in its
    backward), else a ValueError naming them; TransformerLayer's and
    ParallelTransformerLayer's one rule."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    return recompute


# -- a transformer layer --------------------------------------------------------------


class MLP(nn.Module):
    """A transformer's MLP in one process: fc2(gelu(fc1(x))), (..., h) -> (..., h)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn_hidden), nn.Linear(ffn_hidden,
                                                                      hidden)

    def forward(self, x):  # (..., h)
        return self.fc2(F.gelu(self.fc1(x)))  # (..., f) -> (..., h)


class SelfAttention(nn.Module):
    """Multi-head self-attention in one process, [s, b, h] -> [s, b, h]: q, k, v
    and the output projection `proj` are nn.Linear(h, h); head i is features
    [i*d, (i+1)*d), d = h / heads. The number of heads is read from q's output
    (split_heads), so the module also runs on PyTorch's DTensor shards."""

    def __init__(self, hidden: int, heads: int, causal: bool = True):
        super().__init__()
        self.head_dim = head_dim_of(hidden, heads)
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden)
                                             for _ in range(4))

    def forward(self, x):  # (s, b, h)
        q, k, v = (split_heads(m(x), self.head_dim)
                   for m in (self.q, self.k, self.v))  # (b, n, s, d) each
        o = attention(q, k, v, self.causal)  # (b, n, s, d)
        return self.proj(merge_heads(o))  # (s, b, h)


class TransformerLayer(nn.Module):
    """A pre-LayerNorm GPT layer in one process, [s, b, h] -> [s, b, h]:
    x + drop(proj(attention(ln1(x)))), then + drop(fc2(gelu(fc1(ln2(x))))).
    `attn` is a SelfAttention and `mlp` an MLP (their weights; the attention runs
    here, through `attention` with dropout p inside). recompute="selective"
    checkpoints `attention` (q kᵀ, softmax, dropout, ·V), "full" the whole layer
    from its input (the modes of Korthikanti et al. 2022, table 2)."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None,
                 dropout: float = 0.0, causal: bool = True, recompute: str = "none"):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal)
        self.mlp = MLP(hidden, ffn_hidden or 4 * hidden)
        self.p, self.causal = dropout, causal
        self.recompute = check_recompute(recompute)

    def _column(self, linear: nn.Module, x):  # (s, b, h) -> (s, b, out)
        return linear(x)

    def _qkv(self, x):  # (s, b, h) -> three (b, n, s, d)
        a = self.attn
        return [split_heads(m(x), a.head_dim) for m in (a.q, a.k, a.v)]

    def _attention(self, x):  # (s, b, h)
        args = (*self._qkv(x), self.causal, None, self.p, self.training)
        if self.recompute == "selective" and torch.is_grad_enabled():
            o = checkpoint(attention, *args, use_reentrant=False)  # (b, n, s, d)
        else:
            o = attention(*args)  # (b, n, s, d)
        return self.attn.proj(merge_heads(o))  # (s, b, h)

    def _mlp(self, x):  # (s, b, h)
        return self.mlp.fc2(F.gelu(self._column(self.mlp.fc1, x)))  # (s, b, h)

    def _layer(self, x):  # (s, b, h)
        x = x + dropout(self._attention(self.ln1(x)), self.p,
                        self.training)  # (s, b, h)
        return x + dropout(self._mlp(self.ln2(x)), self.p, self.training)  # (s, b, h)

    def forward(self, x):  # (s, b, h)
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._layer, x, use_reentrant=False)  # (s, b, h)
        return self._layer(x)  # (s, b, h)


# -- a tiny GPT ---------------------------------------------------------------------


class Embedding(nn.Module):
    """Token plus learned position embedding: token ids (b, s) -> [s, b, h], the
    one place a TinyGPT turns its batch-first input sequence first."""

    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids):  # (b, s)
        pos = self.pos.weight[: ids.shape[1], None]  # (s, 1, h)
        return self.tok(ids.t()) + pos  # (s, b, h)


class GPTBlock(TransformerLayer):
    """TinyGPT's block: a TransformerLayer with a 4h MLP, causal, no dropout and
    no recomputation, [s, b, h] -> [s, b, h]."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads)


class Head(nn.Module):
    """Final LayerNorm and the output projection: [s, b, h] -> logits (b, s, V),
    batch first again, as the (b, s) targets are."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):  # (s, b, h)
        return self.out(self.ln(x).transpose(0, 1))  # (b, s, h) -> (b, s, V)


class TinyGPT(nn.Sequential):
    """Embedding, `layers` blocks, head: layers + 2 modules in a row, which a
    pipeline cuts into stages ("0" is the embedding, "layers + 1" the head).
    Token ids (b, s) -> logits (b, s, V); between the modules [s, b, h]."""

    def __init__(self, vocab: int = 64, seq: int = 16, hidden: int = 32,
                 heads: int = 4, layers: int = 2):
        super().__init__(Embedding(vocab, seq, hidden),
                         *(GPTBlock(hidden, heads) for _ in range(layers)),
                         Head(hidden, vocab))
        self.vocab, self.seq, self.hidden = vocab, seq, hidden
        self.heads, self.n_blocks = heads, layers
