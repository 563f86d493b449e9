"""Karpathy's trained stories260K gives llama2.c's own text: real weights, real words.

Every other check compares npllama with an engine reading the same file, which a wrong tensor
order in the file would fool (an earlier copy of stories260K.bin had its matrices in another order
and all engines agreed on gibberish). This one pins what llama2.c's test_all.py expects from
`run stories260K.bin -z tok512.bin -t 0.0 -n 200`: 200 greedy tokens after BOS (id 1), decoded
with tok512. The two files come from https://huggingface.co/karpathy/tinyllamas/tree/main/stories260K;
the tests find them through NPLLAMA_DATA_DIR, as the README says.
"""

import numpy as np
import pytest

import npllama
from npllama import cli
from npllama.tokenizers import SentencePieceTokenizer

from .conftest import data_file

# llama2.c test_all.py, expected_stdout (run.c's output without its final newline)
EXPECTED_TEXT = (
    'Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, '
    'she saw a big, red ball. She wanted to play with it, but it was too high.\n'
    'Lily\'s mom said, "Lily, let\'s go to the park." Lily was sad and didn\'t know what to do. She said, '
    '"I want to play with your ball, but I can\'t find it."\n'
    'Lily was sad and didn\'t know what to do. She said, "I\'m sorry, Lily. I didn\'t know what to do."\n'
    'Lily didn\'t want to help her mom, so she')

# the 200 ids behind that text (greedy from BOS; tok512 ids)
EXPECTED_IDS = [
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
    410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352,
    266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415,
    426, 13, 438, 310, 439, 419, 357, 336, 432, 313, 438, 310, 432, 278, 316, 439, 419, 298, 414, 267,
    265, 282, 295, 433, 426, 436, 317, 286, 296, 418, 269, 279, 292, 416, 439, 413, 409, 416, 327, 263,
    415, 294, 267, 400, 426, 338, 336, 432, 313, 442, 391, 267, 337, 335, 364, 420, 268, 388, 432, 398,
    359, 280, 303, 439, 413, 272, 417, 264, 312, 426, 436, 13, 438, 310, 286, 296, 418, 269, 279, 292,
    416, 439, 413, 409, 416, 327, 263, 415, 294, 267, 400, 426, 338, 336, 432, 313, 442, 439, 423, 262,
    304, 420, 422, 432, 317, 426, 359, 279, 292, 416, 439, 413, 409, 416, 327, 263, 415, 294, 267, 400,
    426, 436, 13, 438, 310, 279, 292, 416, 439, 413, 391, 267, 281, 421, 427, 311, 357, 432, 384, 358
]


@pytest.fixture(scope="module")
def stories():
    return data_file("stories260K.bin"), data_file("tok512.model")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_greedy_from_bos_is_llama2c_text(stories, dtype):
    model_path, tok_path = stories
    model = npllama.load(model_path, dtype=dtype)
    tok = SentencePieceTokenizer.from_file(tok_path)
    assert tok.bos_id == 1
    ids = model.generate([tok.bos_id], max_new_tokens=200, temperature=0.0)
    assert tok.decode(ids.tolist()) == EXPECTED_TEXT
    assert ids.tolist() == EXPECTED_IDS


def test_the_readme_command_prints_it(stories, capsys):
    """npllama generate -m stories260K.bin --tokenizer tok512.model --temp 0 -n 200: the text, exactly."""
    model_path, tok_path = stories
    code = cli.main(["generate", "-m", str(model_path), "--tokenizer", str(tok_path), "--temp", "0", "-n", "200"])
    out, err = capsys.readouterr()
    assert code == 0 and out == EXPECTED_TEXT + "\n"
    assert "200 tokens" in err
