"""The errors npllama raises for files it cannot read or will not write: each an NpllamaError (a ValueError), with a hint."""

from ..errors import NpllamaError


class CheckpointError(NpllamaError):
    """A checkpoint is corrupt, truncated, untrusted, or does not fit its config."""


class PickleRefusedError(CheckpointError):
    """A pickle (torch.save) file: npllama never unpickles, since unpickling runs code."""


class ConfigMismatchError(CheckpointError):
    """The config contradicts the tensors (the message names each field)."""


class TensorMismatchError(CheckpointError, KeyError):
    """Tensors missing, unexpected or of the wrong shape (the message lists every one)."""

    def __str__(self):  # KeyError would quote the message; keep it readable
        return str(self.args[0]) if self.args else ""


PICKLE_HINT = (
    "npllama never unpickles (loading a pickle runs whatever code it holds). Export the weights to "
    "safetensors instead, e.g. `python tools/export_torch.py --hf FOLDER --out OUT_FOLDER`, or in "
    "Python `model.save_pretrained(out_dir, safe_serialization=True)` for a transformers model, or "
    "`safetensors.torch.save_file(state_dict, 'model.safetensors')` with a config.json beside it")


class OutputPathError(NpllamaError):
    """A path npllama refuses to write: empty, a symbolic link, one of the command's own inputs, or a
    checkpoint it would destroy (the message names the path and what to do instead)."""


class PathInTheWayError(OutputPathError, FileExistsError):
    """A file where a folder is to be written, or a folder where a file is (also a FileExistsError)."""


class WeightsFileChangedError(CheckpointError):
    """A file a model's weights are memory-mapped from changed on disk while in use (io/mapped.py)."""


class GGUFError(CheckpointError):
    """A GGUF file that is corrupt or truncated, or holds what npllama cannot compute (the message says which)."""


class UnsupportedGGUFError(GGUFError):
    """A valid GGUF file of a kind npllama does not run: another architecture, a tensor type it
    cannot dequantize, RoPE scaling, experts."""
