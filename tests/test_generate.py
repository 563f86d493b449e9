"""KV-cached generation against recomputing the whole sequence every step, on both backends.

The reference, `naive_generate`, runs model.forward over the full sequence for every new token
and samples with npllama.sampling.sample_next: no cache, no fused step, no padding. Everything
in npllama.generate must reproduce it, whether the model's backend is the reference (whose
decoder is model.forward with a KVCache) or the engine (a prefill and fused steps).
"""

import numpy as np
import pytest

import npllama
from npllama.generate import generate, generate_batch, generate_stream
from npllama.sampling import sample_next


def naive_generate(model, prompt, max_new_tokens, temperature=0.0, seed=None, stop_ids=(), **kw):
    seq = [int(t) for t in prompt]
    rng = np.random.default_rng(seed)
    seen = np.zeros((1, model.config.vocab_size), dtype=bool)
    seen[0, seq] = True
    out = []
    for _ in range(max_new_tokens):
        logits = model.forward(np.array([seq]))[:, -1]
        t = int(sample_next(logits, temperature, rng=[rng], seen=seen, **kw)[0])
        if t in stop_ids:
            break
        out.append(t)
        seq.append(t)
        seen[0, t] = True
    return out


@pytest.fixture(params=["engine", "reference"])
def model64(request, tiny_config):
    return npllama.Llama(tiny_config, seed=3, dtype=np.float64, backend=request.param)


@pytest.mark.parametrize("B", [1, 4])
def test_decoder_steps_equal_full_recompute(model64, rng, B):
    """The backend's decoder (a prefill, then one position a step) and Llama.forward with a KV cache
    both give the full forward's last logits at every position to < 1e-10."""
    cfg = model64.config
    seq = rng.integers(0, cfg.vocab_size, size=(B, cfg.max_seq_len))
    P = 5
    kv_model = model64.new_kv_cache(B)
    model64.forward(seq[:, :P], kv_cache=kv_model, start_pos=0)
    decoder = model64.new_decoder(B)
    prefilled = decoder.prefill(seq[:, :P], None)
    worst = np.abs(prefilled - model64.forward(seq[:, :P])[:, -1]).max()
    for pos in range(P, cfg.max_seq_len):
        cached = decoder.step(seq[:, pos], pos, None)
        full = model64.forward(seq[:, :pos + 1])[:, -1]
        model_cached = model64.forward(seq[:, pos:pos + 1], kv_cache=kv_model, start_pos=pos)[:, 0]
        worst = max(worst, np.abs(cached - full).max(), np.abs(cached - model_cached).max())
    decoder.close()
    assert worst < 1e-10, worst


@pytest.mark.parametrize("sliding_window", [False, True])
def test_a_generation_s_cache_holds_the_positions_it_feeds_and_gives_the_same_tokens(model64, monkeypatch,
                                                                                      sliding_window):
    """generate's decoder caches the longest prompt plus every new token but the last (the batch is
    left-padded to that prompt), not max_seq_len, and generates what a max_seq_len cache gives; with a
    sliding window, which may refill it, every position. Llama.new_decoder refuses other sizes."""
    from npllama import generate as generation
    cfg = model64.config
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    cached_positions = []                  # each decoder's cache, as made (a decoder drops it on close)
    new_decoder = model64.new_decoder

    def recorded(batch_size, positions=None):
        decoder = new_decoder(batch_size, positions)
        cache = decoder.cache if model64.backend.name == "engine" else decoder.kv
        cached_positions.append(cache.v.shape[3])                      # v (L, B, KVH, S, ...)
        return decoder
    monkeypatch.setattr(model64, "new_decoder", recorded)
    got = model64.generate_batch(prompts, 5, temperature=0.8, seed=4, sliding_window=sliding_window)
    assert cached_positions == [cfg.max_seq_len if sliding_window else 6 + 5 - 1]
    monkeypatch.setattr(generation, "_cache_positions", lambda model, *a: model.config.max_seq_len)
    assert np.array_equal(got, model64.generate_batch(prompts, 5, temperature=0.8, seed=4,
                                                      sliding_window=sliding_window))
    assert cached_positions[-1] == cfg.max_seq_len
    for bad in (0, cfg.max_seq_len + 1):
        with pytest.raises(npllama.NpllamaError, match="positions"):
            new_decoder(1, bad)


@pytest.mark.parametrize("backend", ["engine", "reference"])
def test_decoder_float32_is_close(tiny_config, rng, backend):
    model = npllama.Llama(tiny_config, seed=1, backend=backend)
    seq = rng.integers(0, tiny_config.vocab_size, size=(1, 12))
    decoder = model.new_decoder(1)
    decoder.prefill(seq[:, :4], None)
    for pos in range(4, 12):
        cached = decoder.step(seq[:, pos], pos, None)
        assert cached.dtype == np.float32
        np.testing.assert_allclose(cached, model.forward(seq[:, :pos + 1])[:, -1], atol=2e-5, rtol=1e-4)


