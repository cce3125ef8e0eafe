"""Fixtures shared by the reliability tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmpdir_env() -> Iterator[Path]:
    """A TMPDIR of the test's own, short enough for the workers' Unix socket paths (108 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="og-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
