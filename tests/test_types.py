"""JSON fields of the wrong type, in config.json, npllama's metadata or a training state, raise npllama's
error naming the field (before, several raised TypeError from deep inside)."""

import io
import json

import pytest

import npllama
from npllama.io.metadata import CHECKSUM_KEY, CONFIG_KEY, TRAIN_STATE_KEY
from npllama.tokenizers import CharTokenizer
from npllama.train import train
from npllama.train.checkpoint import load_train_checkpoint, rng_from_state

from .test_integrity import rewrite_header
from .conftest import tiny_cfg

WRONG = {"list": [1], "dict": {"a": 1}, "null": None, "string": "16", "bool": True}


def outcome(load, path):
    """None when it loads, else the message of the NpllamaError it raised (anything else fails the test)."""
    try:
        load(path)
    except npllama.NpllamaError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("types")
    cfg = npllama.LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=7, multiple_of=8, max_seq_len=8)
    model = npllama.Llama(cfg, seed=0)
    model.tokenizer = CharTokenizer("abcdefg")
    npllama.save(model, root / "hf", format="hf")
    npllama.save(model, root / "m.safetensors", format="meta")
    return root


HF_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
             "head_dim", "rope_parameters", "rope_scaling", "model_type", "hidden_act", "attention_bias"]


@pytest.mark.parametrize("kind", WRONG)
@pytest.mark.parametrize("field", HF_FIELDS)
def test_config_json_fields_of_the_wrong_type(field, kind, saved, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((saved / "hf" / "model.safetensors").read_bytes())
    config = json.loads((saved / "hf" / "config.json").read_text())
    config[field] = WRONG[kind]
    (folder / "config.json").write_text(json.dumps(config))
    message = outcome(npllama.load, folder)
    if message is not None:                      # None is a default for the optional fields, so it may load
        assert field in message, message
    else:
        assert kind == "null" and field in ("num_key_value_heads", "rms_norm_eps", "rope_theta", "head_dim",
                                            "rope_parameters", "rope_scaling", "max_position_embeddings",
                                            "tie_word_embeddings", "model_type", "hidden_act", "attention_bias")


@pytest.mark.parametrize("kind", WRONG)
@pytest.mark.parametrize("field", list(npllama.LlamaConfig().to_dict()))
def test_npllama_config_metadata_fields_of_the_wrong_type(field, kind, saved, tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes((saved / "m.safetensors").read_bytes())

    def mutate(header):
        meta = header["__metadata__"]
        meta.pop(CHECKSUM_KEY)                   # as an older file, or another tool, would have it
        cfg = json.loads(meta[CONFIG_KEY])
        cfg[field] = WRONG[kind]
        meta[CONFIG_KEY] = json.dumps(cfg)

    rewrite_header(path, mutate)
    message = outcome(npllama.load, path)
    if message is not None:
        assert field in message, message
    else:                                        # None: "derive it" (hidden_dim, n_kv_heads, ffn_dim_multiplier)
        assert kind == "null" and field in ("hidden_dim", "n_kv_heads", "ffn_dim_multiplier")


def _resume_reads(path):
    """What --resume reads from a checkpoint before it needs the text (train/loop.py resume_run)."""
    ck = load_train_checkpoint(path)
    npllama.AdamW(ck.model.params).load_state_dict(ck.optimizer_state)
    rng_from_state(ck.state["rng"])


STATE_FIELDS = ["step", "rng", "optimizer", "train_config", "elapsed", "tokens", "val_loss", "history",
                "text_sha256", "best_loss", "optimizer.lr", "optimizer.step", "optimizer.beta2", "rng.state",
                "train_config.lr", "train_config.max_steps", "train_config.out_dir", "train_config.tokenizer"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    text = root / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 200)
    train(tiny_cfg(text, root / "run", max_steps=2), out=io.StringIO())
    return (root / "run" / "ckpt.safetensors").read_bytes()


@pytest.mark.parametrize("kind", WRONG)
@pytest.mark.parametrize("field", STATE_FIELDS)
def test_training_state_fields_of_the_wrong_type(field, kind, checkpoint, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(checkpoint)

    def mutate(header):
        meta = header["__metadata__"]
        meta.pop(CHECKSUM_KEY)
        state = json.loads(meta[TRAIN_STATE_KEY])
        *outer, key = field.split(".")
        (state[outer[0]] if outer else state)[key] = WRONG[kind]
        meta[TRAIN_STATE_KEY] = json.dumps(state)

    rewrite_header(path, mutate)
    message = outcome(_resume_reads, path)
    name = field.split(".")[-1]
    if message is not None:
        assert name in message or f"--{name.replace('_', '-')}" in message, message
        assert field.split(".")[0] in message, message
    else:                                        # null: "none yet"; any string is a hash or a folder name
        assert (kind, field) in (("null", "val_loss"), ("null", "best_loss"), ("string", "text_sha256"),
                                 ("string", "train_config.out_dir")), field
