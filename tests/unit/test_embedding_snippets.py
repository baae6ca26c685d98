"""Every code block of docs/embedding.md is named and run by a test: the ones that need no
actors run here (the mixin skeletons define actor classes, the registry call registers);
the others run in the integration tests that name them (a name used by no test fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from actors.tools.testkit.doc_snippets import run_snippet, snippets

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "embedding.md"


def test_every_python_block_is_named():
    text = DOC.read_text()
    assert len(re.findall(r"^```python$", text, flags=re.M)) == len(snippets(DOC)) >= 8


def test_every_named_block_is_run_by_some_test():
    tests = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py")]
    unused = [n for n in snippets(DOC) if not any(f'"{n}"' in t for t in tests)]
    assert unused == [], f"docs/embedding.md snippets no test runs: {unused}"


def test_the_mixin_skeletons_define_actor_classes():
    ns = run_snippet(DOC, "trainer-mixin", {})
    run_snippet(DOC, "inference-mixin", ns)
    for name, method in (("MyTrainer", "wt_attach"), ("MyRollout", "wt_attach_engine")):
        cls = ns[name]
        assert hasattr(cls, "remote") and hasattr(cls.__ray_metadata__.modified_class, method)


def test_the_registry_snippet_registers_an_engine():
    from actors.engine_registry import engine_spec, unregister_engine

    try:
        run_snippet(DOC, "register-engine", {})
        spec = engine_spec("sglang")
        assert (spec.module, spec.launch) == ("my_pkg.sglang_launch", "launch_sglang_engines")
    finally:
        unregister_engine("sglang")