def test_greedy_generate_equals_recompute(model64):
    prompt = [1, 2, 3]
    n = model64.config.max_seq_len - len(prompt)
    out = generate(model64, prompt, n)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.ndim == 1
    assert out.tolist() == naive_generate(model64, prompt, n)
    assert model64.generate(prompt, max_new_tokens=n).tolist() == out.tolist()   # Llama.generate is this


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
    dict(temperature=0.0, repetition_penalty=3.0),
])
def test_sampled_generate_equals_recompute_with_the_same_seed(model64, kw):
    prompt = [4, 0, 7, 7]
    out = generate(model64, prompt, 20, seed=11, **kw)
    assert out.tolist() == naive_generate(model64, prompt, 20, seed=11, **kw)


def test_seeds_reproduce_and_differ(tiny_config):
    model = npllama.Llama(tiny_config, seed=0)
    kw = dict(max_new_tokens=25, temperature=1.5)
    a = generate(model, [1, 2], seed=5, **kw)
    assert a.tolist() == generate(model, [1, 2], seed=5, **kw).tolist()
    assert a.tolist() == model.generate([1, 2], seed=5, **kw).tolist()
    others = [generate(model, [1, 2], seed=s, **kw).tolist() for s in (6, 7, 8)]
    assert any(o != a.tolist() for o in others)


def test_stream_yields_the_same_ids_one_at_a_time(model64):
    stream = generate_stream(model64, [5, 6], 10, temperature=0.7, seed=2)
    first = next(stream)
    assert isinstance(first, int)
    assert [first] + list(stream) == generate(model64, [5, 6], 10, temperature=0.7, seed=2).tolist()


def test_stop_ids_end_generation_and_are_not_returned(model64):
    full = generate(model64, [1, 2, 3], 20).tolist()
    stop = full[6]
    first = full.index(stop)          # the first time the stop id comes up
    assert generate(model64, [1, 2, 3], 20, stop_ids=[stop]).tolist() == full[:first]
    assert generate(model64, [1, 2, 3], 20, stop_ids=stop).tolist() == full[:first]   # a single id too
    unused = sorted(set(range(model64.config.vocab_size)) - set(full))
    if unused:
        assert generate(model64, [1, 2, 3], 20, stop_ids=unused).tolist() == full


def test_batched_equals_one_by_one(model64):
    """Prompts of different lengths, left-padded and masked, give each row's own output."""
    prompts = [[3], [1, 2, 3, 4, 5, 6, 7], [9, 9, 0], [2, 5, 8, 1]]
    n = model64.config.max_seq_len - max(map(len, prompts))
    for kw in [dict(), dict(temperature=1.0, top_k=5, seed=4), dict(temperature=0.9, top_p=0.9, seed=[1, 2, 3, 4])]:
        outs = generate_batch(model64, prompts, n, **kw)
        seeds = kw.pop("seed", None)
        for b, (prompt, out) in enumerate(zip(prompts, outs)):
            seed = seeds[b] if isinstance(seeds, list) else seeds
            assert out.tolist() == generate(model64, prompt, n, seed=seed, **kw).tolist(), (b, kw)


def test_batched_rows_stop_independently(model64):
    prompts = [[1, 2], [3, 4, 5]]
    alone = [generate(model64, p, 15).tolist() for p in prompts]
    stop = alone[0][4]
    outs = generate_batch(model64, prompts, 15, stop_ids=[stop])
    for row, out in zip(alone, outs):
        expected = row[:row.index(stop)] if stop in row else row
        assert out.tolist() == expected


def test_length_limit_and_sliding_window(model64):
    L = model64.config.max_seq_len
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model64, [1] * 10, L - 8)
    assert len(generate(model64, [1] * 10, L - 9)) == L - 9
    # the window lifts the limit; until the context fills up it changes nothing
    long = generate(model64, [1] * 10, 2 * L, sliding_window=True)
    assert len(long) == 2 * L
    assert long[:L - 10].tolist() == generate(model64, [1] * 10, L - 10).tolist()
    assert len(generate(model64, list(range(5)) * L, 3, sliding_window=True)) == 3   # over-long prompt


