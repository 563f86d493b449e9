"""A config read from a file (config.json, safetensors metadata, GGUF metadata) checked against the
file's tensor shapes, so a contradiction is named field by field before any array is used."""

from __future__ import annotations

import re

from ..config import LlamaConfig
from .errors import ConfigMismatchError


def check_config_against(cfg: LlamaConfig, shapes: dict[str, tuple], field, display) -> None:
    """Raise ConfigMismatchError naming every config field the tensor shapes contradict.

    shapes: {Meta name: shape} of the file's tensors; field(name) names a LlamaConfig field as the
    file spells it (e.g. "dim (config.json hidden_size)"); display(meta name) names a tensor so.
    """
    problems = []
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None and len(emb) == 2:
        if emb[1] != cfg.dim:
            problems.append(f"{field('dim')}={cfg.dim} but {display('tok_embeddings.weight')} is {emb}, "
                            f"i.e. dim={emb[1]}")
        if emb[0] != cfg.vocab_size:
            problems.append(f"{field('vocab_size')}={cfg.vocab_size} but {display('tok_embeddings.weight')} "
                            f"is {emb}, i.e. vocab_size={emb[0]}")
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"layers\.(\d+)\.", n))}
    if layers and max(layers) + 1 != cfg.n_layers:
        problems.append(f"{field('n_layers')}={cfg.n_layers} but the file holds layers "
                        f"{min(layers)}..{max(layers)}")
    w1 = shapes.get("layers.0.feed_forward.w1.weight")
    if w1 is not None and len(w1) == 2 and w1[0] != cfg.hidden_dim:
        problems.append(f"{field('hidden_dim')}={cfg.hidden_dim} but "
                        f"{display('layers.0.feed_forward.w1.weight')} is {w1}, i.e. hidden_dim={w1[0]}")
    wk = shapes.get("layers.0.attention.wk.weight")
    if wk is not None and len(wk) == 2 and wk[0] != cfg.n_kv_heads * cfg.head_dim and wk[0] % cfg.head_dim == 0:
        problems.append(f"{field('n_kv_heads')}={cfg.n_kv_heads} but {display('layers.0.attention.wk.weight')} "
                        f"is {wk}, i.e. n_kv_heads={wk[0] // cfg.head_dim} of head_dim {cfg.head_dim}")
    if not cfg.tie_embeddings and "output.weight" not in shapes and emb is not None:
        problems.append(f"{field('tie_embeddings')}=False but the file has no {display('output.weight')}; "
                        "if the output layer shares the embeddings, set it to true")
    if problems:
        raise ConfigMismatchError("the config contradicts the tensors:\n  " + "\n  ".join(problems))
