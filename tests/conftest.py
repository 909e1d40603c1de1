"""Shared test setup. Triton kernels run under the interpreter when no GPU is present. Fixtures for the
C kernels (kernels/cpu/native.py): the engine's build, and every build other machines would make."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.cpu import native as cpu_native  # noqa: E402 (after TRITON_INTERPRET: @triton.jit reads it)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a running cluster (tests/cluster_harness.py) shows that cluster's last log
    lines: the gateway's and workers' side of a failure seen only once under CI's load."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        from tests.cluster_harness import ServeProcess

        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, ServeProcess) and value.log:
                report.sections.append(
                    (f"Captured log of the cluster '{name}' (last 80 lines)", "".join(value.log[-80:]))
                )


@pytest.fixture(scope="session", autouse=True)
def forms_cache_dir(tmp_path_factory):
    """The CPU matmul forms picked in this run, shared by its processes (workers inherit the
    environment) but not kept from an earlier run: every run times them afresh at least once."""
    path = tmp_path_factory.mktemp("cpu-forms")
    previous = os.environ.get("PDSERVE_CPU_FORMS_CACHE_DIR")
    os.environ["PDSERVE_CPU_FORMS_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("PDSERVE_CPU_FORMS_CACHE_DIR", None)
    else:
        os.environ["PDSERVE_CPU_FORMS_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def library() -> cpu_native.NativeLibrary:
    lib = cpu_native.load()
    assert lib is not None, "the C kernels did not build on this machine (see the log)"
    return lib


# The engine's build, the one without OpenMP, and each vector width whatever this CPU's is (a width
# wider than the hardware's is slow, not wrong): the code paths other machines take, run here.
BUILDS = {
    "engine": None,
    "no-openmp": cpu_native.SERIAL,
    "4-lanes": cpu_native.Variant(lanes=4),
    "8-lanes": cpu_native.Variant(lanes=8),
    "16-lanes": cpu_native.Variant(lanes=16),
}


@pytest.fixture(scope="session", params=list(BUILDS))
def any_build(request, library) -> cpu_native.NativeLibrary:
    variant = BUILDS[request.param]
    compiler = os.environ.get("CC", "cc")  # the one load() builds the engine's copy with
    lib = library if variant is None else cpu_native.NativeLibrary(cpu_native.build(compiler, variant))
    assert variant is None or lib.threaded == variant.openmp
    return lib


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """The gateway tests' tokenizer: a small byte-level BPE trained offline (tests/fake_backend.py)."""
    from tests.fake_backend import make_test_tokenizer

    return make_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture
def backend(live):
    """The FakeBackend behind a module's ``live`` gateway (tests/fake_backend.py), fresh for each test."""
    return live.backend.reset()


@pytest.fixture
def answering(backend, hf_tok):
    """Makes the backend generate ``text``."""

    def answer(text: str) -> None:
        backend.output_ids = hf_tok.encode(text, add_special_tokens=False)

    return answer


@pytest.fixture
def client(live, backend):
    """The stock openai client, in strict mode, on a module's ``live`` gateway."""
    import openai

    from tests.fake_backend import API_KEYS

    return openai.OpenAI(
        base_url=live.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server (Debian's package; scripts/test installs it) on a free loopback port, nothing
    written to disk; its URL, and it is stopped after the module."""
    import subprocess
    import time

    import redis

    from cluster.serve import redis_server, remove_redis_config

    argv, url = redis_server(max_mb=64)  # the one `pdserve serve --gateways N` starts, on a free loopback port
    proc = subprocess.Popen([*argv, "--dir", str(tmp_path_factory.mktemp("redis"))], stdout=subprocess.DEVNULL)
    client = redis.Redis.from_url(url)
    give_up = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < give_up and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    remove_redis_config(argv)
