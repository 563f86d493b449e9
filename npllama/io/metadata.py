"""What npllama writes into a safetensors file's metadata: the one owner of those keys.

A safetensors header carries a str -> str map beside the tensors. npllama's files use it for:

    "format"               "pt", which transformers requires (ml-explore/mlx#743)
    "npllama_config"       LlamaConfig.to_json(): a file that carries it needs no config.json
    "npllama_tokenizer"    the tokenizer's to_json(), so generation needs nothing else
    "npllama_train_state"  present only in training checkpoints (npllama.train.checkpoint): the
                           JSON of the run's state; their optimizer moments are the tensors
                           named OPTIMIZER_PREFIX + ..., which loading the model skips
    "npllama_checksum"     in every file npllama writes: CRC-32s of the header and of each
                           tensor's bytes, verified on reading (io/integrity.py)
"""

from __future__ import annotations

from ..config import LlamaConfig
from ..tokenizers import tokenizer_from_json
from .errors import ConfigMismatchError, CheckpointError

FORMAT_KEY = "format"
CONFIG_KEY = "npllama_config"
TOKENIZER_KEY = "npllama_tokenizer"
TRAIN_STATE_KEY = "npllama_train_state"
OPTIMIZER_PREFIX = "optimizer."
CHECKSUM_KEY = "npllama_checksum"


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
