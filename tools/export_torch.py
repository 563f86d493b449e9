"""Export a PyTorch LLaMA (transformers LlamaForCausalLM) as safetensors plus reference logits.

Needs torch and transformers (`pip install -e '.[torch]'`). Either builds a random model of a
given config, or loads a Hugging Face folder (--hf), then writes into OUT:

    model.safetensors, config.json   save_pretrained(OUT, safe_serialization=True)
    reference_logits.safetensors     prompt.{i}.ids (T,) int64 and, per prompt,
                                     prompt.{i}.logits.float32 (T, V): the model in float32, eager attention
                                     prompt.{i}.logits.float64 (T, V): the model in float64 with
                                       RMSNorm, RoPE and softmax made to follow the dtype (see
                                       make_float64_exact)

The prompts are reference_file.fixed_prompts: BOS alone, then 8 and 16 seeded random ids after BOS.
Then `python tools/crosscheck.py OUT` compares npllama against them.

    python tools/export_torch.py --out weights/tiny-pytorch --rope-theta 5000
    wrote weights/tiny-pytorch: LlamaForCausalLM dim=16 layers=2 heads=4 kv_heads=2 vocab=48 hidden=40 (6,992 parameters)
      model.safetensors, config.json, reference_logits.safetensors (3 prompts, float32 + float64 logits)

Random weights. transformers initialises with std 0.02 and RMSNorm weights of 1, which makes
near-zero logits and a weak test. Here every matrix is N(0, 1/fan_in) and every norm weight
1 + N(0, 0.1^2), so logits are O(1) and a wrong permutation or layout shows.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # npllama and tools/ from a checkout

from tools.reference_file import REFERENCE_NAME, fixed_prompts, write_reference  # noqa: E402

_EXACT_ATTENTION = "npllama_eager_dtype_exact"


def random_hf_model(*, dim, n_layers, n_heads, n_kv_heads, vocab_size, hidden_dim, max_seq_len,
                    rope_theta=10000.0, norm_eps=1e-5, tie=False, seed=0):
    """A LlamaForCausalLM with O(1)-logit random weights (see the module docstring), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=dim, intermediate_size=hidden_dim, num_hidden_layers=n_layers,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, vocab_size=vocab_size,
                      max_position_embeddings=max_seq_len, rope_theta=rope_theta, rms_norm_eps=norm_eps,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the same Parameter, listed once
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    return model.eval()


def make_float64_exact(model) -> None:
    """Make a float64 LlamaForCausalLM compute in float64 throughout (modifies model in place).

    transformers computes three things in float32 whatever the model dtype: RMSNorm
    (hidden_states.to(torch.float32)), the RoPE angles (inv_freq and position_ids .float()),
    and the eager softmax (softmax(..., dtype=torch.float32)). Each is replaced by the same
    formula evaluated in the input dtype:
        RMSNorm     w * (x * rsqrt(mean(x**2) + eps))
        RoPE        angle = p * theta ** (-2j / Dh) in float64; cos, sin of cat(angle, angle)
        attention   softmax(q k^T * Dh**-0.5 + causal mask) v, causal over the full sequence
                    (the mask argument is ignored: one unpadded sequence without a cache)
    """
    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama as ml

    def rmsnorm_forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))

    def rope_forward(self, x, position_ids):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, k.transpose(2, 3)) * scaling
        T, S = scores.shape[-2:]
        causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return torch.matmul(att, v).transpose(1, 2).contiguous(), att

    AttentionInterface.register(_EXACT_ATTENTION, attention)
    model.set_attn_implementation(_EXACT_ATTENTION)
    for module in model.modules():
        if isinstance(module, ml.LlamaRMSNorm):
            module.forward = types.MethodType(rmsnorm_forward, module)
        elif isinstance(module, ml.LlamaRotaryEmbedding):
            module.forward = types.MethodType(rope_forward, module)


def torch_logits(model, ids) -> np.ndarray:
    """(T, V) logits of one prompt, in the model's dtype."""
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False).logits[0]
    return out.numpy()


def reference_logits(model, prompts) -> dict[str, list[np.ndarray]]:
    """{"float32": [...], "float64": [...]}: eager float32, and float64 made exact. model is left float32."""
    import copy

    model.set_attn_implementation("eager")
    out = {"float32": [torch_logits(model.float(), ids) for ids in prompts]}
    m64 = copy.deepcopy(model).double()
    make_float64_exact(m64)
    out["float64"] = [torch_logits(m64, ids) for ids in prompts]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder to write (created if needed)")
    p.add_argument("--hf", type=Path, default=None, help="load this Hugging Face folder instead of a random model")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=48)
    p.add_argument("--hidden-dim", type=int, default=40)
    p.add_argument("--max-seq-len", type=int, default=32)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5)
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    p.add_argument("--seed", type=int, default=0, help="weights seed (the prompts use seed 0)")
    args = p.parse_args(argv)

    import transformers
    from transformers import LlamaForCausalLM

    if args.hf:
        model = LlamaForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    else:
        model = random_hf_model(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                                n_kv_heads=args.n_kv_heads, vocab_size=args.vocab_size, hidden_dim=args.hidden_dim,
                                max_seq_len=args.max_seq_len, rope_theta=args.rope_theta, norm_eps=args.norm_eps,
                                tie=args.tie, seed=args.seed)
    cfg = model.config
    prompts = fixed_prompts(cfg.vocab_size, cfg.max_position_embeddings)
    logits = reference_logits(model, prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    note = {"made_by": "tools/export_torch.py", "torch": torch.__version__, "transformers": transformers.__version__,
            "float32": "LlamaForCausalLM float32, eager attention",
            "float64": "LlamaForCausalLM float64 with RMSNorm, RoPE and softmax following the dtype"}
    write_reference(args.out / REFERENCE_NAME, prompts, logits, note)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.out}: LlamaForCausalLM dim={cfg.hidden_size} layers={cfg.num_hidden_layers} "
          f"heads={cfg.num_attention_heads} kv_heads={cfg.num_key_value_heads} vocab={cfg.vocab_size} "
          f"hidden={cfg.intermediate_size} ({n:,} parameters)")
    print(f"  model.safetensors, config.json, {REFERENCE_NAME} ({len(prompts)} prompts, float32 + float64 logits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
