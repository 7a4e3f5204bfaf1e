"""helpers.stability: the sharpness by power iteration equals the Hessian's top eigenvalue
computed in full, and gradient descent's bound 2/λ_max holds on either side; trust ratios are
the norms they say."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import helpers
from helpers.optimisation import stability as st


def _regression(n=64, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, d).double()
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def test_the_sharpness_of_least_squares_is_its_hessians_top_eigenvalue():
    x, y = _regression()
    model = nn.Linear(6, 1, bias=False).double()
    lam = st.top_hessian_eigenvalue(model, lambda m: F.mse_loss(m(x), y), iters=200)
    hessian = 2 * x.T @ x / len(x)  # of mean((xw - y)^2)
    assert lam == pytest.approx(torch.linalg.eigvalsh(hessian).max().item(), rel=1e-6)


@pytest.mark.parametrize("factor, converges", [(0.9, True), (1.1, False)])
def test_gradient_descent_converges_below_two_over_the_sharpness_and_not_above(factor, converges):
    x, y = _regression()
    model = nn.Linear(6, 1, bias=False).double()
    loss = lambda m: F.mse_loss(m(x), y)  # noqa: E731
    lam = st.top_hessian_eigenvalue(model, loss, iters=200)
    opt = torch.optim.SGD(model.parameters(), lr=factor * 2 / lam)
    first = loss(model).item()
    for _ in range(300):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
    assert (loss(model).item() < first) is converges


def test_the_sharpness_of_a_network_matches_the_full_hessian():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(20, 3, dtype=torch.float64)
    y = torch.randint(2, (20,))
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    flat = torch.cat([p.detach().reshape(-1) for p in params])

    def loss_of(vec):
        out, i = x, 0
        chunks = []
        for s in shapes:
            n = s.numel()
            chunks.append(vec[i : i + n].view(s))
            i += n
        out = torch.tanh(out @ chunks[0].T + chunks[1]) @ chunks[2].T + chunks[3]
        return F.cross_entropy(out, y)

    hessian = torch.autograd.functional.hessian(loss_of, flat)
    top = torch.linalg.eigvalsh(hessian).abs().max().item()
    lam = st.top_hessian_eigenvalue(model, lambda m: F.cross_entropy(m(x), y), iters=100)
    assert abs(lam) == pytest.approx(top, rel=1e-4)


def test_trust_ratios_are_the_norms_of_each_tensor_and_its_gradient():
    torch.manual_seed(0)
    model = helpers.models.mlp(hidden=8, depth=2)
    x, y = torch.randn(5, 1, 8, 8), torch.randint(10, (5,))
    F.cross_entropy(model(x), y).backward()
    rows = st.trust_ratios(model)
    named = dict(model.named_parameters())
    assert [r["tensor"] for r in rows] == list(named)
    for r in rows:
        p = named[r["tensor"]]
        assert r["|w|"] == pytest.approx(p.norm().item())
        assert r["|grad|"] == pytest.approx(p.grad.norm().item())
        assert r["|w| / |grad|"] == pytest.approx(p.norm().item() / p.grad.norm().item())
    model.zero_grad(set_to_none=True)
    assert st.trust_ratios(model) == []  # no backward yet: nothing to say
