"""An independent PyTorch LLaMA-2 (Meta model.py's formulation) for autograd cross-checks.

Written from Meta's reference, not from npllama: RoPE through complex numbers
(torch.view_as_complex), key/value heads repeated with repeat_kv, the causal mask as an
upper-triangular -inf matrix, and torch's own cross_entropy. Unlike Meta's code, every step
follows the input dtype (Meta computes RMSNorm, RoPE and softmax in float32), so float64 runs
agree with npllama to ~1e-13.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, start, theta):
    """x (B, T, heads, Dh): Meta apply_rotary_emb, pairs (2i, 2i+1) as complex numbers."""
    B, T, nh, Dh = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, Dh, 2, dtype=x.dtype)[: Dh // 2] / Dh)
    angles = torch.outer(torch.arange(start, start + T, dtype=x.dtype), freqs)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)                 # (T, Dh/2) complex
    xc = torch.view_as_complex(x.reshape(B, T, nh, Dh // 2, 2).contiguous())
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def _repeat_kv(x, n_rep):
    B, T, kvh, Dh = x.shape
    return x[:, :, :, None, :].expand(B, T, kvh, n_rep, Dh).reshape(B, T, kvh * n_rep, Dh)


def torch_forward(P, cfg, tokens):
    """Logits (B, T, V) from the dict of torch tensors P keyed by Meta names."""
    B, T = tokens.shape
    H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = P["tok_embeddings.weight"][tokens]
    mask = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)
    for i in range(cfg.n_layers):
        L = lambda name: P[f"layers.{i}.{name}.weight"]
        x = _rms_norm(h, L("attention_norm"), cfg.norm_eps)
        q = (x @ L("attention.wq").T).view(B, T, H, Dh)
        k = (x @ L("attention.wk").T).view(B, T, KVH, Dh)
        v = (x @ L("attention.wv").T).view(B, T, KVH, Dh)
        q, k = _rope(q, 0, cfg.rope_theta), _rope(k, 0, cfg.rope_theta)
        k, v = _repeat_kv(k, H // KVH), _repeat_kv(v, H // KVH)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(2, 3) / math.sqrt(Dh) + mask
        att = F.softmax(scores, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(B, T, H * Dh) @ L("attention.wo").T
        x = _rms_norm(h, L("ffn_norm"), cfg.norm_eps)
        h = h + (F.silu(x @ L("feed_forward.w1").T) * (x @ L("feed_forward.w3").T)) @ L("feed_forward.w2").T
    h = _rms_norm(h, P["norm.weight"], cfg.norm_eps)
    out = P["tok_embeddings.weight"] if cfg.tie_embeddings else P["output.weight"]
    return h @ out.T


def torch_logits_loss_grads(params, cfg, tokens, targets):
    """(logits, loss, grads) as numpy, computed by torch autograd in the params' dtype."""
    P = {n: torch.tensor(p, requires_grad=True) for n, p in params.items()}
    tokens_t = torch.tensor(np.asarray(tokens), dtype=torch.long)
    logits = torch_forward(P, cfg, tokens_t)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                           torch.tensor(np.asarray(targets), dtype=torch.long).reshape(-1), ignore_index=-100)
    loss.backward()
    return (logits.detach().numpy(), float(loss.detach()), {n: t.grad.numpy() for n, t in P.items()})
