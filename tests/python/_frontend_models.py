"""A small but realistic model (Embedding, Conv2d, LayerNorm, Linear) and
helpers shared by the front-end tests (tests/python/test_frontend*.py)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ, BATCH = 40, 16, 5, 6


class Net(nn.Module):
    """tokens (B,T) and images (B,3,6,6) -> logits (B,VOCAB).

    tied: the head shares the embedding's weight.
    ckpt: None, "reentrant" or "nonreentrant": the block is activation-
          checkpointed; the block's `shared` Linear is also used outside it,
          so with "reentrant" its hook fires twice per backward.
    """

    def __init__(self, tied=False, ckpt=None, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM + 4, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.ckpt = ckpt
        self.to(dtype)

    def block(self, h):
        return self.ln(torch.tanh(self.shared(h)))

    def forward(self, tokens, images=None):
        h = self.emb(tokens).mean(1)                              # (B, D)
        if images is not None:
            c = self.conv(images).mean((2, 3))                    # (B, 4)
        else:
            c = h.new_zeros(h.shape[0], 4)
        h = torch.tanh(self.fc(torch.cat([h, c], 1)))             # (B, D)
        if self.ckpt is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.ckpt == "reentrant")
        h = h + 0.5 * self.shared(h)
        return self.head(h)                                       # (B, VOCAB)


def batches(n, seed=0, dtype=torch.float32, images_every=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        images = torch.randn(BATCH, 3, 6, 6, generator=g).to(dtype)
        target = torch.randint(0, VOCAB, (BATCH,), generator=g)
        out.append((tokens, images if i % images_every == 0 else None, target))
    return out


def loss_of(model, batch):
    tokens, images, target = batch
    return F.cross_entropy(model(tokens, images).float(), target)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def assert_same_state(s1, s2, name=None):
    """Two parameters' optimizer states (dicts) bit-identical."""
    assert s1.keys() == s2.keys(), name
    for k in s1:
        v1, v2 = s1[k], s2[k]
        if isinstance(v1, torch.Tensor):
            assert v1.dtype == v2.dtype and torch.equal(v1, v2), (name, k)
        else:
            assert v1 == v2, (name, k)


def assert_same(m1, o1, m2, o2):
    """Parameters and optimizer state bit-identical."""
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
        assert_same_state(o1.state.get(a, {}), o2.state.get(b, {}), n)


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in opt.state.get(p, {}).items()}
             for i, p in enumerate(model.parameters())}
    return params, state


def assert_unchanged(model, opt, snap):
    params, state = snap
    for i, (p, q) in enumerate(zip(model.parameters(), params)):
        assert torch.equal(p.detach(), q), i
        now = opt.state.get(p, {})
        assert now.keys() == state[i].keys(), i
        for k, v in state[i].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(now[k], v), (i, k)
            else:
                assert now[k] == v, (i, k)
