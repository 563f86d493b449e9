"""LoRA fine-tuning of the reference model: frozen weights, low-rank adapters, the chain rule.

Each adapted projection W (out, in) of every block gets two small matrices, and acts as

    W' = W + s B A,     A (r, in),  B (out, r),  s = alpha / r          (Hu et al. 2021)

while W itself never changes (ops/lora.py runs x W^T + s (x A^T) B^T without forming W').
The adapters are a flat dict keyed like the parameters they adapt:

    layers.{i}.attention.wq.lora_a   (r, D)          layers.{i}.attention.wq.lora_b   (H*Dh, r)

for each target among wq, wk, wv, wo (attention) and w1, w2, w3 (feed-forward). A starts as
PEFT's: uniform in +-1/sqrt(in) (torch's kaiming_uniform_ with a = sqrt(5)); B starts at 0, so
an adapted model starts exactly where its base is.

    spec = LoraSpec(rank=8, alpha=16, targets=("wq", "wv"))
    adapters = init_adapters(config, spec, seed=0)
    logits = forward(params, adapters, config, spec, tokens)                      # (B, T, V)
    loss, grads = loss_and_grads(params, adapters, config, spec, tokens, targets)   # keyed like adapters
    merged = merge(params, adapters, spec)      # W + s B A: an ordinary model, for export

The blocks are the reference's own (model.block_forward / block_backward): an adapted weight
is an `Adapted` in the block's LayerWeights, which the block runs through the LoRA op, and the
model-level chain rule is model.loss_and_grads's. npllama.engine runs the same arithmetic
faster, never forming the frozen weights' gradients (tested equal in float64).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

from . import model
from .checks import check_dtype, check_int, check_real
from .config import LlamaConfig
from .model import LAYER_PARAM_NAMES, Adapted, LayerWeights, LoraGrads
from .errors import NpllamaError

# The projections LoRA can adapt, in the order of a block's LayerWeights.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass(frozen=True)
class LoraSpec:
    """Which projections get adapters, and their size: W' = W + (alpha / rank) B A."""
    rank: int = 8                          # r: 0 means no adapters (the base model unchanged)
    alpha: float = 16.0                    # s = alpha / r scales the adapters' output
    targets: tuple[str, ...] = LORA_TARGETS   # short names of the adapted projections (all by default)

    def __post_init__(self):
        check_int("lora rank", self.rank, 0)
        check_real("lora alpha", self.alpha, 0.0, low_open=True)
        targets = tuple(self.targets.split(",")) if isinstance(self.targets, str) else tuple(self.targets)
        targets = tuple(t.strip() for t in targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise NpllamaError(f"LoRA targets {list(targets)} must be distinct names among {list(LORA_TARGETS)} "
                             f"(unknown: {unknown}), e.g. wq,wv or wq,wk,wv,wo,w1,w2,w3")
        # the block's order, whatever order they were given in, so names and files are canonical
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))

    @property
    def scale(self) -> float:
        """s = alpha / r (0 without adapters)."""
        return self.alpha / self.rank if self.rank else 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LoraSpec":
        try:
            d = json.loads(text)
            return cls(rank=d["rank"], alpha=d["alpha"], targets=tuple(d["targets"]))
        except (ValueError, KeyError, TypeError) as e:
            raise NpllamaError(f"LoRA settings {text!r} are unusable: {e}") from None


def weight_name(i: int, target: str) -> str:
    """The Meta name of block i's adapted weight, e.g. layers.0.attention.wq.weight."""
    return f"layers.{i}.{LAYER_PARAM_NAMES[target]}"


def adapter_names(i: int, spec: LoraSpec) -> list[str]:
    """Block i's adapter names, A then B for each target in block order."""
    return [weight_name(i, t).removesuffix(".weight") + f".lora_{m}" for t in spec.targets for m in "ab"]


