"""llama.cpp is the judge of npllama's GGUF files, and of npllama's reading of llama.cpp's.

Through llama-cpp-python (which bundles llama.cpp; .ci/run builds it and checks it imports, so
in CI these run):
- a GGUF npllama writes, for the shipped Shakespeare model (characters, multi-head), stories260K
  with tok512 (sentencepiece, grouped-query, tied) and random tiny models (GQA; tied), in f32,
  f16 and q8_0: llama.cpp's greedy ids equal npllama's (f32: the original model; f16 and q8_0:
  npllama reading that same file), and in f32 the logits agree to 1e-4 of their largest
  magnitude. llama.cpp runs with a float32 KV cache and without flash attention, which would
  round keys, values and scores to float16 (~1e-3): the comparison is of the model, not of
  those options.
- llama.cpp's tokenizer gives npllama's ids on every line of TinyShakespeare (characters,
  tok512, Llama 2's tokenizer).
- a GGUF that llama.cpp's own convert_hf_to_gguf.py writes from a folder npllama saved with
  format="hf" loads in npllama with the folder's logits. The converter is not on PyPI: .ci/run
  takes it from the llama-cpp-python source it builds (vendor/llama.cpp) and names it in
  NPLLAMA_CONVERT_HF_TO_GGUF.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama.io.gguf import read_gguf
from npllama.tokenizers import SentencePieceTokenizer, train_sentencepiece
from npllama.tokenizers.sentencepiece_proto import read_normalizer

from .conftest import data_file
from .gguf_files import byte_level_bpe, rewrite, tiny_model

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run builds it: "
                                                    "pip install llama-cpp-python)")

GGML_TYPE_F32 = 0
REPO = Path(__file__).resolve().parents[1]
CONVERTER_VAR = "NPLLAMA_CONVERT_HF_TO_GGUF"
MAX_RELATIVE = 1e-4
NEW_TOKENS = 48


def run_in_llama_cpp(path, n_ctx):
    """llama.cpp on the file: every position's logits kept, float32 KV cache, no flash attention."""
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=1, seed=0,
                           type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False)


def llama_cpp_logits(llm, ids):
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def llama_cpp_greedy(llm, prompt, n):
    """n ids from llama.cpp's own greedy sampler (temperature 0), end-of-generation ids included."""
    llm.reset()
    out = []
    for token in llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            return out


def relative_error(theirs, ours):
    return float(np.abs(theirs - ours).max() / np.abs(ours).max())


def _shakespeare():
    return npllama.load(REPO / "weights" / "shakespeare-char.safetensors"), "ROMEO:\nWhat light"


def _stories():
    model = npllama.load(data_file("stories260K.bin"))
    model.tokenizer = SentencePieceTokenizer.from_file(data_file("tok512.model"))
    return model, "Once upon a time, there was a little"


def _peaky(model):
    """A random model whose logits are far apart, so greedy decoding has no near-ties to flip."""
    name = "tok_embeddings.weight" if model.config.tie_embeddings else "output.weight"
    model.params[name] *= 40.0
    return model


