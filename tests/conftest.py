import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run_python(code: str, timeout: float = 240, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (needed for `cpu:N`, which must precede any TF op)."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
    )


@pytest.fixture
def python_subprocess():
    return run_python
