"""AdamW, gradient clipping and the learning-rate schedule, all in place on dicts of arrays.

Interface (CS231n optim.py style, stated once): parameters and gradients are dicts
{name: ndarray} with the same keys and shapes (Meta names, as `Llama.params` and
`Llama.loss_and_grads` produce them). The optimizer keeps its state (step count t,
first moment m, second moment v) apart from its hyper-parameters and updates the
parameter arrays in place, so `model.params` always holds the current weights.

    opt = AdamW(model.params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loss, grads = model.loss_and_grads(x, y)
    total = clip_grad_norm(grads, 1.0)     # scales grads in place; returns the norm before
    opt.step(grads, lr=lr_at(step, lr=1e-3, warmup_steps=100, decay_steps=5000, min_lr=1e-4))
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import numpy as np

from .checks import check_int, check_real
from .errors import NpllamaError


class AdamW:
    """torch.optim.AdamW on a dict of NumPy arrays, updated in place.

    One step with gradient g (per array, t counted from 1; t is incremented *before* the
    bias corrections, as torch does, so the first step uses t = 1):

        t  <- t + 1
        p  <- p * (1 - lr * weight_decay)              only when p.ndim >= 2 (matrices)
        m  <- beta1 * m + (1 - beta1) * g
        v  <- beta2 * v + (1 - beta2) * g * g
        p  <- p - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The weight decay is decoupled (Loshchilov & Hutter): it shrinks the weights directly
    rather than entering g, and it is applied before the Adam update with the same lr, as
    in torch.optim.AdamW. As in nanoGPT's `configure_optimizers` (and unlike llm.c's C
    update, which decays everything), arrays with ndim < 2 -- the RMSNorm weights -- are
    never decayed; embeddings and linear weights are. eps sits after the square root.

    Moments live in the parameters' dtype (float32 models keep float32 moments), with one
    scratch array per parameter allocated once, so a step allocates nothing.
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        if not isinstance(params, Mapping) or not params:
            raise NpllamaError("AdamW needs a non-empty dict {name: ndarray} of parameters, "
                             f"got {type(params).__name__}; pass model.params")
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or not np.issubdtype(p.dtype, np.floating):
                raise NpllamaError(f"parameter {name!r} must be a floating-point np.ndarray, "
                                 f"got {type(p).__name__} {getattr(p, 'dtype', '')}")
            if not p.flags.writeable:
                raise NpllamaError(f"parameter {name!r} is read-only; AdamW updates parameters in place")
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise NpllamaError(f"betas={betas!r} must be a pair (beta1, beta2)") from None
        self.lr = check_real("lr", lr, 0.0)
        self.beta1 = check_real("beta1", beta1, 0.0, 1.0, high_open=True)
        self.beta2 = check_real("beta2", beta2, 0.0, 1.0, high_open=True)
        self.eps = check_real("eps", eps, 0.0)
        self.weight_decay = check_real("weight_decay", weight_decay, 0.0)
        self.params = params
        self.step_count = 0                                       # t: steps taken so far
        self.exp_avg = {n: np.zeros_like(p) for n, p in params.items()}     # m
        self.exp_avg_sq = {n: np.zeros_like(p) for n, p in params.items()}  # v
        self._scratch = {n: np.empty_like(p) for n, p in params.items()}
        self.decayed = {n: p.ndim >= 2 for n, p in params.items()}

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def _check_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        if grads.keys() != self.params.keys():
            missing = sorted(self.params.keys() - grads.keys())
            unexpected = sorted(grads.keys() - self.params.keys())
            raise NpllamaError(f"grads do not match the parameters: missing {missing}, unexpected {unexpected}; "
                             "pass the grads dict that model.loss_and_grads returned")
        bad = [f"{n}: grad {np.shape(g)} vs param {self.params[n].shape}"
               for n, g in grads.items() if np.shape(g) != self.params[n].shape]
        if bad:
            raise NpllamaError("gradient shapes differ from the parameters: " + "; ".join(bad))

    def step(self, grads: Mapping[str, np.ndarray], lr: float | None = None) -> None:
        """Apply one AdamW update to every parameter in place (see the class docstring).

        lr, when given, is used for this step only (the schedule passes lr_at(step) here);
        the stored self.lr is unchanged. grads are read, never modified.
        """
        self._check_grads(grads)
        lr = self.lr if lr is None else check_real("lr", lr, 0.0)
        self.step_count += 1
        scalars = self.step_scalars(lr)
        for name, p in self.params.items():
            adamw_update(p, grads[name], self.exp_avg[name], self.exp_avg_sq[name], self._scratch[name],
                         self.decayed[name], scalars)

    def step_scalars(self, lr: float) -> "StepScalars":
        """The numbers of the update at step t = self.step_count with this lr."""
        t = self.step_count
        return StepScalars(self.beta1, self.beta2, self.eps, lr / (1.0 - self.beta1 ** t),
                           1.0 / math.sqrt(1.0 - self.beta2 ** t), 1.0 - lr * self.weight_decay)

    def state_dict(self) -> dict:
        """A flat dict of python scalars and array copies that load_state_dict restores exactly.

        Keys: "step" (int t), "lr", "beta1", "beta2", "eps", "weight_decay" (floats), and for
        every parameter name n: "exp_avg.<n>" (m) and "exp_avg_sq.<n>" (v). The arrays are
        copies, so later steps do not change a dict already taken.
        """
        sd: dict = {"step": int(self.step_count), "lr": self.lr, "beta1": self.beta1, "beta2": self.beta2,
                    "eps": self.eps, "weight_decay": self.weight_decay}
        for n in self.params:
            sd[f"exp_avg.{n}"] = self.exp_avg[n].copy()
            sd[f"exp_avg_sq.{n}"] = self.exp_avg_sq[n].copy()
        return sd

    def load_state_dict(self, sd: Mapping) -> None:
        """Restore step count, moments and hyper-parameters from state_dict()'s output.

        Everything is validated before anything changes: the moment names must be exactly
        those of the parameters, their shapes must match, the step a non-negative int and
        the hyper-parameters valid; otherwise ValueError lists every problem at once.
        Moments are copied into this optimizer's own arrays (cast to the parameters' dtype).
        """
        if not isinstance(sd, Mapping):
            raise NpllamaError(f"load_state_dict needs the dict that state_dict() returned, got {type(sd).__name__}")
        scalar_keys = ("step", "lr", "beta1", "beta2", "eps", "weight_decay")
        problems = [f"missing {k!r}" for k in scalar_keys if k not in sd]
        expected = {f"{kind}.{n}" for n in self.params for kind in ("exp_avg", "exp_avg_sq")}
        array_keys = set(sd.keys()) - set(scalar_keys)
        if expected - array_keys:
            problems.append(f"missing moments {sorted(expected - array_keys)}")
        if array_keys - expected:
            problems.append(f"unexpected keys {sorted(array_keys - expected)} (a state dict of another model?)")
        for key in sorted(expected & array_keys):
            name = key.split(".", 1)[1]
            shape = np.shape(sd[key])
            if shape != self.params[name].shape:
                problems.append(f"{key} has shape {shape}, parameter {name!r} has {self.params[name].shape}")
        step = sd.get("step", 0)
        if isinstance(step, np.ndarray) and step.ndim == 0:
            step = step.item()
        try:
            check_int("step", step, 0)
        except ValueError as e:
            problems.append(str(e))
        hyper = {}
        for key, low, high in (("lr", 0.0, math.inf), ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0),
                               ("eps", 0.0, math.inf), ("weight_decay", 0.0, math.inf)):
            if key in sd:
                try:
                    value = sd[key]
                    if isinstance(value, np.ndarray) and value.ndim == 0:
                        value = value.item()
                    hyper[key] = check_real(key, value, low, high, high_open=True)
                except ValueError as e:
                    problems.append(str(e))
        if problems:
            raise NpllamaError("optimizer state does not fit this optimizer: " + "; ".join(problems))
        for n in self.params:
            np.copyto(self.exp_avg[n], sd[f"exp_avg.{n}"], casting="unsafe")
            np.copyto(self.exp_avg_sq[n], sd[f"exp_avg_sq.{n}"], casting="unsafe")
        self.step_count = int(step)
        for key, value in hyper.items():
            setattr(self, key, value)


