"""Models the parallel tests share: small, with every awkward case at once."""

from functools import partial

import torch
from torch import nn

V, D, H = 13, 12, 25  # vocabulary, width, hidden


class TiedFrozenNet(nn.Module):
    """Tied embedding and head, a frozen layer, a buffer, a tiny `gain`
    parameter; sizes 156, 300, 25, 300, 12, 2: most not multiples of 4."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)
        self.gain = nn.Parameter(torch.tensor([1.0, 0.0]))
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))

    def forward(self, tok):  # (B, T) -> (B, T, V)
        h = self.embed(tok) * self.scale
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.frozen(h) * self.gain[0] + self.gain[1])


# -- a small decoder-only transformer with the patterns real model files have ---------
#
# GPT-2's layout (tied token embedding and output head, learned positions, pre-norm
# blocks) or, with llama=True, Llama's (RMSNorm, rotary angles in a non-persistent
# buffer, a gated MLP, an untied head). Every block also owns a cross-attention
# projection that a decoder-only forward never calls (its parameters get no
# gradient), and the forward takes keyword arguments. `checkpoint` recomputes each
# block in backward: "forward" checkpoints inside Block.forward (module hooks stay
# outside the recompute), "call" checkpoints block.__call__ from the parent (hooks
# run again in the recompute); `reentrant` picks torch.utils.checkpoint's mode.


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate(x, cos, sin):  # (B, heads, T, d): rotate pairs of the last dimension
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, llama: bool, checkpoint: str | None,
                 reentrant: bool):
        super().__init__()
        norm = RMSNorm if llama else nn.LayerNorm
        self.heads, self.llama = heads, llama
        self.checkpoint, self.reentrant = checkpoint, reentrant
        self.ln1, self.ln2 = norm(d), norm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=not llama)
        self.proj = nn.Linear(d, d, bias=not llama)
        self.cross_kv = nn.Linear(d, 2 * d)  # only with encoder states: never here
        if llama:
            self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=not llama)
        self.down = nn.Linear(2 * d, d, bias=not llama)

    def forward(self, x, *, rope=None, encoder_states=None):
        if self.checkpoint == "forward" and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint
            return checkpoint(self._forward, x, rope, encoder_states,
                              use_reentrant=self.reentrant)
        return self._forward(x, rope, encoder_states)

    def _forward(self, x, rope, encoder_states):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        if encoder_states is not None:
            ck, cv = self.cross_kv(encoder_states).chunk(2, -1)
            x = x + nn.functional.scaled_dot_product_attention(x, ck, cv)
        h = self.ln2(x)
        h = (nn.functional.silu(self.gate(h)) * self.up(h) if self.llama
             else nn.functional.gelu(self.up(h)))
        return x + self.down(h)


class TinyGPT(nn.Module):
    """vocab 37, width 16, 2 heads, `layers` blocks, sequences up to 8 tokens."""

    def __init__(self, layers: int = 2, *, llama: bool = False,
                 checkpoint: str | None = None, reentrant: bool = False,
                 vocab: int = 37, d: int = 16, heads: int = 2, ctx: int = 8):
        super().__init__()
        if checkpoint not in (None, "forward", "call"):
            raise ValueError(f"checkpoint: None, 'forward' or 'call', "
                             f"not {checkpoint!r}")
        self.llama, self.checkpoint, self.reentrant = llama, checkpoint, reentrant
        self.wte = nn.Embedding(vocab, d)
        if llama:
            half = torch.arange(0, d // heads, 2, dtype=torch.float32)
            angles = torch.outer(torch.arange(ctx, dtype=torch.float32),
                                 10000.0 ** (-half / (d // heads)))
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        else:
            self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, llama, checkpoint, reentrant)
                                    for _ in range(layers))
        self.ln_f = RMSNorm(d) if llama else nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if not llama:
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, input_ids, *, labels=None):
        T = input_ids.shape[1]
        h = self.wte(input_ids)
        rope = None
        if self.llama:
            rope = (self.cos[:T], self.sin[:T])
        else:
            h = h + self.wpe(torch.arange(T, device=input_ids.device))
        for block in self.blocks:
            if self.checkpoint == "call" and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint
                h = checkpoint(partial(block.__call__, rope=rope), h,
                               use_reentrant=self.reentrant)
            else:
                h = block(h, rope=rope)
        logits = self.lm_head(self.ln_f(h))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
