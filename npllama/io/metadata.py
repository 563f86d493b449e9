"""What npllama writes into a safetensors file's metadata: the one owner of those keys.

A safetensors header carries a str -> str map beside the tensors. npllama's files use it for:

    "format"               "pt", which transformers requires (ml-explore/mlx#743)
    "npllama_config"       LlamaConfig.to_json(): a file that carries it needs no config.json
    "npllama_tokenizer"    the tokenizer's to_json(), so generation needs nothing else
    "npllama_train_state"  present only in training checkpoints (npllama.train.checkpoint): the
                           JSON of the run's state; their optimizer moments are the tensors
                           named OPTIMIZER_PREFIX + ..., which loading the model skips
    "npllama_lora"         present only in LoRA training checkpoints, whose tensors are the
                           adapters (npllama.lora's names): JSON {"spec": the LoraSpec,
                           "base": the path of the frozen base checkpoint, "base_sha256": its
                           fingerprint (io/lora.py)}; loading merges the adapters into that base
    "npllama_checksum"     in every file npllama writes: CRC-32s of the header and of each
                           tensor's bytes, verified on reading (io/integrity.py)
    "npllama_save_id"      in the model.safetensors of a Hugging Face folder npllama saved, and
                           under the same key in its config.json: a fresh id per save, so a
                           reader can tell the files of one save from a mix of two (io/checkpoint.py)
"""

from __future__ import annotations

import json

from ..checks import parse_json
from ..config import LlamaConfig
from ..lora import LoraSpec
from ..tokenizers import tokenizer_from_json
from .errors import ConfigMismatchError, CheckpointError

FORMAT_KEY = "format"
CONFIG_KEY = "npllama_config"
TOKENIZER_KEY = "npllama_tokenizer"
TRAIN_STATE_KEY = "npllama_train_state"
OPTIMIZER_PREFIX = "optimizer."
LORA_KEY = "npllama_lora"
CHECKSUM_KEY = "npllama_checksum"
SAVE_ID_KEY = "npllama_save_id"


def model_metadata(config: LlamaConfig, tokenizer=None) -> dict[str, str]:
    """The metadata of a file that holds a whole model: its config and, if any, its tokenizer."""
    metadata = {CONFIG_KEY: config.to_json()}
    if tokenizer is not None:
        metadata[TOKENIZER_KEY] = tokenizer.to_json()
    return metadata


def config_from_metadata(metadata: dict, source: str) -> LlamaConfig:
    """The LlamaConfig under CONFIG_KEY; ConfigMismatchError naming the problem if it is unusable."""
    try:
        return LlamaConfig.from_json(metadata[CONFIG_KEY])
    except (KeyError, ValueError) as e:
        raise ConfigMismatchError(f"{source}: metadata {CONFIG_KEY} is missing or unusable: {e}") from None


def tokenizer_from_metadata(metadata: dict, source: str):
    """The tokenizer under TOKENIZER_KEY, or None when there is none; CheckpointError if unusable."""
    text = metadata.get(TOKENIZER_KEY)
    if text is None:
        return None
    try:
        return tokenizer_from_json(text)
    except ValueError as e:
        raise CheckpointError(f"{source}: metadata {TOKENIZER_KEY} is unusable: {e}") from None


def is_training_checkpoint(metadata: dict) -> bool:
    return TRAIN_STATE_KEY in metadata


def lora_metadata(spec: LoraSpec, base_path: str, base_sha256: str) -> dict[str, str]:
    """The metadata that makes a file of adapters a LoRA checkpoint: the spec and the base it adapts."""
    return {LORA_KEY: json.dumps({"spec": json.loads(spec.to_json()), "base": base_path, "base_sha256": base_sha256},
                                 sort_keys=True)}


def lora_from_metadata(metadata: dict, source: str) -> tuple[LoraSpec, str, str]:
    """(spec, base path, base fingerprint) under LORA_KEY; CheckpointError naming the problem if unusable."""
    try:
        d = parse_json(metadata[LORA_KEY], LORA_KEY)
        return LoraSpec.from_json(json.dumps(d["spec"])), str(d["base"]), str(d["base_sha256"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: metadata {LORA_KEY} is missing or unusable: {e}") from None
