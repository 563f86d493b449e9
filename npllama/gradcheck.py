"""Numerical gradient checks: central differences against a hand-written backward.

For any op pair, contract the output with a random upstream gradient dy, so the scalar
f(inputs) = sum(op_forward(inputs) * dy) has gradient op_backward(dy) with respect to each input.
Central differences (f(x + h e_i) - f(x - h e_i)) / 2h estimate it with O(h**2) error; in float64,
h = 1e-6 leaves about 1e-10 of truncation and rounding error.

    >>> import numpy as np
    >>> from npllama import ops
    >>> from npllama.gradcheck import gradcheck
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.standard_normal((2, 3, 8)), rng.standard_normal(8)
    >>> errors = gradcheck(lambda x, w: ops.rmsnorm_forward(x, w, 1e-5), ops.rmsnorm_backward, x, w)
    >>> all(e < 1e-7 for e in errors)
    True
"""

from __future__ import annotations

import numpy as np

from .errors import NpllamaError


def rel_error(a, b, floor=1e-300) -> float:
    """||a - b|| / max(||a||, ||b||, floor): a norm-based relative error that stays meaningful near 0.

    floor: the size below which a gradient counts as zero, so that 1e-17 against an exact 0
    (rounding, not error) is not reported as a relative error of 1.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(np.linalg.norm(a), np.linalg.norm(b), floor)
    return float(np.linalg.norm(a - b) / scale)


def numerical_grad(f, x, h=1e-6, indices=None, points=3):
    """Central-difference gradient of the scalar function f() with respect to array x, perturbed in place.

    indices: None for every element, or an iterable of flat indices (the rest are left 0).
    points: 3, the central difference (f(x + h) - f(x - h)) / 2h, whose error is about
    h**2 f^(3) / 6 plus the rounding of f divided by h; or 5, the five-point stencil
    (8 (f(x + h) - f(x - h)) - (f(x + 2h) - f(x - 2h))) / 12h, whose error is about
    h**4 f^(5) / 30, so that h can be larger (2.5e-4 rather than 1e-6) and divides f's rounding
    by far less: on a float64 loss near 6, ~1e-12 of noise instead of ~1e-9.
    """
    if points not in (3, 5):
        raise NpllamaError(f"points={points!r}: use 3 (central difference) or 5 (five-point stencil)")
    grad = np.zeros_like(x, dtype=np.float64)
    flat_x, flat_g = x.reshape(-1), grad.reshape(-1)
    assert np.shares_memory(flat_x, x), "x must be contiguous so it can be perturbed in place"
    steps = (1, 2) if points == 5 else (1,)
    for i in (range(x.size) if indices is None else indices):
        old = flat_x[i]
        differences = []                   # f(x + k h) - f(x - k h) for each k in steps
        for k in steps:
            flat_x[i] = old + k * h
            f_plus = f()
            flat_x[i] = old - k * h
            f_minus = f()
            differences.append(f_plus - f_minus)
        flat_x[i] = old
        flat_g[i] = (differences[0] / (2 * h) if points == 3
                     else (8 * differences[0] - differences[1]) / (12 * h))
    return grad


def gradcheck(forward, backward, *inputs, seed=0, h=1e-6, floor=1e-8):
    """Relative error of backward's gradient for each array input of forward, in float64.

    floor: gradients smaller than this in norm count as zero (see rel_error); with inputs of
    order 1, as here, a true gradient is either exactly zero or far above it.
    forward(*inputs) -> (y, cache); backward(dy, cache) -> gradients in the order of inputs
    (a single array when there is one input). Integer inputs (token ids) are skipped with error 0.
    Returns a list of relative errors, one per input.
    """
    inputs = [np.array(x, dtype=np.float64) if np.asarray(x).dtype.kind == "f" else np.asarray(x)
              for x in inputs]
    y, cache = forward(*inputs)
    dy = np.random.default_rng(seed).standard_normal(np.shape(y))
    analytic = backward(dy, cache)
    if not isinstance(analytic, (tuple, list)):
        analytic = (analytic,)
    float_inputs = [x for x in inputs if x.dtype.kind == "f"]
    assert len(analytic) == len(float_inputs), f"{len(analytic)=} gradients for {len(float_inputs)=} float inputs"
    errors, grads = [], iter(analytic)
    for x in inputs:
        if x.dtype.kind != "f":
            errors.append(0.0)
            continue
        numeric = numerical_grad(lambda: float(np.sum(forward(*inputs)[0] * dy)), x, h)
        errors.append(rel_error(next(grads), numeric, floor))
    return errors


def assert_grad_close(analytic, numeric, tol=1e-6, name="gradient"):
    """Raise AssertionError showing the worst entries side by side when rel_error > tol."""
    err = rel_error(analytic, numeric)
    if err > tol:
        a, n = np.asarray(analytic, np.float64).ravel(), np.asarray(numeric, np.float64).ravel()
        worst = np.argsort(-np.abs(a - n))[:5]
        rows = "\n".join(f"  [{i}] analytic {a[i]: .10e}  numeric {n[i]: .10e}" for i in worst)
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.0e}; worst entries:\n{rows}")
    return err
