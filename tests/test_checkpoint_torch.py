"""Weights in and out against PyTorch: transformers' LlamaForCausalLM on both sides, stories260K greedy."""

import json

import numpy as np
import pytest

import npllama

from .conftest import data_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0),
    "mqa-tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
}
TOKENS = np.array([[1, 7, 3, 22, 9, 0, 15, 15, 4, 30, 2]])


def rel_err(a, ref):
    return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


def random_hf(kind, seed=0):
    kw = dict(intermediate_size=40, num_hidden_layers=2, vocab_size=37, max_position_embeddings=32,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    cfg = transformers.LlamaConfig(**{**kw, **CONFIGS[kind]})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # O(1) logits and norms away from 1, so a wrong layout shows
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
    model.set_attn_implementation("eager")
    return model.eval()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens), use_cache=False).logits.float().numpy()


@pytest.mark.parametrize("kind", CONFIGS)
def test_save_pretrained_then_npllama_load_gives_the_same_logits(tmp_path, kind):
    hf = random_hf(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = npllama.load(tmp_path)
    assert model.config.n_kv_heads == hf.config.num_key_value_heads
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    assert model.config.rope_theta == CONFIGS[kind].get("rope_theta", 10000.0)
    assert rel_err(model.forward(TOKENS), hf_logits(hf, TOKENS)) < 1e-5


@pytest.mark.parametrize("kind", CONFIGS)
def test_npllama_save_hf_then_from_pretrained_gives_the_same_logits(tmp_path, kind):
    c = CONFIGS[kind]
    cfg = npllama.LlamaConfig(dim=c["hidden_size"], n_layers=2, n_heads=c["num_attention_heads"],
                              n_kv_heads=c["num_key_value_heads"], vocab_size=37, hidden_dim=40, max_seq_len=32,
                              rope_theta=c.get("rope_theta", 10000.0), norm_eps=3e-5,
                              tie_embeddings=c.get("tie_word_embeddings", False))
    model = npllama.Llama(cfg, seed=3)
    rng = np.random.default_rng(3)
    for p in model.params.values():
        p += (rng.standard_normal(p.shape) * (0.2 if p.ndim == 1 else 0.1)).astype(p.dtype)
    npllama.save(model, tmp_path, format="hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32 and hf.config.rms_norm_eps == 3e-5
    assert rel_err(hf_logits(hf, TOKENS), model.forward(TOKENS)) < 1e-5


def test_sharded_save_pretrained_loads(tmp_path):
    hf = random_hf("gqa")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert rel_err(npllama.load(tmp_path).forward(TOKENS), hf_logits(hf, TOKENS)) < 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_from_torch_is_upcast(tmp_path, dtype):
    hf = random_hf("gqa").to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = npllama.load(tmp_path, dtype=np.float64)
    # the same rounded weights, computed in float32 (a fresh model: .float() would keep the
    # RoPE inv_freq buffer that .to(dtype) rounded)
    ref = hf_logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval(), TOKENS)
    assert rel_err(model.forward(TOKENS), ref) < 1e-5


def test_npllama_bfloat16_save_matches_torch_rounding(tmp_path):
    hf = random_hf("mha")
    hf.save_pretrained(tmp_path / "f32", safe_serialization=True)
    npllama.save(npllama.load(tmp_path / "f32"), tmp_path / "bf16", format="hf", dtype="bfloat16")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert back.dtype == torch.bfloat16
    want = hf.to(torch.bfloat16).state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, want[name]), name


def _greedy_npllama(model, n):
    ids = [1]
    for _ in range(n):
        ids.append(int(np.argmax(model.forward(np.array([ids]))[0, -1])))
    return ids[1:]


@pytest.mark.slow  # ~5 s: 40 greedy steps three ways
def test_stories260k_greedy_continuation_matches_pytorch(tmp_path):
    model = npllama.load(data_file("stories260K.bin"))
    n = 40
    ours = _greedy_npllama(model, n)
    npllama.save(model, tmp_path, format="hf")  # the same weights in a transformers LlamaForCausalLM
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([[1]]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
    assert out[0, 1:].tolist() == ours
    # and Meta's own formulation (tools/torch_llama.py), which needs no permutation at all
    from tools.torch_llama import TorchLlama, generate_greedy
    assert generate_greedy(TorchLlama.from_params(model.config, model.params), [[1]], n)[0].tolist() == ours


def test_a_transformers_5_folder_with_only_tokenizer_json_generates_from_text(tmp_path):
    """save_pretrained writes tokenizer.json and tokenizer_config.json, no tokenizer.model: npllama
    reads that tokenizer, gets transformers' ids, and `npllama generate -p` works on the folder."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers.tokenization_utils_base import generate_merges
    sp = sentencepiece.SentencePieceProcessor(model_file=str(data_file("tok512.model")))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    tokenizer = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), add_bos_token=True)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, intermediate_size=40, num_hidden_layers=1,
                                   vocab_size=512, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and not (tmp_path / "tokenizer.model").exists()
    model = npllama.load(tmp_path)
    text = "Once upon a time, Lily saw a big red ball. 🎈"
    assert model.tokenizer.encode(text, bos=True) == tokenizer(text)["input_ids"]
    from npllama.cli import main
    assert main(["generate", "-m", str(tmp_path), "-p", "Once upon a time", "-n", "5", "--temp", "0"]) == 0
