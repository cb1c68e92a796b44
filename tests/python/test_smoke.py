import torch

import automagic


def test_fused_linear_updates_and_frees_grad():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    before = m.weight.detach().clone()
    opt = automagic.Automagic3(m.parameters())
    m(torch.randn(8, 4)).pow(2).mean().backward()
    assert m.weight.grad is None
    assert opt.state[m.weight]["step"] == 1
    assert not torch.equal(before, m.weight.detach())
