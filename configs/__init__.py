"""The YAML configurations that ship with the library: ``models/``, ``clusters/``, ``runs/``.

They are package data, so an installed wheel has them too. Paths in run files and on the
command line name them from the directory that holds ``configs/`` (``configs/models/x.yaml``)::

    from configs import CONFIGS_DIR, BASE_DIR
    CONFIGS_DIR / "models" / "tiny_llama.yaml"
"""

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent
# The directory that "configs/models/x.yaml" is relative to: the repository root in a clone,
# site-packages in an installed wheel.
BASE_DIR = CONFIGS_DIR.parent
