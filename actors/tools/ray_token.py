"""Keep Ray's authentication token readable by its owner only.

Ray (2.60) writes ``~/.ray/auth_token`` with a plain ``open(path, "w")``: under
the usual umask 022 every local user can read it, and whoever holds it may run
code on the cluster (the token is Ray's only authentication). The launch
helpers call :func:`private_token` before ``ray.init``: a token made earlier
becomes mode 0600, and where a new local cluster would make one it is made here
first, under umask 077 (so it is never readable by others, not even for the
seconds ``ray.init`` takes; the cluster's processes keep the usual umask)::

    private_token(new_cluster=True)   # before ray.init(address="local")
    protect_token()                   # True if it changed a mode; nothing without a token
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)


def token_path() -> Path:
    """Where Ray keeps its token: ``RAY_AUTH_TOKEN_PATH`` if set, else ``~/.ray/auth_token``."""
    env = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(env) if env else Path.home() / ".ray" / "auth_token"


def protect_token(path: Path | None = None) -> bool:
    """chmod the token (if it exists and is ours) to 0600; True if its mode changed."""
    path = token_path() if path is None else path
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid() or not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return False
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    log.warning("Ray token %s was mode %o (readable by other users); now 0600", path,
                stat.S_IMODE(st.st_mode))
    return True


def private_token(*, new_cluster: bool) -> None:
    """Before ``ray.init``: an existing token to 0600; for a ``new_cluster`` in token mode
    (Ray's default) without a token, make it now with umask 077 (Ray's own generator)."""
    protect_token()
    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    if not new_cluster or mode != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path.home() / ".ray" / "auth_token"  # where Ray's generator writes
    if path.exists() or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    from ray._private.authentication.authentication_token_setup import (
        generate_and_save_token,
    )

    old = os.umask(0o077)
    try:
        generate_and_save_token()
    finally:
        os.umask(old)
    log.info("made Ray token %s (mode 0600)", path)
