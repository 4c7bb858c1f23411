"""ETag caches: the body behind each conditional read, in memory or in a file across processes.

`StoredRecords` keeps other small answers worth remembering between ticks (which skip-queue
label events were already verified) under one reserved key of the same cache, so they persist
wherever the cache does.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class EtagCache(Protocol):
    """Remembers the ETag and body of each conditional read, keyed by its full URL."""

    def get(self, key: str) -> tuple[str, Any] | None: ...

    def put(self, key: str, etag: str, body: Any) -> None: ...

    def flush(self) -> None: ...


class MemoryEtagCache:
    """An ETag cache that lives as long as its process; the least recently used entries go first.

    Every finished workflow run leaves a jobs URL behind, so without a bound a long-lived
    controller would grow without end.
    """

    def __init__(self, max_entries: int = 5000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries {max_entries} must be at least 1")
        self.max_entries = max_entries
        self._entries: dict[str, tuple[str, Any]] = {}

    def get(self, key: str) -> tuple[str, Any] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._entries[key] = entry  # most recently used goes last
        return entry

    def put(self, key: str, etag: str, body: Any) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (etag, body)
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]

    def flush(self) -> None:
        """Nothing to write: the cache lives in memory."""

    def __len__(self) -> int:
        return len(self._entries)


class FileEtagCache(MemoryEtagCache):
    """An ETag cache in one JSON file, so a fresh controller process still gets 304s.

    The file is rewritten at most every `flush_interval_s` while entries change, and on flush()
    (GitHubClient.aclose calls it). Writes go to a temporary file that replaces the old one, so a
    reader never sees half a file. A corrupt or unreadable file counts as empty: the cache is an
    optimisation, never the truth.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_entries: int = 5000,
        flush_interval_s: float = 2.0,
    ) -> None:
        super().__init__(max_entries)
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self._dirty = False
        self._last_flush = time.monotonic()
        try:
            raw = json.loads(self.path.read_text())
            if isinstance(raw, dict):
                for key, value in raw.items():
                    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                        super().put(key, value[0], value[1])
        except (OSError, ValueError):
            log.debug("etag cache %s unreadable or absent; starting empty", self.path)

    def put(self, key: str, etag: str, body: Any) -> None:
        super().put(key, etag, body)
        self._dirty = True
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".etag-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({k: [e, b] for k, (e, b) in self._entries.items()}, fh)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._dirty = False
        self._last_flush = time.monotonic()


class StoredRecords:
    """A bounded map of small JSON records under one reserved key of an ETag cache.

    It lives as long as the cache does (a FileEtagCache keeps it across processes) and is an
    optimisation, never the truth: what the store holds in another shape reads as empty. At
    most `max_entries` records are kept; the least recently written is forgotten first.
    """

    def __init__(self, store: EtagCache, key: str, max_entries: int = 1000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries {max_entries} must be at least 1")
        self._store = store
        self.key = key
        self.max_entries = max_entries
        self._records: dict[str, dict[str, Any]] | None = None

    def _loaded(self) -> dict[str, dict[str, Any]]:
        if self._records is None:
            entry = self._store.get(self.key)
            stored = entry[1] if entry is not None else None
            records = stored if isinstance(stored, dict) else {}
            kept = [(k, v) for k, v in records.items() if isinstance(v, dict)]
            self._records = dict(kept[-self.max_entries :])
        return self._records

    def get(self, name: str) -> dict[str, Any] | None:
        record = self._loaded().get(name)
        return dict(record) if record is not None else None

    def put(self, name: str, record: dict[str, Any]) -> None:
        records = self._loaded()
        records.pop(name, None)
        records[name] = dict(record)
        while len(records) > self.max_entries:
            del records[next(iter(records))]
        # a copy, so the cache sees a write (a file cache is rewritten only after one)
        self._store.put(self.key, "", dict(records))

    def __len__(self) -> int:
        return len(self._loaded())
