"""The C decode-attention kernel (kernels/cpu/decode.c): built here, against the naive float64
attention of test_kernel_attention for every query group and head size it has a copy for, through the
engine's plan, on one thread and two, in every vector width and without OpenMP; its build cache; and
what happens where it cannot be built, or only without OpenMP."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest
import torch

import kernels
from configs.schema import EngineConfig, ModelConfig
from engine.kv.pool import KVLayout, KVPool
from engine.llm import build_engine
from engine.step.runner import supports_native_decode
from kernels.cpu import build as cpu_build
from kernels.cpu import native as cpu_native
from kernels.triton.paged_decode import NativeDecode
from tests.model_factory import tiny_model_dir
from tests.test_kernel_attention import assert_matches_naive, kernel_case, make_case, on_one_thread_and_two

# A single token, one short of a 16-token chunk, one chunk, one past it, and lengths past the 32-token
# prefetch distance; with block size 5 no chunk lines up with a page.
CONTEXT_LENS = [1, 15, 16, 17, 33, 70, 300]


def run_native(lib, case) -> torch.Tensor:
    plan = kernels.plan_attention(case.block_tables, case.context_lens, case.query_start_loc, case.k_cache, lib)
    assert isinstance(plan.decode, NativeDecode)
    return kernels.paged_attention(*case.args(), plan=plan)


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
def test_c_decode_matches_naive(any_build, group, head_dim, block_size):
    case = kernel_case(CONTEXT_LENS, [1] * len(CONTEXT_LENS), group, head_dim, block_size)
    assert_matches_naive(run_native(any_build, case), case)


def test_c_decode_in_a_mixed_step_matches_naive(any_build):
    """Decode rows by the kernel, prefill rows by SDPA, each put back on its own token."""
    q_lens = [1, 6, 1, 1, 20, 1]
    case = make_case(
        [9, 30, 1, 64, 45, 17], q_lens, heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=4
    )
    assert_matches_naive(run_native(any_build, case), case)


def test_a_block_id_outside_the_pool_is_refused_before_the_kernel_reads(library):
    case = make_case([20, 9], [1, 1], heads=4, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=6)
    case.block_tables[1, 0] = case.k_cache.shape[0]  # one past the last block
    with pytest.raises(IndexError, match=f"pool has {case.k_cache.shape[0]} blocks"):
        run_native(library, case)


def test_c_decode_gives_the_same_bits_on_one_thread_and_two(any_build):
    case = make_case(
        [700, 3, 129, 64, 250], [1] * 5, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=9
    )
    one, two = on_one_thread_and_two(lambda: run_native(any_build, case))
    assert torch.equal(one, two)  # each (request, kv head) is one thread's work, summed in one order
    assert_matches_naive(two, case)


def test_supported_shapes(library):
    assert [g for g in range(0, 11) if library.supports(g, 64)] == list(range(1, 9))
    assert [d for d in (8, 16, 32, 48, 64, 80, 96, 128, 256) if library.supports(4, d)] == [16, 32, 64, 128]
    pool = KVPool(KVLayout(1, 4, 16, 2, 64, torch.float32))
    assert supports_native_decode(library, 8, pool)
    assert not supports_native_decode(library, 18, pool)  # a group of 9
    assert not supports_native_decode(library, 8, KVPool(KVLayout(1, 4, 16, 2, 64, torch.bfloat16)))


@pytest.mark.parametrize(
    "setting, taken, kept", [("cpu_decode_attention", "native_decode", "native_prefill"),
                             ("cpu_prefill_attention", "native_prefill", "native_decode")]
)  # fmt: skip
def test_the_engine_takes_each_attention_kernel_unless_told_torch(setting, taken, kept):
    library = cpu_native.load()  # the engine's (other tests rebuild the loader's cache: not the fixture)
    path = str(tiny_model_dir("llama"))
    model = ModelConfig(path=path, dtype="float32")
    assert getattr(build_engine(path, model, EngineConfig(kv_cache_memory_mb=4), device="cpu").runner, taken) is library
    torch_only = build_engine(path, model, EngineConfig(kv_cache_memory_mb=4, **{setting: "torch"}), device="cpu")
    assert getattr(torch_only.runner, taken) is None and getattr(torch_only.runner, kept) is library  # its own


def test_the_engine_takes_a_build_without_openmp_up_to_its_thread_limit(monkeypatch):
    serial = cpu_native.NativeLibrary(cpu_native.build(os.environ.get("CC", "cc"), cpu_native.SERIAL))
    monkeypatch.setattr(cpu_native, "load", lambda: serial)
    path = str(tiny_model_dir("llama"))
    model = ModelConfig(path=path, dtype="float32")
    threads = torch.get_num_threads()
    try:
        for num_threads, expected in (
            (2, serial),
            (cpu_native.SERIAL_MAX_THREADS, serial),
            (cpu_native.SERIAL_MAX_THREADS + 1, None),
        ):
            engine = build_engine(
                path, model, EngineConfig(kv_cache_memory_mb=4, num_threads=num_threads), device="cpu"
            )
            assert engine.runner.native_decode is expected, num_threads
            assert engine.runner.native_prefill is expected, num_threads
            assert engine.runner.model.native_layer_ops is (expected is not None), num_threads  # the same rule
    finally:
        torch.set_num_threads(threads)


def test_a_built_library_is_reused(library, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path))
    compiler = "cc"
    first = cpu_native.build(compiler)
    # no temp left; beside the library, the digest it was sealed with (kernels/cpu/trusted_cache.py)
    assert first.parent == tmp_path and sorted(p.name for p in tmp_path.iterdir()) == [
        first.name,
        f"{first.name}.sha256",
    ]
    inode, long_ago = first.stat().st_ino, time.time() - 10 * 24 * 3600
    os.utime(first, (long_ago, long_ago))
    assert cpu_native.build(compiler) == first and first.stat().st_ino == inode  # not rebuilt
    assert first.stat().st_mtime > long_ago + 9 * 24 * 3600  # touched: it counts as used now


def test_another_cpu_gets_its_own_build(library, tmp_path, monkeypatch):
    # A cache shared by machines (an NFS home, one volume for a node pool) must not hand a CPU a
    # library built with -march=native on another.
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path))
    ours = cpu_native.build("cc")
    monkeypatch.setattr(cpu_build, "cpu_identity", lambda: "another CPU")
    theirs = cpu_native.build("cc")
    assert theirs != ours and {p.name for p in tmp_path.glob("*.so")} == {ours.name, theirs.name}


def test_a_build_removes_libraries_unused_for_a_month_and_dead_temporaries(tmp_path):
    now, day = time.time(), 24 * 3600
    ages = {
        "cpu_native-old.so": 31 * day,
        "cpu_native-recent.so": 29 * day,
        "cpu_decode-old.so": 31 * day,
        "tmpdead.so": 2 * 3600,
        "tmplive.so": 10,
        "notes.txt": 365 * day,
    }
    for name, age in ages.items():
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (now - age, now - age))
    removed = cpu_build.remove_stale(tmp_path, now)
    assert sorted(p.name for p in removed) == ["cpu_decode-old.so", "cpu_native-old.so", "tmpdead.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_native-recent.so", "notes.txt", "tmplive.so"]


@pytest.mark.parametrize("compiler", ["no-such-compiler-pdserve", "false"])
def test_no_working_compiler_leaves_the_torch_path(compiler, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path))
    cpu_native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu.native"):
            assert cpu_native.load() is None
        assert "torch path" in caplog.text
        assert list(tmp_path.iterdir()) == []  # a failed build leaves nothing behind
    finally:
        cpu_native.load.cache_clear()


def fake_compiler(tmp_path, body: str) -> str:
    """A ``cc`` stand-in: a shell script that logs its arguments to ``calls``, then runs ``body``."""
    script = tmp_path / "fake-cc"
    script.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_without_openmp_it_builds_without_and_later_starts_reuse_that(tmp_path, monkeypatch, caplog):
    # Apple's clang, or clang without libomp: -fopenmp fails, the same command without it works.
    compiler = fake_compiler(
        tmp_path, 'case "$*" in *-fopenmp*) echo "unsupported option -fopenmp" >&2; exit 1;; esac\nexec cc "$@"'
    )
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path / "cache"))

    def builds() -> list[str]:  # the compiler's calls less the questions about its target (build.target_macros)
        return [line for line in (tmp_path / "calls").read_text().splitlines() if "-dM -E" not in line]

    cpu_native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu.native"):
            lib = cpu_native.load()
        assert lib is not None and not lib.threaded
        assert "without OpenMP" in caplog.text and "unsupported option -fopenmp" in caplog.text
        case = make_case([40, 7], [1, 1], heads=4, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=3)
        assert_matches_naive(run_native(lib, case), case)
        assert len(builds()) == 2  # -fopenmp, then without
        cpu_native.load.cache_clear()
        assert cpu_native.load() is not None
        assert len(builds()) == 2  # the cached build, no new try
    finally:
        cpu_native.load.cache_clear()


def test_a_library_that_does_not_load_is_not_kept(tmp_path, monkeypatch, caplog):
    # The compiler says yes but leaves something no loader takes (clang's OpenMP against libgomp
    # leaves undefined symbols): refused at build time, never cached.
    compiler = fake_compiler(tmp_path, 'while [ "$1" != -o ]; do shift; done\necho "not a library" > "$2"')
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE_DIR", str(tmp_path / "cache"))
    cpu_native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu.native"):
            assert cpu_native.load() is None
        assert "does not load" in caplog.text and "torch path" in caplog.text
        assert list((tmp_path / "cache").iterdir()) == []
    finally:
        cpu_native.load.cache_clear()
