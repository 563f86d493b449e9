"""LlamaConfig: the blueprint of a LLaMA-2 model, validated once, read everywhere.

Derived sizes follow the notation of `npllama.ops`: Dh = head_dim = dim // n_heads,
R = n_rep = n_heads // n_kv_heads (query heads per key/value head), F = hidden_dim.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .checks import check_int, check_real, dataclass_from_dict, parse_json
from .errors import NpllamaError


def meta_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta model.py FeedForward: 4*dim -> int(2/3 *) -> * ffn_dim_multiplier -> round up to multiple_of.

    The 2/3 keeps SwiGLU's three matrices at the parameter count of a 4*dim two-matrix MLP.
    """
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64                     # D: width of the residual stream
    n_layers: int = 2                 # L: transformer blocks
    n_heads: int = 4                  # H: query heads
    n_kv_heads: int | None = None     # KVH: key/value heads (grouped-query attention); None means n_heads
    vocab_size: int = 65              # V: 65 is TinyShakespeare's character set
    hidden_dim: int | None = None     # F: SwiGLU width; None resolves by Meta's rule (meta_hidden_dim)
    multiple_of: int = 32             # Meta's rule rounds F up to a multiple of this (256 in Llama 2 itself)
    ffn_dim_multiplier: float | None = None  # Meta's rule scales F by this before rounding (Llama 2 70B: 1.3)
    norm_eps: float = 1e-5            # RMSNorm epsilon, inside the square root
    rope_theta: float = 10000.0       # RoPE base: frequency of pair i is rope_theta ** (-2i / Dh)
    max_seq_len: int = 256            # longest sequence: RoPE table length and KV-cache capacity
    tie_embeddings: bool = False      # True: output.weight is tok_embeddings.weight (one array, gradients summed)

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        object.__setattr__(self, "n_kv_heads", check_int("n_kv_heads", self.n_kv_heads, 1))
        if self.n_heads % self.n_kv_heads:
            raise NpllamaError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs whole groups of query heads per key/value head")
        if self.dim % self.n_heads:
            raise NpllamaError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                               "each head takes dim // n_heads features")
        if self.head_dim % 2:
            raise NpllamaError(f"head_dim = dim // n_heads = {self.head_dim} is odd; "
                               "RoPE rotates features in pairs (2i, 2i+1), so it must be even")
        if self.ffn_dim_multiplier is not None:
            object.__setattr__(self, "ffn_dim_multiplier", check_real(
                "ffn_dim_multiplier", self.ffn_dim_multiplier, 0.0, low_open=True, hint=" (or None)"))
        if self.hidden_dim is None:
            object.__setattr__(self, "hidden_dim",
                               meta_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier))
        object.__setattr__(self, "hidden_dim", check_int("hidden_dim", self.hidden_dim, 1))
        for name in ("norm_eps", "rope_theta"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), 0.0, low_open=True))
        if not isinstance(self.tie_embeddings, bool):
            raise NpllamaError(f"tie_embeddings={self.tie_embeddings!r} must be True or False")

    @property
    def head_dim(self) -> int:
        """Dh: features per head."""
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """R: query heads sharing one key/value head (llama2.c's kv_mul)."""
        return self.n_heads // self.n_kv_heads

    def cache_positions(self, positions: int | None = None) -> int:
        """S, the positions a KV cache holds: `positions` when given (a generation's prompt and fed
        tokens), else max_seq_len."""
        return self.max_seq_len if positions is None else positions

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's Meta name and shape, in a fixed order (init and file layouts use it)."""
        D, F, V, Dh = self.dim, self.hidden_dim, self.vocab_size, self.head_dim
        shapes = {"tok_embeddings.weight": (V, D)}
        for i in range(self.n_layers):
            shapes.update({
                f"layers.{i}.attention_norm.weight": (D,),
                f"layers.{i}.attention.wq.weight": (self.n_heads * Dh, D),
                f"layers.{i}.attention.wk.weight": (self.n_kv_heads * Dh, D),
                f"layers.{i}.attention.wv.weight": (self.n_kv_heads * Dh, D),
                f"layers.{i}.attention.wo.weight": (D, self.n_heads * Dh),
                f"layers.{i}.ffn_norm.weight": (D,),
                f"layers.{i}.feed_forward.w1.weight": (F, D),
                f"layers.{i}.feed_forward.w2.weight": (D, F),
                f"layers.{i}.feed_forward.w3.weight": (F, D),
            })
        shapes["norm.weight"] = (D,)
        if not self.tie_embeddings:
            shapes["output.weight"] = (V, D)
        return shapes

    def n_params(self) -> int:
        """The number of parameters, sum(prod(shape)) over param_shapes(), in closed form: no
        per-layer loop, so it is instant for any n_layers a file may claim (npllama.memory)."""
        D, F, V, Dh = self.dim, self.hidden_dim, self.vocab_size, self.head_dim
        per_layer = 2 * D + 2 * self.n_heads * Dh * D + 2 * self.n_kv_heads * Dh * D + 3 * F * D
        return V * D * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + D

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed and validated again (e.g. max_seq_len=4096)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """Build from a dict such as to_dict() wrote; unknown keys are an error, not ignored."""
        return dataclass_from_dict(cls, d, "LlamaConfig")

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        return cls.from_dict(parse_json(text, "the config"))
