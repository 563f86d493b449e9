"""Fine-tuning what npllama loads: `npllama train --init`, LoRA runs, their checkpoints, export.

stories260K.bin (llama2.c, trained on TinyStories) and its tokenizer tok512.model are
fine-tuned on a slice of TinyShakespeare: the validation loss falls, a resumed run equals an
uninterrupted one bit for bit, a LoRA checkpoint holds the adapters only and refuses a base that
changed, and the merged export loads in transformers with the same logits.
"""

import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.io.metadata import LORA_KEY
from npllama.io.safetensors import read_safetensors
from npllama.llama import LoraLlama
from npllama.engine.settings import blas_threads
from npllama.io.lora import fingerprint
from npllama.lora import LoraSpec, adapter_shapes
from npllama.tokenizers import SentencePieceTokenizer
from npllama.train import TrainConfig, train
from npllama.train.checkpoint import load_train_checkpoint
from npllama.train.finetune import init_model

from .conftest import data_file

# One BLAS thread for this module's runs (and its subprocesses): the model is tiny, and on a busy
# machine OpenBLAS's two threads turn each of its small GEMMs from microseconds into milliseconds.
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with blas_threads(1):
        yield


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """A folder holding stories260K.bin, tok512.model and a 60,000-character TinyShakespeare slice."""
    folder = tmp_path_factory.mktemp("stories")
    for name in ("stories260K.bin", "tok512.model"):
        shutil.copy(data_file(name), folder / name)
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:60000]
    (folder / "slice.txt").write_text(text, encoding="utf-8")
    return folder


def finetune_cfg(stories, out_dir, **kw):
    base = dict(init=str(stories / "stories260K.bin"), init_tokenizer=str(stories / "tok512.model"),
                data=str(stories / "slice.txt"), seq_len=32, batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                max_steps=6, decay_steps=6, eval_interval=3, eval_batches=2, sample_tokens=0,
                out_dir=str(out_dir), seed=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def lora_run(stories, tmp_path_factory):
    """Six LoRA steps (rank 8, every projection) straight through: (result, its folder)."""
    out = tmp_path_factory.mktemp("lora") / "run"
    return train(finetune_cfg(stories, out, lora_rank=8), out=io.StringIO()), out


def same_arrays(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_lora_fine_tuning_lowers_the_validation_loss(lora_run):
    result, out = lora_run
    (step0, val0), (step6, val6) = result.history[0], result.history[-1]
    assert (step0, step6) == (0, 6) and val6 < val0 - 0.5, result.history     # TinyStories -> Shakespeare
    assert result.full_val_loss < val0 - 0.5


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_a_resumed_fine_tuning_run_equals_an_uninterrupted_one(stories, lora_run, tmp_path, lora_rank):
    a, b = tmp_path / "a", (lora_run[1] if lora_rank else tmp_path / "b")
    train(finetune_cfg(stories, a, max_steps=3, lora_rank=lora_rank), out=io.StringIO())
    # resumed with gradient checkpointing: the same arithmetic, so still the same bits
    train(finetune_cfg(stories, a, resume=True, lora_rank=lora_rank, gradient_checkpointing=True), out=io.StringIO())
    if not lora_rank:
        train(finetune_cfg(stories, b), out=io.StringIO())
    ca, cb = load_train_checkpoint(a / "ckpt.safetensors"), load_train_checkpoint(b / "ckpt.safetensors")
    assert same_arrays(ca.model.params, cb.model.params) and same_arrays(ca.optimizer_state, cb.optimizer_state)
    assert ca.state["rng"] == cb.state["rng"] and ca.state["step"] == 6
    if lora_rank:
        assert isinstance(ca.model, LoraLlama) and ca.model.base_path == str(stories / "stories260K.bin")
    else:                                   # full fine-tuning: an ordinary checkpoint of every weight
        assert isinstance(ca.model, npllama.Llama) and set(ca.model.params) == set(ca.model.config.param_shapes())
        assert not same_arrays(ca.model.params, npllama.load(stories / "stories260K.bin").params)


def test_a_lora_checkpoint_holds_adapters_and_moments_only(stories, lora_run):
    ckpt = lora_run[1] / "ckpt.safetensors"
    tensors, metadata = read_safetensors(ckpt)
    ck = load_train_checkpoint(ckpt)
    names = {n for n in tensors if not n.startswith("optimizer.")}
    assert names == set(adapter_shapes(ck.model.config, LoraSpec(rank=8))) == set(ck.model.params)
    assert len(names) == 5 * 7 * 2
    assert {n for n in tensors if n.startswith("optimizer.")} == {f"optimizer.{k}.{n}" for n in names
                                                                for k in ("exp_avg", "exp_avg_sq")}
    lora = json.loads(metadata[LORA_KEY])
    assert lora["base"] == str(stories / "stories260K.bin") and lora["base_sha256"] == fingerprint(lora["base"])
    assert lora["spec"] == {"rank": 8, "alpha": 16.0, "targets": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}
    assert json.loads(metadata["npllama_train_state"])["train_config"]["dim"] == 64   # from the checkpoint
    # the base stayed as it was; the adapters moved
    assert same_arrays(ck.model.base.params, npllama.load(stories / "stories260K.bin").params)
    assert all(ck.model.params[n].any() for n in names)


def test_lora_starts_at_the_base_model_exactly_and_never_writes_it(stories):
    base = npllama.load(stories / "stories260K.bin")
    expected_params = {n: p.copy() for n, p in base.params.items()}
    tokens = np.random.default_rng(0).integers(0, 512, (3, 40))
    expected = base.forward(tokens)
    model = LoraLlama(base, LoraSpec(rank=8), seed=1)
    assert np.array_equal(model.forward(tokens), expected)                  # B = 0: the base, bit for bit
    assert np.array_equal(LoraLlama(npllama.load(stories / "stories260K.bin"), LoraSpec(rank=0)).forward(tokens),
                          expected)
    opt = npllama.AdamW(model.params, lr=1e-2)
    for _ in range(2):
        _, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:])
        assert grads.keys() == model.params.keys()
        opt.step(grads)
    assert set(opt.exp_avg) == set(model.params)                            # moments of the adapters only
    assert same_arrays(base.params, expected_params)
    assert not np.array_equal(model.forward(tokens), expected)
    # the frozen stacks and the base's params are one memory: [wq; wk; wv] holds wq and wv as views
    wq, wv = base.params["layers.0.attention.wq.weight"], base.params["layers.0.attention.wv.weight"]
    assert wq.base is not None and wq.base is wv.base


