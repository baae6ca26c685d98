"""The code blocks of a documentation page that tests run as written.

A block is named by an HTML comment on the line before its fence::

    <!-- snippet: vllm-offline-actor -->
    ```python
    ...
    ```

``snippet(doc, name)`` returns its code; ``run_snippet(doc, name, namespace)``
executes it in ``namespace`` (the names the page says the reader already has)
under a module name that is not importable, so Ray pickles the classes it
defines by value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_BLOCK = re.compile(r"<!-- snippet: ([\w-]+) -->\n```python\n(.*?)```", re.S)


def snippets(doc: str | Path) -> dict[str, str]:
    """Every named block of ``doc``: {name: code}; ValueError for a name used twice."""
    out: dict[str, str] = {}
    for name, code in _BLOCK.findall(Path(doc).read_text()):
        if name in out:
            raise ValueError(f"{doc}: snippet {name!r} appears twice")
        out[name] = code
    return out


def snippet(doc: str | Path, name: str) -> str:
    found = snippets(doc)
    if name not in found:
        raise ValueError(f"{doc}: no snippet {name!r} (has {sorted(found)})")
    return found[name]


def run_snippet(doc: str | Path, name: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute snippet ``name`` of ``doc`` in ``namespace``; returns the namespace."""
    namespace.setdefault("__name__", f"wt_doc_{name.replace('-', '_')}")
    exec(compile(snippet(doc, name), f"{doc}#{name}", "exec"), namespace)
    return namespace
