"""A tiny llama-architecture GGUF with random weights and a byte-fallback SPM vocabulary, for tests.

llama.cpp loads it like any llama model: the tokenizer lives in the GGUF metadata (SentencePiece
style, ``tokenizer.ggml.model = llama``: the three special tokens, all 256 byte tokens so any text
tokenizes, then printable ASCII and ``▁``-prefixed letters), the weights are random, so what it
generates is noise, but printable noise, never an early end, and quickly on a CPU. Nothing is
downloaded: the tests run where a model hub is out of reach. The key names follow the GGUF
specification (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), through the ``gguf``
package's writer.

``gguf`` and ``numpy`` are test dependencies (the ``dev`` extra), imported when a model is written.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from slurmgate.errors import InputError

MODEL_NAME = "slurmgate-tiny"
# A plain template llama.cpp renders with its Jinja engine: "role: content" lines, then the cue.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
SPACE = "\u2581"  # SentencePiece's word-start marker


def vocabulary(extra_tokens: int = 0) -> tuple[list[str], list[float], list[int]]:
    """The token texts, scores and types: ``<unk> <s> </s>``, 256 bytes, then text pieces, then
    `extra_tokens` word pieces (``▁w0``, ``▁w1``, …) that only make the vocabulary bigger."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(TokenType.BYTE)] * 256
    pieces = (
        [SPACE] + [c for c in string.printable[:94]] + [SPACE + c for c in string.ascii_letters]
    )
    pieces += [f"{SPACE}w{i}" for i in range(extra_tokens)]
    tokens += pieces
    types += [int(TokenType.NORMAL)] * len(pieces)
    # SentencePiece merges the highest-scoring pair first: longer pieces score higher.
    scores = [0.0] * (3 + 256) + [float(len(p)) - 10.0 for p in pieces]
    return tokens, scores, types


def write_tiny_model(
    path: Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 512,
    extra_tokens: int = 0,
    seed: int = 0,
) -> Path:
    """Write a random-weight llama GGUF to `path` and return the path.

    The defaults make a file of about 0.4 MB that llama.cpp loads in a few milliseconds and that
    generates thousands of tokens a second on one CPU core. `extra_tokens` grows the vocabulary:
    llama.cpp's load time grows with it (about 0.3 s per 100 000 tokens on one core), and so does
    each token's cost, for a test that must see the server loading (/health 503) or busy.
    """
    import numpy as np
    from gguf import GGUFWriter

    if n_embd % n_head or n_head % n_head_kv:
        raise InputError(
            f"n_embd={n_embd}, n_head={n_head}, n_head_kv={n_head_kv}: n_embd must be a multiple"
            " of n_head and n_head of n_head_kv (e.g. n_embd=64, n_head=4, n_head_kv=2)"
        )
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise InputError(f"n_embd/n_head = {head_dim}: the head size must be even for RoPE")
    tokens, scores, types = vocabulary(extra_tokens)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        scale = np.float32(1.0 / np.sqrt(shape[-1]))
        return rng.standard_normal(shape, dtype=np.float32) * scale

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(MODEL_NAME)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(1)  # "mostly float16": the vocabulary matrices; the rest is float32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    # numpy shapes are GGML's dimensions reversed: (rows, columns) = (out features, in features).
    # Feature 0 of the residual stream is a constant: every embedding sets it and no layer writes
    # to it. The output rows of the special and byte tokens read it with a large negative weight,
    # so the model never ends early (no EOS) and only ever generates printable text pieces.
    n_embd_kv = head_dim * n_head_kv
    # The two vocabulary-sized matrices are float16 (half the file for a big vocabulary).
    embeddings = weight(n_vocab, n_embd)
    embeddings[:, 0] = 1.0
    writer.add_tensor("token_embd.weight", embeddings.astype(np.float16))
    for i in range(n_layer):
        attn_output, ffn_down = weight(n_embd, n_embd), weight(n_embd, n_ff)
        attn_output[0, :] = 0.0
        ffn_down[0, :] = 0.0
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", attn_output)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", ffn_down)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    output = weight(n_vocab, n_embd)
    output[:, 0] = 0.0
    output[: 3 + 256, 0] = -50.0
    writer.add_tensor("output.weight", output.astype(np.float16))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m slurmgate.testbed.tiny_gguf PATH [--extra-tokens N]`: write it, say where."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m slurmgate.testbed.tiny_gguf", description=__doc__.splitlines()[0]
    )
    parser.add_argument("path", type=Path, help="where to write the GGUF file")
    parser.add_argument("--extra-tokens", type=int, default=0, help="grow the vocabulary")
    parser.add_argument("--context-length", type=int, default=512)
    args = parser.parse_args(argv)
    if args.extra_tokens < 0 or args.context_length < 8:
        parser.error("--extra-tokens must be at least 0 and --context-length at least 8")
    path = write_tiny_model(
        args.path, extra_tokens=args.extra_tokens, context_length=args.context_length
    )
    print(f"{path} ({path.stat().st_size} bytes, model {MODEL_NAME})")


if __name__ == "__main__":
    main()
