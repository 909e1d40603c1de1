"""The C kernel cache loads only libraries this user built and sealed, from a directory only this user
can write (kernels/cpu/trusted_cache.py): a planted or altered .so is removed and built again, never
loaded; a cache directory others could write is emptied and made 0700; another user's is refused."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from kernels.cpu import native, trusted_cache


def test_a_sealed_library_is_taken_and_an_altered_or_unsealed_one_is_removed(tmp_path):
    cache = trusted_cache.private_dir(tmp_path / "native")
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    lib = cache / "cpu_native-0123.so"
    lib.write_bytes(b"\x7fELF built here")
    os.chmod(lib, 0o755)
    trusted_cache.seal(lib)
    assert trusted_cache.take(lib)
    lib.write_bytes(b"\x7fELF planted")  # same name, other bytes
    assert not trusted_cache.take(lib) and not lib.exists()
    lib.write_bytes(b"\x7fELF no seal")  # never sealed here
    assert not trusted_cache.take(lib) and not lib.exists()


def test_a_library_writable_by_others_is_not_taken(tmp_path):
    cache = trusted_cache.private_dir(tmp_path / "native")
    lib = cache / "cpu_native-0123.so"
    lib.write_bytes(b"\x7fELF")
    trusted_cache.seal(lib)
    os.chmod(lib, 0o777)
    assert not trusted_cache.take(lib) and not lib.exists()


def test_a_cache_directory_others_could_write_is_emptied_and_tightened(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = shared / "cpu_native-0123.so"
    planted.write_bytes(b"\x7fELF planted")
    (shared / "cpu_native-0123.so.sha256").write_text("whatever they liked\n")
    (shared / "forms.json").write_text("{}")  # not a library: kept
    os.chmod(shared, 0o777)
    trusted_cache.private_dir(shared)
    assert oct(os.stat(shared).st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in shared.iterdir()) == ["forms.json"]


def test_another_users_cache_directory_is_refused(tmp_path, monkeypatch):
    theirs = trusted_cache.private_dir(tmp_path / "theirs")
    owner = os.stat(theirs).st_uid
    monkeypatch.setattr(trusted_cache.os, "geteuid", lambda: owner + 1)  # this process now runs as another user
    with pytest.raises(trusted_cache.KernelCacheError, match=f"belongs to uid {owner}, not this user"):
        trusted_cache.private_dir(theirs)
    assert issubclass(trusted_cache.KernelCacheError, RuntimeError)  # native.load falls back to torch, logged


def test_a_tampered_cached_build_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path / "native"))
    compiler = shutil.which(os.environ.get("CC", "cc"))
    built = native.build(compiler, native.SERIAL)
    good = built.read_bytes()
    assert native.build(compiler, native.SERIAL) == built and built.read_bytes() == good  # taken from the cache
    tampered = good[:-1] + bytes([good[-1] ^ 1])  # one bit of someone else's
    built.write_bytes(tampered)
    assert native.build(compiler, native.SERIAL) == built
    rebuilt = built.read_bytes()
    assert rebuilt != tampered  # rebuilt from source: the altered bytes were never loaded
    assert (built.parent / (built.name + ".sha256")).read_text().strip() == hashlib.sha256(rebuilt).hexdigest()
    native.NativeLibrary(built)  # and the rebuilt one loads
