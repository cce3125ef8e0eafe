"""Build-once cache folders: `cached_folder(kind, name, key, build)` under `$OMNIGRAPH_CACHE`."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnigraph.bundles import staged_bundle_dir
from omnigraph.bundles.cache import cache_key, cache_root, cached_folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class Builder:
    """Writes `value` into `out/value.txt` through a staged folder, counting its calls."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        with staged_bundle_dir(out) as staging:
            (staging / "value.txt").write_text(self.value)


def test_cache_root_is_the_environment_folder_else_the_user_cache(cache, monkeypatch):
    assert cache_root() == cache
    monkeypatch.delenv("OMNIGRAPH_CACHE")
    assert cache_root() == Path.home() / ".cache" / "omnigraph"


def test_a_folder_is_built_once_then_reused_as_it_is(cache):
    build = Builder("one")
    first = cached_folder("checkpoints", "demo-tiny", {"seed": 0}, build)
    assert first == cache / "checkpoints" / f"demo-tiny-{cache_key({'seed': 0})}"
    assert (first / "value.txt").read_text() == "one"
    assert cached_folder("checkpoints", "demo-tiny", {"seed": 0}, build) == first
    assert build.calls == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left behind


def test_another_key_is_another_folder(cache):
    first = cached_folder("bundles", "demo", {"seed": 0, "exporter": 1}, Builder("a"))
    second = cached_folder("bundles", "demo", {"seed": 0, "exporter": 2}, Builder("b"))
    assert first != second and (second / "value.txt").read_text() == "b"


def test_the_key_hash_ignores_key_order_and_refuses_values_json_cannot_hold():
    assert cache_key({"a": 1, "b": [2, 3]}) == cache_key({"b": [2, 3], "a": 1})
    assert cache_key({"a": 1}) != cache_key({"a": 2})
    with pytest.raises(ValueError, match="JSON of plain values"):
        cache_key({"path": Path("/tmp")})
    with pytest.raises(ValueError, match="JSON of plain values"):
        cache_key({"x": float("nan")})


def test_a_concurrent_builder_that_finished_first_is_used(cache):
    winner = Builder("winner")

    def loser(out: Path) -> None:
        winner(out)          # the other process renames its folder onto `out` first
        Builder("loser")(out)  # ours then finds `out` taken

    out = cached_folder("checkpoints", "race", {}, loser)
    assert (out / "value.txt").read_text() == "winner"


def test_a_failed_build_leaves_nothing_and_raises(cache):
    def broken(out: Path) -> None:
        with staged_bundle_dir(out) as staging:
            (staging / "half.txt").write_text("half")
            raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        cached_folder("bundles", "broken", {}, broken)
    assert list((cache / "bundles").iterdir()) == []


def test_a_build_that_raises_file_exists_without_a_folder_is_not_hidden(cache):
    def refuses(out: Path) -> None:
        raise FileExistsError("something else is in the way")

    with pytest.raises(FileExistsError, match="in the way"):
        cached_folder("bundles", "refused", {}, refuses)


@pytest.mark.parametrize(("kind", "name"), [("bundles/x", "demo"), ("bundles", "a/b"), ("bundles", ""),
                                            ("..", "demo")])
def test_kinds_and_names_that_are_not_one_folder_are_refused(cache, kind, name):
    with pytest.raises(ValueError, match="must name one folder"):
        cached_folder(kind, name, {}, Builder("x"))
    assert not cache.exists()
