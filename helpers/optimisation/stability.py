"""How large a learning rate can be, and why one rate for every layer is a problem (lecture 05).

    lam = top_hessian_eigenvalue(model, loss_fn)   # the sharpness: plain GD diverges past 2/lam
    ratios = trust_ratios(model)                   # |w| / |grad w| per tensor, after a backward

For a quadratic loss ½ wᵀAw, gradient descent multiplies the error along A's top eigenvector
by (1 - lr λ_max) each step: it shrinks only while lr < 2/λ_max. Near a minimum a network's loss
is close to such a quadratic, its Hessian playing A, so 2/λ_max is the largest stable rate
there (with heavy-ball momentum μ the bound is 2(1 + μ)/λ_max). A larger batch makes the
gradient less noisy, but it does not make the valley wider: the linear scaling rule meets this
wall. The sharpness is not fixed either: it changes along training, and full-batch gradient
descent tends to raise it until it reaches 2/lr (Cohen et al. 2021, "the edge of stability").
LARS (You et al. 2017) sizes each layer's step by |w|/|g| instead of one rate for all.
"""

from __future__ import annotations

import torch


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def top_hessian_eigenvalue(model, loss_fn, iters: int = 30, seed: int = 0) -> float:
    """λ_max of the Hessian of ``loss_fn(model)`` (a scalar) with respect to the parameters, by
    power iteration on Hessian-vector products (double backward; the Hessian is never built).
    Power iteration finds the eigenvalue largest in *magnitude*; the step bound 2/λ needs the
    largest positive one. Near a minimum they are the same; a negative result means a direction
    of negative curvature dominates, and 2/λ then bounds nothing (the caller should say so).
    Few iterations underestimate |λ| when the top two eigenvalues are close."""
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    norm = _flat(v).norm()
    v = [t / norm for t in v]
    grads = torch.autograd.grad(loss_fn(model), params, create_graph=True)
    lam = 0.0
    for _ in range(iters):
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        lam = (_flat(hv) @ _flat(v)).item()  # Rayleigh quotient: v is a unit vector
        norm = _flat(hv).norm()
        if norm == 0:
            return 0.0
        v = [t / norm for t in hv]
    return lam


def trust_ratios(model) -> list[dict]:
    """Per parameter tensor after a backward: |w|, |grad|, and the LARS trust ratio |w|/|grad|
    (You et al. 2017, before its coefficient η and weight decay): how far one global learning
    rate moves each layer relative to its own size."""
    rows = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        w, g = p.detach().norm().item(), p.grad.detach().norm().item()
        rows.append(
            {
                "tensor": name,
                "shape": tuple(p.shape),
                "|w|": w,
                "|grad|": g,
                "|w| / |grad|": w / g if g > 0 else float("inf"),
            }
        )
    return rows
