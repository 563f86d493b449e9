"""Small GGUF files for the tests: a model written by npllama, and the same file rewritten with
its metadata or tensors changed (the way a damaged or foreign file differs)."""

import numpy as np

import npllama
from npllama.io.gguf import TensorToWrite, as_entries, read_gguf, write_gguf_atomic
from npllama.tokenizers import CharTokenizer

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n"


def tiny_model(seed=0, **cfg):
    """A random char-level model (GQA unless told otherwise) with a CharTokenizer."""
    tok = CharTokenizer.from_text(TEXT)
    kw = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size, hidden_dim=40, max_seq_len=64)
    kw.update(cfg)
    model = npllama.Llama(npllama.LlamaConfig(**kw), seed=seed)
    model.tokenizer = tok
    return model


def rewrite(src, dst, metadata=None, tensors=None):
    """Copy the GGUF file src to dst through npllama's writer, after edit functions:
    metadata(dict {key: (type, value)}) -> dict, tensors(list [TensorToWrite]) -> list."""
    gf = read_gguf(src)
    meta = dict(gf.metadata)
    if metadata is not None:
        meta = metadata(meta)
    items = [TensorToWrite(t.name, t.shape, t.type_id, np.array(gf.tensor_bytes(t))) for t in gf.tensors.values()]
    if tensors is not None:
        items = tensors(items)
    write_gguf_atomic(dst, as_entries(meta), items)
    return dst


def byte_level_bpe(text, vocab_size=400):
    """(tokenizers.Tokenizer, GGUF metadata {key: (type, value)}) of a GPT-2-style byte-level BPE
    trained on text, as llama.cpp's converter writes such a vocabulary (tokenizer.ggml.model "gpt2")."""
    import json

    import tokenizers
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(bpe.to_str())["model"]["merges"]]
    metadata = {"tokenizer.ggml.model": (8, "gpt2"), "tokenizer.ggml.pre": (8, "gpt-2"),
                "tokenizer.ggml.tokens": (9, tokens), "tokenizer.ggml.merges": (9, merges),
                "tokenizer.ggml.token_type": (9, np.array([3] + [1] * (len(tokens) - 1), np.int32)),
                "tokenizer.ggml.eos_token_id": (4, 0), "tokenizer.ggml.bos_token_id": (4, 0)}
    return bpe, metadata