class StepScalars(NamedTuple):
    """The scalars of one AdamW step t (the same for every array)."""
    beta1: float
    beta2: float
    eps: float
    step_size: float         # lr / (1 - beta1**t)
    inv_sqrt_bc2: float      # 1 / sqrt(1 - beta2**t)
    decay: float             # 1 - lr * weight_decay


def adamw_update(p, g, m, v, s, decayed: bool, c: StepScalars) -> None:
    """One AdamW update of p (an array, or any piece of one) in place, given its gradient g.

    m, v: its moments, updated in place; s: a scratch array of p's shape; decayed: whether
    weight decay applies (matrices only). The same operations, in the same order, for every
    element, so updating an array whole or piece by piece gives the same bits.
    """
    if decayed and c.decay != 1.0:
        p *= c.decay
    # m <- m + (1 - beta1) * (g - m), torch's lerp form of beta1 * m + (1 - beta1) * g
    np.subtract(g, m, out=s)
    s *= 1.0 - c.beta1
    m += s
    # v <- beta2 * v + (1 - beta2) * g^2
    np.multiply(g, g, out=s)
    s *= 1.0 - c.beta2
    v *= c.beta2
    v += s
    # p <- p - step_size * m / (sqrt(v) / sqrt(bc2) + eps)
    np.sqrt(v, out=s)
    s *= c.inv_sqrt_bc2
    s += c.eps
    np.divide(m, s, out=s)
    s *= c.step_size
    p -= s


