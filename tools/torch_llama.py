"""The one PyTorch LLaMA-2 of the tools, benchmarks and tests: Meta's layout, written from Meta's model.py.

Written from Meta's reference (as llama2.c's model.py writes it as an nn.Module), not from
npllama, so that agreeing with it means something:
  - parameter names are Meta's (npllama's), so a params dict converts one to one; with tied
    embeddings the classifier is the embedding table, listed once as tok_embeddings.weight;
  - RoPE rotates the pairs (2i, 2i+1) of each head, as Meta's apply_rotary_emb does with
    complex numbers (written out here in real arithmetic);
  - n_kv_heads key/value heads each serve n_rep query heads (GQA; MHA and MQA are the ends);
  - attention is F.scaled_dot_product_attention, as a careful PyTorch user writes it for speed;
  - the loss is torch's own cross_entropy, ignoring targets of -100.
Every step follows the model's dtype (Meta computes RMSNorm, RoPE and the softmax in float32),
so a float64 model agrees with npllama to ~1e-15 (the tests ask 1e-10), and float32 is what the
benchmarks race.

The same model decodes with a KV cache (new_kv_caches, generate_greedy), for bench_decode.

    model = TorchLlama.from_params(cfg, params)        # a copy of npllama's weights, in their dtype
    loss = model(tokens, targets); loss.backward()     # training, with adamw(model, ...)
    logits = model(tokens)                             # (B, T, V)
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# scaled_dot_product_attention shares each key/value head among its query heads itself
# (enable_gqa) from torch 2.5 on; before that the heads are repeated, as Meta's repeat_kv does.
SDPA_SHARES_KV_HEADS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        """y = w * x / sqrt(mean(x**2) + eps) over the last axis, in x's dtype."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x, cos, sin):
    """Rotate each pair (x[2i], x[2i+1]) by its position's angle: Meta's apply_rotary_emb, whose
    complex product (x[2i] + i x[2i+1]) (cos + i sin) is written out in reals.

    x (B, T, heads, Dh); cos, sin (T, Dh/2) for x's positions. Returns (B, T, heads, Dh).
    """
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(3)


def attend(q, k, v):
    """Causal attention softmax(q k^T / sqrt(Dh)) v, query t sitting at position S - T + t.

    q (B, H, T, Dh); k, v (B, KVH, S, Dh) with S >= T (S > T: earlier positions from a KV cache).
    Returns (B, H, T, Dh).
    """
    T, S = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1 and not SDPA_SHARES_KV_HEADS:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    gqa = {"enable_gqa": True} if n_rep > 1 and SDPA_SHARES_KV_HEADS else {}
    if T == 1:                                   # the newest position sees every cached one
        return F.scaled_dot_product_attention(q, k, v, **gqa)
    if T == S:                                   # no earlier positions: the plain causal mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)   # a chunk after S - T cached positions
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


class Attention(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=dtype)

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0):
        """x (B, T, D) at positions start_pos.. -> (B, T, D); kv_cache: (keys, values), each
        (B, KVH, max_seq_len, Dh), written at this chunk's positions and read up to them."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # (B, T, heads, Dh) -> (B, heads, T, Dh)
        if kv_cache is not None:
            k_cache, v_cache = kv_cache
            k_cache[:, :, start_pos:start_pos + T] = k
            v_cache[:, :, start_pos:start_pos + T] = v
            k, v = k_cache[:, :, :start_pos + T], v_cache[:, :, :start_pos + T]
        out = attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))                # (B, H, T, Dh) -> (B, T, H * Dh)


class FeedForward(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False, dtype=dtype)

    def forward(self, x):
        """SwiGLU: w2(silu(w1 x) * w3 x)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.feed_forward = FeedForward(cfg, dtype)

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0):
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


def cross_entropy(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), over the targets != -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


class TorchLlama(nn.Module):
    """LLaMA-2 of an npllama LlamaConfig, in `dtype` (weights, RoPE tables and KV caches alike).

    TorchLlama(cfg) starts from PyTorch's default initialisation; from_params copies given weights.
    """

    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, dtype) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Meta's precompute_freqs_cis: angle p * theta ** (-2i / Dh), in float64, rounded once to dtype
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)   # (max_seq_len, Dh/2)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    @classmethod
    def from_params(cls, cfg, params, dtype=None):
        """A model holding a copy of params, {Meta name: array} as npllama keeps them (no output.weight
        when tied), in dtype (default: the params' own, e.g. float64 for the autograd cross-checks)."""
        model = cls(cfg, dtype or torch.tensor(np.asarray(params["norm.weight"])[:0]).dtype)
        names = dict(model.named_parameters())
        if set(names) != set(params):
            raise ValueError(f"params do not fit the config: missing {sorted(set(names) - set(params))}, "
                             f"unexpected {sorted(set(params) - set(names))}")
        with torch.no_grad():
            for name, p in names.items():
                p.copy_(torch.tensor(np.asarray(params[name])))     # a copy: params may be read-only mappings
        return model

    def forward(self, tokens, targets=None, kv_caches=None, start_pos=0, last_only=False):
        """tokens (B, T) int64 at positions start_pos.. -> logits (B, T, V), or (B, 1, V) of the last
        position alone with last_only (what a decoder needs, without the classifier's other rows);
        with targets (B, T): their mean cross-entropy instead.

        kv_caches: new_kv_caches(B), filled at positions [start_pos, start_pos + T) and read up to them.
        """
        T = tokens.shape[1]
        cos, sin = self.cos[start_pos:start_pos + T], self.sin[start_pos:start_pos + T]
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, None if kv_caches is None else kv_caches[i], start_pos)
        if last_only:
            h = h[:, -1:]
        logits = self.output(self.norm(h))
        return logits if targets is None else cross_entropy(logits, targets)

    def new_kv_caches(self, batch_size):
        """Per layer, zeroed (keys, values), each (B, KVH, max_seq_len, Dh) in the model's dtype."""
        c = self.cfg
        shape = (batch_size, c.n_kv_heads, c.max_seq_len, c.head_dim)
        return [(torch.zeros(shape, dtype=self.cos.dtype), torch.zeros(shape, dtype=self.cos.dtype))
                for _ in range(c.n_layers)]


def adamw(model, lr, betas, eps, weight_decay):
    """torch.optim.AdamW decaying the matrices only (two parameter groups), as npllama's AdamW does
    (nanoGPT's configure_optimizers)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


def generate_greedy(model, prompt, max_new_tokens):
    """Greedy KV-cached decoding: one prefill of prompt (B, P) int64, then one position a step.

    Returns the new ids, (B, max_new_tokens) int64 numpy.
    """
    with torch.inference_mode():
        tokens = torch.from_numpy(np.asarray(prompt, dtype=np.int64))
        caches = model.new_kv_caches(tokens.shape[0])
        logits = model(tokens, kv_caches=caches, last_only=True)[:, -1]        # (B, 1, V) -> (B, V)
        pos, out = tokens.shape[1], []
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)                              # (B, 1)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = model(nxt, kv_caches=caches, start_pos=pos, last_only=True)[:, -1]
                pos += 1
        return torch.cat(out, dim=1).numpy()
