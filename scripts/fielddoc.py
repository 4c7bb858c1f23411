"""What the two reference-page scripts (spec-doc.py, settings-doc.py) share: a field's limits.

Both run as `python scripts/NAME.py`, so this folder is on their import path.
"""

from __future__ import annotations

import annotated_types
from pydantic.fields import FieldInfo


def limits(info: FieldInfo) -> str:
    """A field's numeric and length bounds in words: `≥ 1, ≤ 60`, `at least 1`."""
    words = []
    for m in info.metadata:
        for kind, attr, sign in (
            (annotated_types.Ge, "ge", "≥"),
            (annotated_types.Gt, "gt", ">"),
            (annotated_types.Le, "le", "≤"),
            (annotated_types.Lt, "lt", "<"),
        ):
            if isinstance(m, kind):
                words.append(f"{sign} {getattr(m, attr):g}")
        if isinstance(m, annotated_types.MinLen):
            words.append(f"at least {m.min_length}")
        if isinstance(m, annotated_types.MaxLen):
            words.append(f"at most {m.max_length}")
    return ", ".join(words)
