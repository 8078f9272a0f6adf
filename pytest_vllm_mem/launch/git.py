"""The commit a run measured: git runs here, in launch/, the only package that starts processes."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(cwd: Path | str) -> str | None:
    """The short sha of HEAD when `cwd` is in a git work tree; None (quietly) without git, a repo or a commit."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=str(cwd),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = result.stdout.strip()
    return sha if result.returncode == 0 and sha else None
