"""checked_library_path: what the worker calls before register_custom_ops_library."""

from __future__ import annotations

import shutil

import pytest

from omnigraph.workers.ops.loader import OpsLibraryError, checked_library_path


def test_a_matching_entry_returns_the_path(cpu_library):
    path = checked_library_path(cpu_library.library_path, sha256=cpu_library.library_sha256, abi_version=1)
    assert path == cpu_library.library_path


def test_altered_bytes_are_refused(cpu_library, tmp_path):
    copy = tmp_path / "libomnigraph_ops.so"
    shutil.copyfile(cpu_library.library_path, copy)
    with copy.open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(OpsLibraryError, match="does not match the manifest's"):
        checked_library_path(copy, sha256=cpu_library.library_sha256, abi_version=1)


def test_another_abi_is_refused(cpu_library):
    with pytest.raises(OpsLibraryError, match="the manifest says ABI version 2; this worker speaks 1"):
        checked_library_path(cpu_library.library_path, sha256=cpu_library.library_sha256, abi_version=2)


def test_another_domain_is_refused(cpu_library):
    with pytest.raises(OpsLibraryError, match="names domain 'com.example'"):
        checked_library_path(
            cpu_library.library_path, sha256=cpu_library.library_sha256, abi_version=1, domain="com.example"
        )


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(OpsLibraryError, match="op library not found"):
        checked_library_path(tmp_path / "libomnigraph_ops.so", sha256="0" * 64, abi_version=1)


def test_a_library_that_is_not_ours_is_refused(tmp_path):
    import hashlib

    not_ours = tmp_path / "libnot_ours.so"
    not_ours.write_bytes(b"not an ELF file")
    digest = hashlib.sha256(not_ours.read_bytes()).hexdigest()
    with pytest.raises(OpsLibraryError, match="not an omnigraph op library"):
        checked_library_path(not_ours, sha256=digest, abi_version=1)
