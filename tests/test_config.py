"""Config loading: precedence, unknown keys, coercion and errors, the shipped preset, no torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from configs.loader import load_config
from configs.schema import ConfigError, PdserveConfig

ROOT = Path(__file__).resolve().parents[1]


def write_yaml(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_without_sources():
    config = load_config(env={})
    assert config == PdserveConfig()
    assert config.engine.block_size == 16 and config.engine.enable_prefix_caching is True
    assert config.gateway.host == "127.0.0.1" and config.gateway.port == 8000
    assert config.transfer.lease_seconds == 30.0 and config.cluster.num_prefill == 1
    assert config.model.path == "" and config.model.max_model_len is None


def test_each_layer_overrides_the_previous(tmp_path):
    path = write_yaml(tmp_path, "engine:\n  block_size: 32\n  max_num_seqs: 8\n  prefill_chunk_size: 128\n")
    env = {"PDSERVE_ENGINE_MAX_NUM_SEQS": "4", "PDSERVE_ENGINE_PREFILL_CHUNK_SIZE": "64", "HOME": "/x"}
    config = load_config(path, env=env, overrides={"engine.prefill_chunk_size": 256})
    assert config.engine.block_size == 32  # YAML over default 16
    assert config.engine.max_num_seqs == 4  # env over YAML 8
    assert config.engine.prefill_chunk_size == 256  # override over env 64 and YAML 128
    assert config.engine.kv_cache_memory_mb == PdserveConfig().engine.kv_cache_memory_mb  # untouched


def test_process_variables_are_not_config():
    # The kernel caches' variables share the prefix; the processes read them where they act.
    env = {"PDSERVE_NATIVE_CACHE_DIR": "/x", "PDSERVE_CPU_FORMS_CACHE_DIR": "/y", "PDSERVE_RETIME_CPU_FORMS": "1"}
    assert load_config(env=env) == PdserveConfig()


@pytest.mark.parametrize("source", ["yaml", "override"])
def test_unknown_key_is_rejected_and_named(tmp_path, source):
    kwargs = {"env": {}}
    if source == "yaml":
        kwargs["yaml_path"] = write_yaml(tmp_path, "engine:\n  block_sise: 32\n")
    else:
        kwargs["overrides"] = {"engine.block_sise": 32}
    with pytest.raises(ConfigError, match=r"'engine\.block_sise'.*did you mean 'block_size'"):
        load_config(**kwargs)


def test_unknown_section_is_rejected_and_named(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section 'gatway'.*did you mean 'gateway'"):
        load_config(write_yaml(tmp_path, "gatway:\n  port: 1\n"), env={})
    with pytest.raises(ConfigError, match=r"unknown config section 'frobnicate'"):
        load_config(env={}, overrides={"frobnicate.x": "1"})


def test_env_values_are_coerced_to_field_types():
    env = {
        "PDSERVE_ENGINE_ENABLE_PREFIX_CACHING": "off",
        "PDSERVE_ENGINE_NUM_THREADS": "4",
        "PDSERVE_MODEL_MAX_MODEL_LEN": "none",
        "PDSERVE_TRANSFER_LEASE_SECONDS": "2.5",
        "PDSERVE_GATEWAY_API_KEYS": "k1, k2,,k3",
        "PDSERVE_TRANSFER_TRANSPORT": "shm",
    }
    config = load_config(env=env)
    assert config.engine.enable_prefix_caching is False
    assert config.engine.num_threads == 4
    assert config.model.max_model_len is None
    assert config.transfer.lease_seconds == 2.5
    assert config.gateway.api_keys == ["k1", "k2", "k3"]
    assert config.transfer.transport == "shm"


def test_yaml_types_checked_and_int_accepted_as_float(tmp_path):
    path = write_yaml(tmp_path, "transfer:\n  lease_seconds: 10\ngateway:\n  api_keys: [a, b]\n")
    config = load_config(path, env={})
    assert config.transfer.lease_seconds == 10.0 and isinstance(config.transfer.lease_seconds, float)
    assert config.gateway.api_keys == ["a", "b"]
    with pytest.raises(ConfigError, match=r"engine\.block_size: bad value 'big'"):
        load_config(write_yaml(tmp_path, "engine:\n  block_size: big\n"), env={})
    with pytest.raises(ConfigError, match=r"engine\.enable_prefix_caching: bad value 1"):
        load_config(write_yaml(tmp_path, "engine:\n  enable_prefix_caching: 1\n"), env={})
    with pytest.raises(ConfigError, match=r"engine\.block_size: bad value None.*cannot be null"):
        load_config(write_yaml(tmp_path, "engine:\n  block_size: null\n"), env={})


@pytest.mark.parametrize(
    "env, pattern",
    [
        (
            {"PDSERVE_ENGINE_BLOCK_SIZE": "sixteen"},
            r"engine\.block_size: bad value 'sixteen'.*PDSERVE_ENGINE_BLOCK_SIZE",
        ),
        ({"PDSERVE_ENGINE_ENABLE_PREFIX_CACHING": "maybe"}, r"enable_prefix_caching: bad value 'maybe'.*boolean"),
        ({"PDSERVE_TRANSFER_LEASE_SECONDS": "soon"}, r"transfer\.lease_seconds: bad value 'soon'"),
    ],
)
def test_bad_env_values_name_key_and_value(env, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(env=env)


def test_choices_and_bounds_are_checked():
    with pytest.raises(ConfigError, match=r"model\.dtype: must be one of auto, float32, bfloat16, float16; got 'fp8'"):
        load_config(env={}, overrides={"model.dtype": "fp8"})
    with pytest.raises(ConfigError, match=r"transfer\.transport: must be one of .*; got 'rdma'"):
        load_config(env={"PDSERVE_TRANSFER_TRANSPORT": "rdma"})
    with pytest.raises(ConfigError, match=r"engine\.block_size: must be >= 1; got 0"):
        load_config(env={}, overrides={"engine.block_size": "0"})


def test_overrides_from_cli_strings_are_coerced():
    config = load_config(
        env={},
        overrides={"gateway.port": "9000", "engine.enable_prefix_caching": "false", "model.path": "/models/tiny"},
    )
    assert config.gateway.port == 9000
    assert config.engine.enable_prefix_caching is False
    assert config.model.path == "/models/tiny"


def test_shipped_local_yaml_loads():
    config = load_config(ROOT / "configs" / "local.yaml", env={})
    assert config.gateway.host == "127.0.0.1" and config.gateway.api_keys == []
    assert config.model.max_model_len == 4096 and config.engine.num_threads is None
    assert config.cluster.num_prefill == 1 and config.cluster.num_decode == 1


def test_import_does_not_pull_in_torch():
    code = (
        "import sys, configs.schema, configs.loader, configs.environment, configs.model_source; "
        "configs.loader.load_config('configs/local.yaml', env={}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
