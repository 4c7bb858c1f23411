"""The tiny model directory for Dynamo's mocker: the vocabulary, and the files as read back.

The vocabulary is checked here in slurmgate's venv; writing the directory needs `tokenizers`,
so it runs in the `.venv-dynamo` venv (scripts/setup.sh, SLURMGATE_WITH_DYNAMO=1), as does
reading it back with transformers. Dynamo itself reads it in test_dynamo_mocker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from slurmgate.testbed.tiny_hf import SPACE, SPECIAL_TOKENS, VOCAB_SIZE, vocabulary, words

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
needs_dynamo_venv = pytest.mark.skipif(
    not DYNAMO_PYTHON.exists(),
    reason="`tokenizers` is in the Dynamo venv: SLURMGATE_WITH_DYNAMO=1 scripts/setup.sh makes"
    " .venv-dynamo (scripts/test.sh does)",
)


def test_the_vocabulary_has_32k_distinct_entries_with_the_specials_first() -> None:
    vocab = vocabulary()
    assert len(vocab) == VOCAB_SIZE
    assert sorted(vocab.values()) == list(range(VOCAB_SIZE))
    assert [t for t, i in vocab.items() if i < len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)


def test_the_ids_the_mocker_emits_are_short_visible_words() -> None:
    by_id = {i: t for t, i in vocabulary().items()}
    for i in range(1000, 2000):
        token = by_id[i]
        assert token.startswith(SPACE)
        assert token[1:].isalpha() and token[1:].islower() and len(token) == 5, token
    assert len(set(words())) == len(words())


def write(path: Path) -> float:
    started = time.monotonic()
    subprocess.run(
        [str(DYNAMO_PYTHON), "-m", "slurmgate.testbed.tiny_hf", str(path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
        timeout=60,
    )
    return time.monotonic() - started


@needs_dynamo_venv
def test_the_directory_is_written_quickly_and_the_same_every_time(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    took = write(first)
    write(second)
    assert took < 2.0, f"writing the model directory took {took:.2f} s"
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


READ_BACK = """
import json, sys
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer
path = sys.argv[1]
config = AutoConfig.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
raw = Tokenizer.from_file(path + "/tokenizer.json")
print(json.dumps({
    "config": type(config).__name__,
    "sizes": [config.vocab_size, config.num_hidden_layers, config.num_key_value_heads],
    "special": [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, config.eos_token_id],
    "len": len(tok),
    "decoded": tok.decode(list(range(1000, 1005))),
    "raw": raw.decode(list(range(1000, 1005))),
    "encoded": raw.encode("kabo lade nothere").ids,
    "template": tok.chat_template,
}))
"""


@needs_dynamo_venv
def test_transformers_and_tokenizers_read_the_directory_back(tmp_path: Path) -> None:
    write(tmp_path)
    done = subprocess.run(
        [str(DYNAMO_PYTHON), "-c", READ_BACK, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    vocab = vocabulary()
    expected_words = " ".join(words()[1000 - len(SPECIAL_TOKENS) : 1005 - len(SPECIAL_TOKENS)])
    assert got["config"] == "LlamaConfig"
    assert got["sizes"] == [VOCAB_SIZE, 2, 2]
    assert got["special"] == [1, 2, 0, 2]
    assert got["len"] == VOCAB_SIZE
    assert got["decoded"] == got["raw"] == expected_words
    assert got["encoded"] == [vocab[SPACE + "kabo"], vocab[SPACE + "lade"], 0]
    assert "add_generation_prompt" in got["template"]
