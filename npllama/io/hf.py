"""Meta <-> Hugging Face: parameter names, the q/k RoPE row permutation, and config.json.

Names. The name maps are plain dicts (tinygrad extra/models/llama.py style), per layer i:

    Meta (npllama, reference model.py)       Hugging Face LlamaForCausalLM
    tok_embeddings.weight                     model.embed_tokens.weight
    layers.{i}.attention_norm.weight          model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.wq.weight            model.layers.{i}.self_attn.q_proj.weight   (rows permuted)
    layers.{i}.attention.wk.weight            model.layers.{i}.self_attn.k_proj.weight   (rows permuted)
    layers.{i}.attention.wv.weight            model.layers.{i}.self_attn.v_proj.weight
    layers.{i}.attention.wo.weight            model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.ffn_norm.weight                model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1.weight         model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w2.weight         model.layers.{i}.mlp.down_proj.weight
    layers.{i}.feed_forward.w3.weight         model.layers.{i}.mlp.up_proj.weight
    norm.weight                               model.norm.weight
    output.weight                             lm_head.weight

RoPE layouts. Both rotate each head's Dh features in Dh/2 pairs by the angle p * theta_j,
theta_j = rope_theta ** (-2j / Dh). They differ in which features form pair j:

    Meta  pairs neighbours:  (2j, 2j+1)          (complex view of consecutive features)
    HF    rotates halves:    (j, j + Dh/2)       (rotate_half)

Every other part of attention is a sum over the features of a head, so it does not care
about their order. Reordering the rows of wq (and wk) per head therefore turns one model
into the other exactly. Writing the rows of one head as r = 2j + c with c in {0, 1}:

    meta_to_hf:  hf_row[c * Dh/2 + j] = meta_row[2j + c]
                 W.reshape(n, Dh/2, 2, D).transpose(0, 2, 1, 3).reshape(n * Dh, D)
    hf_to_meta:  meta_row[2j + c] = hf_row[c * Dh/2 + j]
                 W.reshape(n, 2, Dh/2, D).transpose(0, 2, 1, 3).reshape(n * Dh, D)

(transformers convert_llama_weights_to_hf.py `permute`, and its inverse.) The head count n is
n_heads for wq but n_kv_heads for wk: with grouped-query attention wk has only n_kv_heads * Dh
rows. Using n_heads for wk (as llama2.c's export.py load_hf_model does) scrambles k
silently whenever n_kv_heads < n_heads.

config.json. `hf_config_to_llama` reads the LlamaForCausalLM fields npllama can represent and
refuses the rest (rope scaling, biases, activations other than SiLU, a head_dim that is not
hidden_size / num_attention_heads) with an error naming the field. Missing optional fields take
transformers' LlamaConfig defaults, since that is what transformers itself would build.
"""

from __future__ import annotations

import re

import numpy as np

from ..checks import check_int, check_real, is_integer
from ..config import LlamaConfig
from ..errors import NpllamaError
from .errors import TensorMismatchError

# ----------------------------------------------------------------------------- names

HF_TO_META_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
META_TO_HF_GLOBAL = {v: k for k, v in HF_TO_META_GLOBAL.items()}

# Per layer: HF suffix after "model.layers.{i}." -> Meta suffix after "layers.{i}."
HF_TO_META_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
META_TO_HF_LAYER = {v: k for k, v in HF_TO_META_LAYER.items()}

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_META_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def rename_parameter(name: str, whole: dict, layer_pattern: re.Pattern, per_layer: dict,
                     layer_prefix: str) -> str | None:
    """name through the table `whole`, or, for a layer's parameter (layer_pattern's groups: the
    index, the rest), layer_prefix + index + "." + per_layer[rest]; None when neither has it.
    (GGUF's names, io/gguf_llama.py, go through it too.)"""
    if name in whole:
        return whole[name]
    m = layer_pattern.match(name)
    if m and m.group(2) in per_layer:
        return f"{layer_prefix}{int(m.group(1))}.{per_layer[m.group(2)]}"
    return None


def hf_to_meta_name(name: str) -> str | None:
    """Meta name of a Hugging Face parameter name, or None when it is not a LLaMA parameter."""
    return rename_parameter(name, HF_TO_META_GLOBAL, _HF_LAYER, HF_TO_META_LAYER, "layers.")


def meta_to_hf_name(name: str) -> str | None:
    """Hugging Face name of a Meta parameter name, or None when it is not a LLaMA parameter."""
    return rename_parameter(name, META_TO_HF_GLOBAL, _META_LAYER, META_TO_HF_LAYER, "model.layers.")


def is_hf_name(name: str) -> bool:
    """True for names in Hugging Face's namespace ("model.*", "lm_head.*")."""
    return name.startswith("model.") or name.startswith("lm_head.")


# ----------------------------------------------------------------------------- RoPE permutes

def _check_rows(w: np.ndarray, n_heads: int, what: str) -> int:
    if w.ndim != 2 or n_heads < 1 or w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise NpllamaError(f"{what}: cannot split {w.shape} into {n_heads} heads of an even head_dim; "
                           "pass n_heads for wq/q_proj and n_kv_heads for wk/k_proj")
    return w.shape[0] // n_heads


