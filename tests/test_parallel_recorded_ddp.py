"""labkit.parallel.recorded_ddp: PyTorch's DDP recording its step's spans, on 4
real gloo ranks, for a model whose output is a tensor, a tuple or a dict."""

import pytest
import torch
from torch import nn


class _Out(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        y = self.b(torch.tanh(h))
        return {"tensor": y, "tuple": (y, h), "dict": {"y": y, "h": h}}[self.kind]


def _step(rank, world_size, kind):
    from labkit.parallel.recorded_ddp import RecordedDDP

    torch.manual_seed(0)
    ddp = RecordedDDP(_Out(kind))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    spans = []
    for _ in range(2):  # the second step's spans replace the first's
        out = ddp(x)
        y = out if kind == "tensor" else (out[0] if kind == "tuple" else out["y"])
        y.square().sum().backward()
        spans.append([(s.kind, s.name, s.nbytes, s.end >= s.start)
                      for s in ddp.events])
    return spans


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_a_step_records_one_backward_and_every_bucket(cluster, kind):
    params = 4 * 8 + 8 + 8 * 2 + 2  # one bucket: DDP's first holds them all
    for rank, steps in enumerate(cluster.run(_step, kind)):
        for i, spans in enumerate(steps):
            kinds = sorted((k, name) for k, name, _, _ in spans)
            assert kinds == [("comm", "all_reduce bucket 0"),
                             ("compute", "backward")], (
                f"{kind} output, rank {rank}, step {i}: spans {spans}; expected one "
                "backward and one bucket's all-reduce")
            comm = next(s for s in spans if s[0] == "comm")
            assert comm[2] == 4 * params, (
                f"rank {rank}, step {i}: the bucket carried {comm[2]} B; "
                f"expected {4 * params} B (every gradient, fp32)")
            assert all(ok for *_, ok in spans), f"a span ends before it starts: {spans}"
