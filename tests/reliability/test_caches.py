"""Caches (issue 18, finding 11): a cache folder's name depends on content, not on where the cache
or the checkpoint lives; a read-only cache that holds what is asked for serves it without a write;
a build the cache refuses raises CacheUnwritable naming the path and the cause."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnigraph.bundles import staged_bundle_dir, verify_bundle
from omnigraph.bundles.cache import CacheUnwritable, cached_folder
from omnigraph.pipelines.laya.export import default_bundle


@contextlib.contextmanager
def read_only(tree: Path) -> Iterator[None]:
    """Make every folder of `tree` refuse new entries, for root too (root ignores permission bits,
    so it gets the immutable attribute), and undo it afterwards."""
    folders = [tree, *(path for path in tree.rglob("*") if path.is_dir())]
    if os.geteuid() != 0:
        modes = {folder: folder.stat().st_mode for folder in folders}
        for folder in folders:
            folder.chmod(0o555)
        try:
            yield
        finally:
            for folder, mode in modes.items():
                folder.chmod(mode)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", *map(str, folders)]).returncode != 0:
        subprocess.run(["chattr", "-i", *map(str, folders)], stderr=subprocess.DEVNULL)
        pytest.skip("running as root where chattr +i is unavailable: no way to make a folder read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, folders)], check=True)


def cache_entries(cache: Path) -> list[str]:
    return sorted(str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_dir())


@pytest.fixture
def copied_cache(tmp_path, monkeypatch) -> Path:
    """A cache holding the built demo, copied to another path and selected there."""
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path / "first"))
    default_bundle()
    shutil.copytree(tmp_path / "first", tmp_path / "moved", symlinks=True)
    shutil.rmtree(tmp_path / "first")
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path / "moved"))
    return tmp_path / "moved"


def test_a_cache_copied_to_another_path_reuses_its_bundles(copied_cache):
    before = cache_entries(copied_cache)
    bundle = default_bundle()
    assert bundle.parent.parent == copied_cache and cache_entries(copied_cache) == before
    verify_bundle(bundle)


def test_a_read_only_cache_holding_the_demo_serves_it(copied_cache):
    with read_only(copied_cache):
        bundle = default_bundle()
        assert verify_bundle(bundle).manifest.component == "laya.decision"


def test_a_build_the_cache_refuses_names_the_path_and_the_cause(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "bundles").mkdir(parents=True)
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(cache))

    def build(out: Path) -> None:
        with staged_bundle_dir(out) as staging:
            (staging / "value.txt").write_text("built")

    with read_only(cache), pytest.raises(CacheUnwritable) as refused:
        cached_folder("bundles", "demo", {"seed": 0}, build)
    message = str(refused.value)
    assert f"cannot build {cache / 'bundles' / 'demo-'}" in message and str(cache / "bundles") in message
    assert os.strerror(refused.value.errno) in message
    assert cache_entries(cache) == ["bundles"]  # nothing half-written