def permute_meta_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a Meta wq/wk (n_heads*Dh, D) into Hugging Face's rotate-half order.

    hf_row[h, c*Dh/2 + j] = meta_row[h, 2j + c] for head h, pair j, c in {0, 1}.
    Use n_heads for wq and n_kv_heads for wk. Returns a new (n_heads*Dh, D) array.
    """
    Dh = _check_rows(w, n_heads, "permute_meta_to_hf")
    D = w.shape[1]
    return w.reshape(n_heads, Dh // 2, 2, D).transpose(0, 2, 1, 3).reshape(n_heads * Dh, D)  # (H, Dh/2, 2, D) -> (H, 2, Dh/2, D)


def permute_hf_to_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of permute_meta_to_hf: meta_row[h, 2j + c] = hf_row[h, c*Dh/2 + j].

    Use n_heads for q_proj and n_kv_heads for k_proj. Returns a new (n_heads*Dh, D) array.
    """
    Dh = _check_rows(w, n_heads, "permute_hf_to_meta")
    D = w.shape[1]
    return w.reshape(n_heads, 2, Dh // 2, D).transpose(0, 2, 1, 3).reshape(n_heads * Dh, D)  # (H, 2, Dh/2, D) -> (H, Dh/2, 2, D)


def _heads_for(meta_name: str, cfg: LlamaConfig) -> int | None:
    if meta_name.endswith(".attention.wq.weight"):
        return cfg.n_heads
    if meta_name.endswith(".attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def meta_to_hf(params: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Rename Meta params to HF names and permute wq/wk rows into rotate-half order."""
    out = {}
    for name, w in params.items():
        hf = meta_to_hf_name(name)
        if hf is None:
            raise TensorMismatchError(f"{name!r} is not a Meta LLaMA parameter name")
        n = _heads_for(name, cfg)
        out[hf] = permute_meta_to_hf(w, n) if n is not None else w
    return out


# ----------------------------------------------------------------------------- config.json

class UnsupportedConfigError(NpllamaError):
    """A Hugging Face config.json asks for something npllama's LLaMA-2 cannot compute."""


# LlamaConfig field -> config.json key (for error messages that name both)
HF_FIELD = {
    "dim": "hidden_size",
    "hidden_dim": "intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}

# transformers LlamaConfig defaults for keys a config.json may omit.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
                "tie_word_embeddings": False}


def _rope_theta(d: dict) -> float:
    """rope_theta from either layout: top level (transformers 4.x) or rope_parameters (5.x).

    Anything but plain RoPE (rope_type "default", no scaling) is refused.
    """
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rp = d.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise UnsupportedConfigError(f"config.json {key}={rp!r} is not an object")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
        if rope_type != "default" or extra:
            raise UnsupportedConfigError(
                f"config.json {key}={rp} asks for RoPE scaling ({rope_type!r}); npllama implements plain "
                "LLaMA-2 RoPE only. Hint: use a model without rope scaling (e.g. Llama 2, TinyLlama)")
        if "rope_theta" in rp:
            if theta is not None and _real(f"{key}.rope_theta", rp["rope_theta"]) != _real("rope_theta", theta):
                raise UnsupportedConfigError(
                    f"config.json rope_theta={theta} contradicts {key}.rope_theta={rp['rope_theta']}")
            theta = rp["rope_theta"]
    return _real("rope_theta", _HF_DEFAULTS["rope_theta"] if theta is None else theta)


def _real(key: str, value) -> float:
    return check_real(f"config.json {key}", value, 0.0, low_open=True)


def hf_config_to_llama(d: dict) -> LlamaConfig:
    """LlamaConfig from a Hugging Face config.json dict (LlamaForCausalLM).

    Refuses, naming the field: model_type other than "llama", hidden_act other than "silu",
    attention_bias/mlp_bias true, rope scaling, head_dim != hidden_size / num_attention_heads.
    """
    if not isinstance(d, dict):
        raise UnsupportedConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise UnsupportedConfigError(
            f"config.json model_type={model_type!r}; npllama loads LLaMA models (model_type 'llama') only")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError(f"config.json hidden_act={act!r}; LLaMA's SwiGLU needs 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise UnsupportedConfigError(
                f"config.json {key}={d[key]!r}; npllama's linear layers have no bias (LLaMA-2 has none)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "vocab_size") if k not in d]
    if missing:
        raise UnsupportedConfigError(f"config.json lacks required field(s) {missing}")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = heads
    head_dim = d.get("head_dim")
    if head_dim is not None:
        check_int("config.json head_dim", head_dim, 1)
    if head_dim is not None and is_integer(hidden) and is_integer(heads) and heads > 0 \
            and head_dim * heads != hidden:
        raise UnsupportedConfigError(
            f"config.json head_dim={head_dim} but hidden_size / num_attention_heads = {hidden}/{heads}; "
            "npllama needs head_dim == hidden_size // num_attention_heads")
    fields = dict(
        dim=hidden, hidden_dim=d["intermediate_size"], n_layers=d["num_hidden_layers"],
        n_heads=heads, n_kv_heads=kv_heads, vocab_size=d["vocab_size"],
        norm_eps=d.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"]),
        rope_theta=_rope_theta(d),
        max_seq_len=d.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]),
        tie_embeddings=d.get("tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"]),
    )
    try:
        return LlamaConfig(**fields)
    except ValueError as e:
        # Name the config.json key as well as the LlamaConfig field.
        msg = str(e)
        for field, key in HF_FIELD.items():
            msg = re.sub(rf"\b{field}=", f"{key}({field})=", msg)
        raise UnsupportedConfigError(f"config.json: {msg}") from None


def llama_to_hf_config(cfg: LlamaConfig, *, torch_dtype: str = "float32",
                       bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json dict for transformers' LlamaForCausalLM holding this model.

    rope_theta is written both at the top level (transformers 4.x) and under rope_parameters
    (transformers 5.x), so either version builds plain RoPE with our theta.
    """
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
    if bos_id is not None:
        d["bos_token_id"] = int(bos_id)
    if eos_id is not None:
        d["eos_token_id"] = int(eos_id)
    return d
