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

With ``--weights`` the directory also holds random weights (``model.safetensors``, seeded, so
the same bytes every time) for a real engine: vLLM on CPU serves it. Its attention heads are 32
wide (vLLM's CPU attention refuses 16 at request time), so that config differs from the
mocker's in head sizes only. Writing weights needs torch and safetensors: run it with the vLLM
venv's Python.

`tokenizers` is in the Dynamo venv (scripts/dynamo.txt), not in slurmgate's own: run this
module with that venv's Python, from the repository root:
``.venv-dynamo/bin/python -m slurmgate.testbed.tiny_hf DIR`` (or ``.venv-vllm/bin/python -m
slurmgate.testbed.tiny_hf --weights DIR``).
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


def weighted_llama_config() -> dict[str, Any]:
    """config.json for the directory with weights: two 32-wide query heads sharing one KV head,
    which vLLM's CPU attention runs."""
    return llama_config() | {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def write_weights(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Random bf16 weights for `config`'s Llama, by the tensor names transformers' and vLLM's
    Llama loaders read, as model.safetensors."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    vocab = config["vocab_size"]

    def random(*shape: int) -> Any:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": random(vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": random(vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.self_attn.q_proj.weight": random(q, hidden),
            f"{layer}.self_attn.k_proj.weight": random(kv, hidden),
            f"{layer}.self_attn.v_proj.weight": random(kv, hidden),
            f"{layer}.self_attn.o_proj.weight": random(hidden, q),
            f"{layer}.mlp.gate_proj.weight": random(inner, hidden),
            f"{layer}.mlp.up_proj.weight": random(inner, hidden),
            f"{layer}.mlp.down_proj.weight": random(hidden, inner),
            f"{layer}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{layer}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    out = path / "model.safetensors"
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out


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


def write_model_dir(path: Path, weights: bool = False) -> Path:
    """Write the model directory at `path` (made if missing) and return it; `weights` adds
    random weights a real engine serves. The same bytes every time: the vocabulary and
    documents are fixed, `tokenizers` writes its JSON in id order, the weights are seeded."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    # as added tokens they are matched whole in text and skipped when decoding
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = weighted_llama_config() if weights else llama_config()
    _dump(path / "config.json", config)
    _dump(path / "tokenizer_config.json", tokenizer_config())
    if weights:
        write_weights(path, config)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    weights = args[:1] == ["--weights"]
    args = args[1:] if weights else args
    if len(args) != 1:
        print("usage: python -m slurmgate.testbed.tiny_hf [--weights] DIR", file=sys.stderr)
        return 2
    print(write_model_dir(Path(args[0]), weights=weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