def test_the_merged_export_loads_in_transformers_with_the_same_logits(stories, lora_run, tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[torch]'")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install -e '.[torch]'")
    ckpt = lora_run[1] / "ckpt.safetensors"
    assert cli.main(["export", "-m", str(ckpt), "-o", str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    adapted = load_train_checkpoint(ckpt).model                             # the unmerged adapters
    ids = adapted.tokenizer.encode("ROMEO: What say you?", bos=True)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    ours = adapted.forward(ids)
    assert np.abs(ours - theirs).max() < 1e-4 * np.abs(theirs).max()
    base = npllama.load(stories / "stories260K.bin").forward(ids)
    assert np.abs(ours - base).max() > 1e-2                                 # the export is the fine-tuned model


def test_generate_and_export_read_a_lora_checkpoint_and_refuse_a_changed_base(stories, tmp_path, capsys):
    base = tmp_path / "base.safetensors"              # Meta names, the tokenizer inside
    model = npllama.load(stories / "stories260K.bin")
    model.tokenizer = SentencePieceTokenizer.from_file(stories / "tok512.model")
    npllama.save(model, base, format="meta")
    out = tmp_path / "run"
    train(finetune_cfg(stories, out, init=str(base), init_tokenizer=None, max_steps=2, eval_interval=2, lora_rank=2),
          out=io.StringIO())
    ckpt = str(out / "ckpt.safetensors")
    assert cli.main(["generate", "-m", ckpt, "-p", "ROMEO:", "-n", "5", "-s", "0"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert cli.main(["export", "-m", ckpt, "-o", str(tmp_path / "merged.safetensors")]) == 0
    merged = npllama.load(tmp_path / "merged.safetensors")
    assert np.array_equal(merged.params["layers.0.feed_forward.w1.weight"],
                          npllama.load(ckpt).params["layers.0.feed_forward.w1.weight"])
    # the base changes: generating and resuming refuse, naming the file
    changed = npllama.load(base)
    changed.params["norm.weight"] *= 2.0
    npllama.save(changed, base, format="meta")
    assert cli.main(["generate", "-m", ckpt, "-p", "ROMEO:", "-n", "5"]) == 1
    assert "changed since" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"adapts {re.escape(str(base))}, but that file changed"):
        train(finetune_cfg(stories, out, init=str(base), init_tokenizer=None, resume=True, max_steps=4, lora_rank=2),
              out=io.StringIO())
    base.unlink()
    with pytest.raises(FileNotFoundError, match="not there any more"):
        npllama.load(ckpt)


def test_refusals_name_the_problem(stories, tmp_path, capsys):
    init = ["train", "--init", str(stories / "stories260K.bin"), "--data", str(stories / "slice.txt"),
            "--out-dir", str(tmp_path / "r"), "--max-steps", "1"]
    assert cli.main(init + ["--init-tokenizer", str(stories / "tok512.model"), "--dim", "128", "--n-layers", "5"]) == 1
    err = capsys.readouterr().err
    assert "--dim 128 (the checkpoint has 64)" in err and "--n-layers" not in err     # 5 layers: as the checkpoint
    assert cli.main(init) == 1
    err = capsys.readouterr().err
    assert "carries no tokenizer" in err and "--init-tokenizer" in err
    assert cli.main(["train", "--lora-rank", "4", "--max-steps", "1"]) == 1
    assert "--lora-rank needs --init" in capsys.readouterr().err
    assert cli.main(init + ["--init-tokenizer", str(stories / "tok512.model"), "--lora-rank", "4",
                            "--lora-targets", "wq,up"]) == 1
    assert "unknown: ['up']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--seq-len 600 is longer than the context"):
        init_model(finetune_cfg(stories, tmp_path, seq_len=600))
    with pytest.raises(ValueError, match="do not belong together"):       # a 65-token model, a 512-token tokenizer
        small = tmp_path / "small.safetensors"
        npllama.save(npllama.Llama(npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=65)), small,
                     format="meta")
        init_model(finetune_cfg(stories, tmp_path, init=str(small)))


FINETUNING = Path(__file__).resolve().parents[1] / "docs" / "finetuning.md"


def test_the_docs_fine_tuning_example_runs_as_written(stories, tmp_path):
    """Every command of docs/finetuning.md, run in a folder holding its files, with a shorter run:
    --max-steps 4 and fewer evaluation batches; then its Python blocks (the one that loads the export
    into transformers when transformers is installed)."""
    section = FINETUNING.read_text(encoding="utf-8")
    commands = [c for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert len(commands) >= 4 and any(c.startswith("npllama train --init") for c in commands)
    for name in ("stories260K.bin", "tok512.model"):
        shutil.copy(stories / name, tmp_path / name)
    env = {"NPLLAMA_DATA_DIR": str(Path(data_file("tinyshakespeare.txt")).parent), **ONE_THREAD}
    for command in commands:
        argv = shlex.split(command.split("  #")[0])
        assert argv[0] == "npllama", command
        if argv[1] == "train":
            argv = re.sub(r"--max-steps \d+", "--max-steps 4", " ".join(argv)).split() + ["--eval-batches", "2"]
        run = subprocess.run([sys.executable, "-m", "npllama", *argv[1:]], cwd=tmp_path, capture_output=True,
                             text=True, env={**os.environ, **env}, timeout=300)
        assert run.returncode == 0, f"{command}\n{run.stderr}"
    python_blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(python_blocks) == 2
    for block in python_blocks:
        if "transformers" in block and importlib.util.find_spec("transformers") is None:
            continue                     # the export check needs transformers; the rest runs regardless
        run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, **ONE_THREAD}, timeout=300)
        assert run.returncode == 0, f"{block}\n{run.stderr}"
        assert "transformers" not in block or float(run.stdout.split()[-1]) < 1e-4, run.stdout
