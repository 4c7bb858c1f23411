"""Read an answer's body under a cap on its decoded size: identity or one gzip, nothing else.

httpx decodes whatever ``Content-Encoding`` an answer names, stacked encodings included, and
hands each raw chunk to the decoder whole: a small chunk of ``gzip, gzip`` can expand to a
gigabyte before a caller sees its first byte and can count it. So the body is read raw here and
inflated with a bound on what each step may produce; the requests ask for ``gzip`` alone
(``ACCEPT_ENCODING``), and an answer in any other encoding is refused.
"""

from __future__ import annotations

import zlib

import httpx

from slurmgate.errors import ExternalError

ACCEPT_ENCODING = "gzip"
_IDENTITY = frozenset({"", "identity"})


class BodyRefused(ExternalError):
    """The body is larger than the cap once decoded, or in an encoding that is not taken; the
    caller turns it into its own error."""


async def read_capped(response: httpx.Response, cap: int) -> bytes:
    """The decoded body of a streamed response, at most ``cap`` bytes; closes the response.

    Raises BodyRefused past the cap (a declared length over it is refused before reading) or
    for an encoding other than identity or one gzip; httpx's transport errors pass through.
    """
    try:
        declared = response.headers.get("content-length", "")
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding in _IDENTITY and declared.isdigit() and int(declared) > cap:
            raise BodyRefused(f"larger than {cap} bytes")
        if encoding not in _IDENTITY and encoding != "gzip":
            raise BodyRefused(f"Content-Encoding {encoding[:40]!r}: only identity or gzip is read")
        if response.is_stream_consumed:  # built in memory (a mock transport's): read already
            if len(response.content) > cap:
                raise BodyRefused(f"larger than {cap} bytes")
            return response.content
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
        chunks: list[bytes] = []
        size = 0
        async for raw in response.aiter_raw():
            pending = raw
            while pending:
                if inflater is None:
                    out, pending = pending, b""
                else:
                    try:
                        out = inflater.decompress(pending, cap - size + 1)
                    except zlib.error:
                        raise BodyRefused("not valid gzip") from None
                    pending = inflater.unconsumed_tail
                    if inflater.eof:
                        pending = b""  # what follows the one gzip member is not read
                size += len(out)
                if size > cap:
                    raise BodyRefused(f"larger than {cap} bytes")
                chunks.append(out)
        return b"".join(chunks)
    finally:
        await response.aclose()
