"""What importing parts of ``actors`` loads, checked in fresh interpreters: the plain-data
modules need no Ray, the trainer mixin needs no transformers, the package exports lazily.

(Import cycles and layers are checked from the source in test_layering.py.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test starts a fresh interpreter

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", ["actors.reports", "actors.messages", "actors.config",
                                    "actors.write_guard"])
def test_plain_data_modules_of_actors_do_not_import_ray(module):
    assert _fresh(f"import sys, {module}; print('ray' in sys.modules)") == "False"


def test_public_actor_names_still_import_from_the_package():
    out = _fresh("import actors\n"
                 "from actors import WeightTransferController, TrainerActor, InferenceActor\n"
                 "import sys; print('ray' in sys.modules, sorted(actors.__all__) == actors.__all__,"
                 " 'UpdateReport' in dir(actors))")
    assert out == "True True True"


def test_unknown_actor_name_is_an_attribute_error():
    out = _fresh("import actors\n"
                 "try:\n    actors.NoSuchThing\nexcept AttributeError as e:\n    print(e)")
    assert "no attribute 'NoSuchThing'" in out


def test_trainer_module_does_not_import_transformers():
    assert _fresh("import sys, actors.trainer; print('transformers' in sys.modules)") == "False"