MODELS = {
    "shakespeare-char": _shakespeare,
    "stories260K-gqa-tied": _stories,
    "tiny-gqa": lambda: (_peaky(tiny_model(seed=1, dim=64, n_heads=8, n_kv_heads=2, hidden_dim=96)), "All:"),
    "tiny-tied": lambda: (_peaky(tiny_model(seed=2, dim=32, n_heads=4, n_kv_heads=4, hidden_dim=64,
                                            tie_embeddings=True)), "Speak"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """exported(model name, type) -> (path of npllama's GGUF, the model, prompt ids), each written once."""
    folder, made = tmp_path_factory.mktemp("gguf-out"), {}

    def get(name, type_name):
        if name not in made:
            model, prompt = MODELS[name]()
            made[name] = model, model.tokenizer.encode(prompt, bos=model.tokenizer.bos_id is not None)
        model, prompt = made[name]
        path = folder / f"{name}-{type_name}.gguf"
        if not path.exists():
            npllama.save(model, path, format="gguf", dtype=type_name)
        return path, model, prompt
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_f32_files_run_in_llama_cpp_as_in_npllama(exported, name):
    path, model, prompt = exported(name, "f32")
    llm = run_in_llama_cpp(path, model.config.max_seq_len)
    ours = list(model.generate(prompt, NEW_TOKENS, temperature=0.0))
    assert llama_cpp_greedy(llm, prompt, NEW_TOKENS) == ours
    ids = list(prompt) + ours
    error = relative_error(llama_cpp_logits(llm, ids), model.forward(np.array([ids]))[0].astype(np.float64))
    assert error < MAX_RELATIVE, f"{name}: llama.cpp's logits differ by {error:.2e} of their largest magnitude"


@pytest.mark.parametrize("type_name", ["f16", "q8_0"])
@pytest.mark.parametrize("name", list(MODELS))
def test_f16_and_q8_0_files_give_llama_cpp_npllamas_greedy_ids(exported, name, type_name):
    """npllama decodes the file's f16 / Q8_0 weights exactly; llama.cpp then also rounds the
    activations it multiplies them by (to f16, or to 8-bit Q8_0 blocks: ~1% of the logits), so
    its logits are npllama's to that rounding, and (teacher-forced on llama.cpp's sequence) each
    id its greedy sampler picks is npllama's argmax, or a near-tie that rounding decided: a token
    whose logit in npllama is within that rounding (the tolerance below) of the argmax's."""
    path, _, prompt = exported(name, type_name)
    ours = npllama.load(path)
    assert any(t.type.name == type_name.upper() for t in read_gguf(path).tensors.values())
    llm = run_in_llama_cpp(path, ours.config.max_seq_len)
    theirs = llama_cpp_greedy(llm, prompt, NEW_TOKENS)
    ids = list(prompt) + theirs
    ref = ours.forward(np.array([ids]))[0].astype(np.float64)[len(prompt) - 1:-1]
    got = llama_cpp_logits(llm, ids)[len(prompt) - 1:-1]
    tolerance = {"f16": 2e-3, "q8_0": 3e-2}[type_name]
    assert relative_error(got, ref) < tolerance
    worse_by = ref.max(axis=-1) - ref[np.arange(len(theirs)), theirs]    # 0 where llama.cpp took the argmax
    assert np.all(worse_by <= tolerance / 3 * np.abs(ref).max()), worse_by
    assert np.mean(worse_by == 0) >= 0.9


def _normalize_spaces(text: str) -> str:
    """sentencepiece's remove_extra_whitespaces: leading and trailing spaces dropped, runs of them made one."""
    return " ".join(piece for piece in text.split(" ") if piece)


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["char", "bpe", "tok512.model", "llama2-tokenizer.model"])
def test_llama_cpps_tokenizer_gives_npllamas_ids_on_tinyshakespeare(tmp_path, tokenizer):
    """Every line of TinyShakespeare, for the tokenizers `npllama train` makes (characters; "bpe":
    train_sentencepiece, as --tokenizer bpe) and two sentencepiece files. tok512 was trained with sentencepiece's
    remove_extra_whitespaces, which llama.cpp's SPM tokenizer does not apply (it has no such
    step): on lines with leading, trailing or repeated spaces llama.cpp then needs the text with
    those spaces removed, as sentencepiece removes them, to give the same ids."""
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    strip_spaces = False
    if tokenizer == "char":
        model, _ = _shakespeare()
    else:
        tok = (train_sentencepiece(text[:300_000], 512) if tokenizer == "bpe"
               else SentencePieceTokenizer.from_file(data_file(tokenizer)))
        model = tiny_model(dim=8, n_heads=2, n_kv_heads=2, hidden_dim=8, vocab_size=tok.vocab_size)
        model.tokenizer = tok
        strip_spaces = read_normalizer(tok.model_proto).remove_extra_whitespaces
    assert strip_spaces == (tokenizer == "tok512.model")
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    lines = [line for line in text.split("\n") if line]
    ours = [model.tokenizer.encode(line) for line in lines]
    theirs = [llm.tokenize((_normalize_spaces(line) if strip_spaces else line).encode("utf-8"), add_bos=False,
                           special=False) for line in lines]
    assert theirs == ours
    if strip_spaces:   # the difference is exactly the one step llama.cpp lacks
        raw = [llm.tokenize(line.encode("utf-8"), add_bos=False, special=False) for line in lines]
        assert {i for i, (a, b) in enumerate(zip(raw, ours)) if a != b} <= \
            {i for i, line in enumerate(lines) if _normalize_spaces(line) != line}
    assert npllama.load(path).tokenizer.encode(text[:20000]) == model.tokenizer.encode(text[:20000])
    first = model.tokenizer.encode(lines[0], bos=model.tokenizer.bos_id is not None)
    assert llm.tokenize(lines[0].encode("utf-8"), add_bos=True, special=False) == first
    assert llm.detokenize(ours[1]).decode("utf-8").strip() == lines[1].strip()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "legacy-file"])
