"""A tiny Hugging Face model directory (Llama config, 32k-word tokenizer) for Dynamo's mocker.

Dynamo's mocker engine reads a model directory's config.json and tokenizer, never weights, and
emits random token ids (between 1000 and 1999 in Dynamo 1.6.1); the frontend turns them back into
text with the directory's tokenizer.json. A tiny Llama config and a WordLevel vocabulary of
32 000 made-up words (``▁kabo``, ``▁lade``, …) are therefore enough: every id the mocker emits
decodes to a visible word, and the text a test sends tokenizes (words outside the vocabulary
become ``<unk>``). Nothing is downloaded: the tests run where a model hub is out of reach.

The tokenizer is built and written by Hugging Face's `tokenizers` library (its `Tokenizer` with
a `WordLevel` model and the `Metaspace` pre-tokenizer and decoder, so words decode with their
spaces). config.json and tokenizer_config.json are written as JSON with the keys that
transformers' `LlamaConfig` and `PreTrainedTokenizerFast` read: importing transformers takes
4-6 s on a small machine, and these are fixed documents (tests/runtime/test_tiny_hf.py has
transformers read them back).

`tokenizers` is in the Dynamo venv (scripts/dynamo.txt), not in slurmgate's own: run this
module with that venv's Python, from the repository root:
``.venv-dynamo/bin/python -m slurmgate.testbed.tiny_hf DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 32_000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unknown, begin, end of sequence
SPACE = "\u2581"  # the Metaspace word-start marker
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
# "role: content" lines, then the assistant's cue: the frontend renders it for chat requests.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MAX_LENGTH = 4096


def words() -> list[str]:
    """The vocabulary's words after the special tokens, in id order: every two-syllable word
    (``baba`` … ``zuzu``, 4 900 of them, so ids 3-4902 and the mocker's 1000-1999 among them),
    then three-syllable words until the vocabulary holds VOCAB_SIZE entries."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    two = [a + b for a in syllables for b in syllables]
    three = (a + b + c for a in syllables for b in syllables for c in syllables)
    wanted = VOCAB_SIZE - len(SPECIAL_TOKENS)
    out = two[:wanted]
    for word in three:
        if len(out) >= wanted:
            break
        out.append(word)
    return out


def vocabulary() -> dict[str, int]:
    """Token text to id: the special tokens, then each word with its word-start marker."""
    tokens = [*SPECIAL_TOKENS, *(SPACE + w for w in words())]
    return {token: i for i, token in enumerate(tokens)}


def llama_config() -> dict[str, Any]:
    """config.json: a Llama small enough that the mocker's KV-cache sizes stay tiny (2 layers,
    2 KV heads of 16), with the vocabulary's size and special ids."""
    return {
        "architectures": ["LlamaForCausalLM"],  # Dynamo's frontend refuses a config without it
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_LENGTH,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": SPECIAL_TOKENS.index("<s>"),
        "eos_token_id": SPECIAL_TOKENS.index("</s>"),
    }


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by name, the chat template, the length."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_model_dir(path: Path) -> Path:
    """Write the model directory at `path` (made if missing) and return it. The same bytes
    every time: the vocabulary and documents are fixed, and `tokenizers` writes its JSON in
    id order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    # as added tokens they are matched whole in text and skipped when decoding
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    _dump(path / "config.json", llama_config())
    _dump(path / "tokenizer_config.json", tokenizer_config())
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m slurmgate.testbed.tiny_hf DIR", file=sys.stderr)
        return 2
    print(write_model_dir(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