def test_only_fed_positions_count_so_the_context_holds_one_more_new_token(model64):
    """prompt p + max_new_tokens n = max_seq_len + 1 (llama2.c's run.c, CONTRACT.md): the last token
    comes from the logits at position max_seq_len - 1 and is never fed back; + 2 is refused."""
    L = model64.config.max_seq_len
    prompt = [1, 2, 3]
    n = L - len(prompt) + 1
    out = generate(model64, prompt, n)
    assert out.tolist() == naive_generate(model64, prompt, n)           # forward over all L positions
    assert out[:n - 1].tolist() == generate(model64, prompt, n - 1).tolist()
    assert model64.generate(prompt, max_new_tokens=n).tolist() == out.tolist()
    assert list(generate_stream(model64, prompt, n)) == out.tolist()
    sampled = dict(temperature=1.0, top_k=4, seed=9)
    assert generate(model64, prompt, n, **sampled).tolist() == naive_generate(model64, prompt, n, **sampled)
    for call in (lambda: generate(model64, prompt, n + 1),
                 lambda: generate_stream(model64, prompt, n + 1),
                 lambda: generate_batch(model64, [prompt], n + 1),
                 lambda: model64.generate(prompt, max_new_tokens=n + 1)):
        with pytest.raises(ValueError, match=f"max_seq_len={L}: at most {n} new tokens"):
            call()
    # a 1-token prompt may ask for max_seq_len new tokens
    assert len(generate(model64, [4], L)) == L
    # a prompt that fills the whole context still gets its one token; a longer one is refused
    assert generate(model64, [5] * L, 1).tolist() == naive_generate(model64, [5] * L, 1)
    for n_new in (0, 1):
        with pytest.raises(ValueError, match=f"longer than the model's max_seq_len={L}"):
            generate(model64, [5] * (L + 1), n_new)
    # a batch: the longest prompt reaches the end, the others are padded to it
    prompts = [[3], [1, 2, 3, 4, 5, 6, 7]]
    n = L - 7 + 1
    outs = generate_batch(model64, prompts, n)
    assert [o.tolist() for o in outs] == [naive_generate(model64, p, n) for p in prompts]


@pytest.mark.parametrize("call, message", [
    (lambda m: generate(m, [], 3), "empty"),
    (lambda m: generate(m, [[1, 2]], 3), "1-D"),
    (lambda m: generate(m, [1.5], 3), "integer"),
    (lambda m: generate(m, [1, 99], 3), r"prompt_ids\[1\] = 99"),
    (lambda m: generate(m, [1], -1), "max_new_tokens"),
    (lambda m: generate(m, [1], 2.0), "max_new_tokens"),
    (lambda m: generate(m, [1], 3, temperature=-1), "temperature"),
    (lambda m: generate(m, [1], 3, temperature=1, top_p=0), "top_p"),
    (lambda m: generate(m, [1], 3, stop_ids=[99]), "stop_ids"),
    (lambda m: generate(m, [1], 3, stop_ids="a"), "stop_ids"),
    (lambda m: generate_stream(m, [1], 99), "max_seq_len"),      # checked before the first next()
    (lambda m: generate_batch(m, [], 3), "non-empty"),
    (lambda m: generate_batch(m, [[1], [1, 50]], 3), r"prompts\[1\]"),
    (lambda m: generate_batch(m, [[1], [2]], 3, temperature=1, seed=[1, 2, 3]), "seed"),
])
def test_bad_arguments_raise_value_errors(tiny_config, call, message):
    model = npllama.Llama(tiny_config)
    with pytest.raises(ValueError, match=message):
        call(model)


def test_zero_new_tokens_and_nan_weights(tiny_config):
    model = npllama.Llama(tiny_config)
    assert generate(model, [1, 2], 0).tolist() == []
    model.params["norm.weight"][:] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        generate(model, [1, 2], 3)


@pytest.mark.parametrize("backend", ["engine", "reference"])
@pytest.mark.parametrize("kw", [dict(), dict(repetition_penalty=1.3), dict(temperature=0.8, seed=0)])
def test_one_nan_logit_in_one_row_raises(tiny_config, backend, kw):
    """A NaN in a single logit of a single row is caught whichever way the ids are chosen (greedy
    checks only the chosen ids: argmax picks a row's first NaN, and the penalty keeps NaN in place)."""
    model = npllama.Llama(tiny_config, seed=0, backend=backend)
    prompts = [[1, 2, 3], [4, 5]]
    clean = generate_batch(model, prompts, 3, **kw)
    assert all(len(row) == 3 for row in clean)
    out = model.params["output.weight"] if "output.weight" in model.params else model.params["tok_embeddings.weight"]
    out[7, 0] = np.nan                                     # logit 7 of every row is NaN (NaN * 0 is NaN)
    with pytest.raises(ValueError, match="NaN logits"):
        generate_batch(model, prompts, 3, **kw)
    with pytest.raises(ValueError, match="NaN logits"):
        generate(model, prompts[1], 3, **kw)


def test_stories260k_cached_greedy_equals_recompute():
    """The real llama2.c stories260K (GQA, tied embeddings, F=172): 40 cached greedy tokens in float64
    equal recomputing the sequence, and float32 decoding picks the same tokens."""
    from .conftest import data_file
    path = data_file("stories260K.bin")
    model = npllama.load(path, dtype=np.float64)
    prompt = [1, 403, 407, 261, 378]   # tok512 ids; the tokenizer itself is not needed here
    out = generate(model, prompt, 40)
    assert out.tolist() == naive_generate(model, prompt, 40)
    assert generate(npllama.load(path), prompt, 40).tolist() == out.tolist()
    assert len(set(out.tolist())) > 5   # a trained model says something, not one token over and over