def test_a_tokenizer_json_written_as_a_llama_vocabulary_tokenizes_alike(tmp_path, variant):
    """A Llama-family tokenizer.json (as transformers 5 writes it for a tokenizer.model, here
    tok512's: LlamaTokenizer's Metaspace layout, or the Hub's legacy normalizer) becomes a "llama"
    vocabulary whose scores follow the merge ranks: llama.cpp's tokenizer and npllama's reading
    of the file give the ids the tokenizer.json gives."""
    from .test_tokenizer_json import _make
    pytest.importorskip("transformers", reason="transformers is not installed (it writes the tokenizer.json)")
    data_file("tok512.model")
    ours, _ = _make("tok512.model", variant, tmp_path)
    model = tiny_model(dim=8, n_heads=2, n_kv_heads=2, hidden_dim=8, vocab_size=ours.vocab_size)
    model.tokenizer = ours
    path = npllama.save(model, tmp_path / "m.gguf", format="gguf")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    lines = [line for line in data_file("tinyshakespeare.txt").read_text(encoding="utf-8").split("\n") if line][:5000]
    expected = [ours.encode(line) for line in lines]
    assert [llm.tokenize(line.encode("utf-8"), add_bos=False, special=False) for line in lines] == expected
    back = npllama.load(path).tokenizer
    assert [back.encode(line) for line in lines] == expected


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "default"])
def test_a_byte_level_bpe_vocabulary_reads_as_llama_cpp_tokenizes(tmp_path, pre):
    """A gpt2-style vocabulary (Llama 3's, SmolLM's) read by npllama (through `tokenizers`, with
    llama.cpp's pre-tokenizer regexes) gives llama.cpp's ids."""
    pytest.importorskip("tokenizers", reason="Hugging Face's `tokenizers` package is not installed")
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    _, vocab = byte_level_bpe(text[:200_000])
    vocab["tokenizer.ggml.pre"] = (8, pre)
    model = tiny_model(dim=8, n_heads=2, n_kv_heads=2, hidden_dim=8, vocab_size=len(vocab["tokenizer.ggml.tokens"][1]))
    model.tokenizer = None
    plain = npllama.save(model, tmp_path / "plain.gguf", format="gguf")
    path = rewrite(plain, tmp_path / "bpe.gguf", metadata=lambda meta: {
        **{k: v for k, v in meta.items() if not k.startswith("tokenizer.")}, **vocab})
    ours = npllama.load(path).tokenizer
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    lines = [line for line in text.split("\n") if line][:5000] + [
        "  two spaces, digits 12345 and 'quotes' ", "x\n\ny", "DON'T you'LL we've", "Ünïcödé, 中文字符 and émoji 🙂!",
        "$100+200=300 <tag> ^~| a.b,c;d", "\t\ttabs\r\nand  \n  newlines"]
    assert [llm.tokenize(s.encode("utf-8"), add_bos=False, special=False) for s in lines] == \
        [ours.encode(s) for s in lines]


def _converter() -> Path:
    value = os.environ.get(CONVERTER_VAR)
    if not value:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not on PyPI: set {CONVERTER_VAR} to its path in a "
                    "llama.cpp source tree (.ci/run takes it from the llama-cpp-python sdist)")
    path = Path(value)
    if not path.is_file():
        pytest.skip(f"{CONVERTER_VAR}={value} is not a file")
    return path


@pytest.mark.slow
def test_llama_cpps_converter_output_loads_with_the_hf_folders_logits(tmp_path):
    """stories260K (grouped-query: k_proj permuted with n_kv_heads; tied: no output.weight)."""
    converter = _converter()
    pytest.importorskip("torch", reason="llama.cpp's convert_hf_to_gguf.py imports torch")
    model, _ = _stories()
    folder = npllama.save(model, tmp_path / "hf", format="hf")
    out = tmp_path / "converted.gguf"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}     # the converter's own gguf-py
    result = subprocess.run([sys.executable, str(converter), str(folder), "--outfile", str(out), "--outtype", "f32"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    hf, converted = npllama.load(folder), npllama.load(out)
    assert converted.config == hf.config.replace(multiple_of=converted.config.multiple_of)
    ids = np.array([hf.tokenizer.encode("Once upon a time, the little dog", bos=True)])
    assert np.array_equal(converted.forward(ids), hf.forward(ids))
    lines = data_file("tinyshakespeare.txt").read_text(encoding="utf-8").split("\n")[:2000]
    assert [converted.tokenizer.encode(s) for s in lines] == [hf.tokenizer.encode(s) for s in lines]
    # and llama.cpp runs the converter's file as npllama reads it
    llm = run_in_llama_cpp(out, hf.config.max_seq_len)
    assert relative_error(llama_cpp_logits(llm, ids[0]), converted.forward(ids)[0].astype(np.float64)) < MAX_RELATIVE