def adapter_shapes(config: LlamaConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapter's name and shape: A (r, in), B (out, r) of each adapted W (out, in)."""
    if spec.rank == 0:
        return {}
    shapes, weights = {}, config.param_shapes()
    for i in range(config.n_layers):
        names = iter(adapter_names(i, spec))
        for t in spec.targets:
            out_features, in_features = weights[weight_name(i, t)]
            shapes[next(names)] = (spec.rank, in_features)
            shapes[next(names)] = (out_features, spec.rank)
    return shapes


def init_adapters(config: LlamaConfig, spec: LoraSpec, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """A ~ Uniform(-1/sqrt(in), 1/sqrt(in)), B = 0 (PEFT's init: the adapted model starts as its base).

    The bound is torch.nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)) times
    sqrt(3 / in). Drawn in float64 in the order of adapter_shapes, then rounded to dtype.
    """
    dtype = check_dtype(dtype)
    rng = np.random.default_rng(seed)
    adapters = {}
    for name, shape in adapter_shapes(config, spec).items():
        if name.endswith(".lora_a"):
            bound = 1.0 / math.sqrt(shape[1])
            adapters[name] = rng.uniform(-bound, bound, shape).astype(dtype)
        else:
            adapters[name] = np.zeros(shape, dtype=dtype)
    return adapters


def check_adapters(adapters: dict, config: LlamaConfig, spec: LoraSpec, source: str = "adapters") -> None:
    """ValueError listing every missing, unexpected or misshapen adapter at once."""
    expected = adapter_shapes(config, spec)
    missing = [n for n in expected if n not in adapters]
    unexpected = [n for n in adapters if n not in expected]
    misshapen = [f"{n}: {tuple(np.shape(adapters[n]))}, expected {expected[n]}"
                 for n in expected if n in adapters and tuple(np.shape(adapters[n])) != expected[n]]
    problems = [f"{what} {names}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shapes", misshapen)) if names]
    if problems:
        raise NpllamaError(f"{source} do not fit LoRA rank {spec.rank} on {','.join(spec.targets)} of this model: "
                         + "; ".join(problems))


def merge(params: dict, adapters: dict, spec: LoraSpec) -> dict[str, np.ndarray]:
    """The params with every adapted W replaced by W + s B A (new arrays); the rest are the same arrays."""
    merged = dict(params)
    for name in adapters:
        if name.endswith(".lora_a"):
            stem = name.removesuffix(".lora_a")
            w = params[stem + ".weight"]
            merged[stem + ".weight"] = w + (spec.scale * (adapters[stem + ".lora_b"] @ adapters[name])).astype(w.dtype)
    return merged


# ----------------------------------------------------------------------------- the adapted model

def adapted_layer(params: dict, adapters: dict, spec: LoraSpec, i: int) -> LayerWeights:
    """Block i's weights, with each adapted projection an Adapted(W, A, B, s)."""
    w = model.layer_weights(params, i)
    if spec.rank == 0:
        return w
    adapted = {}
    for t in spec.targets:
        stem = weight_name(i, t).removesuffix(".weight")
        adapted[t] = Adapted(getattr(w, t), adapters[stem + ".lora_a"], adapters[stem + ".lora_b"], spec.scale)
    return w._replace(**adapted)


def adapted_layers(params: dict, adapters: dict, config: LlamaConfig, spec: LoraSpec) -> list[LayerWeights]:
    """Every block's weights with their adapters, for model.forward / model.loss_and_grads(layers=...)."""
    return [adapted_layer(params, adapters, spec, i) for i in range(config.n_layers)]


def forward(params: dict, adapters: dict, config: LlamaConfig, spec: LoraSpec, tokens, *, rope=None):
    """Logits (B, T, V) of the adapted model: model.forward with the adapted layers."""
    return model.forward(params, config, tokens, rope=rope, layers=adapted_layers(params, adapters, config, spec))[0]


def loss_and_grads(params: dict, adapters: dict, config: LlamaConfig, spec: LoraSpec, tokens, targets, *,
                   rope=None, checkpointing: bool = False):
    """Mean cross-entropy of the adapted model, and its gradient for every adapter (none for params).

    The chain rule is model.loss_and_grads's, on the adapted layers: an adapted weight's entry in
    its result is the LoraGrads(dA, dB) of lora_backward, and the frozen weights' gradients,
    which the reference forms as usual, are dropped here (the engine never forms them).
    Inputs:  as model.loss_and_grads. Returns: loss (python float), grads keyed and shaped like adapters.
    """
    layers = adapted_layers(params, adapters, config, spec)
    loss, grads = model.loss_and_grads(params, config, tokens, targets, rope=rope, layers=layers,
                                       checkpointing=checkpointing)
    kept = {}
    for name, g in grads.items():
        if isinstance(g, LoraGrads):
            stem = name.removesuffix(".weight")
            kept[stem + ".lora_a"], kept[stem + ".lora_b"] = g.a, g.b
    return loss, {name: kept[name] for name in adapters}