def _l2_norm(x: np.ndarray) -> float:
    """||x||_2 as a python float, without overflowing float32 squares for huge entries."""
    flat = x.reshape(-1)
    with np.errstate(over="ignore"):
        total = math.sqrt(float(np.dot(flat, flat)))
    if math.isinf(total) and np.all(np.isfinite(flat)):
        # the squares overflowed though every entry is finite: rescale by the largest entry
        scale = float(np.max(np.abs(flat)))
        scaled = flat.astype(np.float64) / scale
        total = scale * math.sqrt(float(np.dot(scaled, scaled)))
    return total


def clip_grad_norm(grads: Mapping[str, np.ndarray], max_norm: float) -> float:
    """Scale every gradient array in place so their joint L2 norm is at most max_norm.

    As torch.nn.utils.clip_grad_norm_ (norm_type=2):
        total = sqrt(sum over arrays of ||g||^2)
        coef  = max_norm / (total + 1e-6);   g <- g * coef   only when coef < 1
    Returns total, the norm *before* clipping, as a python float.

    A non-finite total (a NaN or inf anywhere in grads) is returned as is and the gradients
    are left untouched -- torch would multiply them by NaN; the caller is expected to check
    math.isfinite(total) and skip the step or stop (`npllama train` stops with a message).
    max_norm=inf measures the norm without clipping.
    """
    if isinstance(max_norm, (bool, np.bool_)) or not isinstance(max_norm, (int, float, np.integer, np.floating)) \
            or math.isnan(max_norm) or max_norm <= 0:   # inf is allowed here: measure without clipping
        raise NpllamaError(f"max_norm={max_norm!r} must be a positive number (inf measures without clipping)")
    if not isinstance(grads, Mapping):
        raise NpllamaError(f"clip_grad_norm needs a dict {{name: ndarray}} of gradients, got {type(grads).__name__}")
    for name, g in grads.items():
        if not isinstance(g, np.ndarray) or not np.issubdtype(g.dtype, np.floating):
            raise NpllamaError(f"gradient {name!r} must be a floating-point np.ndarray (it is scaled in place), "
                             f"got {type(g).__name__}")
    norms = [_l2_norm(g) for g in grads.values()]
    if any(math.isnan(n) for n in norms):
        return math.nan
    top = max(norms, default=0.0)
    if math.isinf(top):
        return math.inf
    # the norm of the per-array norms (torch's stack-then-norm), scaled by the largest so
    # float64 squares cannot overflow
    total = top * math.sqrt(math.fsum((n / top) ** 2 for n in norms)) if top > 0 else 0.0
    coef = float(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for g in grads.values():
            g *= coef
    return total


def lr_at(step: int, lr: float, warmup_steps: int, decay_steps: int, min_lr: float) -> float:
    """Learning rate for `step` (0-based: the step about to be taken): linear warm-up, cosine decay, floor.

        step < warmup_steps:                 lr * (step + 1) / warmup_steps
        warmup_steps <= step < decay_steps:  min_lr + 0.5 * (1 + cos(pi * r)) * (lr - min_lr),
                                             r = (step - warmup_steps) / (decay_steps - warmup_steps)
        step >= decay_steps:                 min_lr

    So the first step runs at lr / warmup_steps, step warmup_steps - 1 at the full lr, the
    cosine starts at lr at step warmup_steps and ends at min_lr at step decay_steps (the
    shape of nanoGPT's get_lr, with llm.c's (step + 1) warm-up so step 0 is not lr = 0).
    warmup_steps=0 starts the cosine at once; decay_steps <= warmup_steps keeps lr flat
    after the warm-up.
    """
    check_int("step", step, 0)
    check_int("warmup_steps", warmup_steps, 0)
    check_int("decay_steps", decay_steps, 0)
    lr = check_real("lr", lr, 0.0)
    min_lr = check_real("min_lr", min_lr, 0.0)
    if min_lr > lr:
        raise NpllamaError(f"min_lr={min_lr} is above lr={lr}; the cosine decays from lr down to min_lr")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_steps <= warmup_steps:
        return lr
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
