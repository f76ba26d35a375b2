"""Models the parallel tests share: small, with every awkward case at once."""

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
