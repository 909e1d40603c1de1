"""The ``pdserve`` command as a user runs it: make a model, generate from it, get clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.llm import LLM
from engine.sampling.params import SamplingParams


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, timeout=300)


def test_make_model_then_generate_matches_the_library(tmp_path: Path) -> None:
    out = tmp_path / "qwen3-tiny"
    made = pdserve("make-model", "--family", "qwen3", "--size", "tiny", "--out", str(out), "--seed", "3")
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]

    run = pdserve("generate", "--model", str(out), "--prompt", "hello world", "--max-tokens", "6", "--ignore-eos")
    assert run.returncode == 0, run.stderr
    llm = LLM(str(out))
    [expected] = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert "(length, 6 tokens)" in run.stdout
    assert run.stdout.rstrip("\n").endswith(expected.outputs[0].text)


def test_generate_rejects_bad_sampling_value_by_name(tmp_path: Path) -> None:
    run = pdserve("generate", "--model", str(tmp_path), "--prompt", "x", "--top-p", "1.5")
    assert run.returncode == 2
    assert "top_p must be in (0, 1], got 1.5" in run.stderr


def test_unknown_command_lists_the_commands() -> None:
    run = pdserve("frobnicate")
    assert run.returncode == 2
    assert "unknown command 'frobnicate'" in run.stderr and "make-model" in run.stderr


# --- vLLM's flag names (cluster/vllm_flags.py): each lands on its config field --------------------------

VLLM_COMMAND_LINE = [
    "--served-model-name",
    "X",
    "--max-model-len",
    "4k",
    "--dtype",
    "half",
    "--block-size",
    "32",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "1024",
    "--no-enable-prefix-caching",
    "--seed",
    "7",
    "--chat-template",
    "{{ messages[0]['content'] }}",
    "--kv-cache-memory-bytes",
    "2GiB",
    "--otlp-traces-endpoint",
    "http://127.0.0.1:4318/v1/traces",
    "--host",
    "127.0.0.2",
    "--port",
    "9000",
    "--api-key",
    "k1",
    "k2",
    "--api-key",
    "k3",
    "--log-level",
    "debug",
    "--log-format",
    "json",
    "--tensor-parallel-size",
    "1",
    "--long-prefill-token-threshold",
    "128",
    "--set",
    "gateway.worker_port=9001",
]


def serve_config(argv: list[str], env: dict[str, str] | None = None):
    from cluster.roles import command_line_overrides
    from cluster.serve import parse_args
    from configs.loader import load_config

    args = parse_args(argv)
    return args, load_config(args.config, env=env or {}, overrides=command_line_overrides(args, "gateway"))


def test_serve_takes_vllm_flags_onto_the_config() -> None:
    args, config = serve_config(["/models/m", *VLLM_COMMAND_LINE])
    assert args.model == "/models/m"  # `vllm serve MODEL`
    assert (config.model.served_model_name, config.model.max_model_len, config.model.dtype) == ("X", 4000, "float16")
    assert config.model.chat_template == "{{ messages[0]['content'] }}"
    e = config.engine
    assert (e.block_size, e.max_num_seqs, e.max_num_batched_tokens, e.enable_prefix_caching, e.seed) == (
        32,
        8,
        1024,
        False,
        7,
    )
    assert (e.kv_cache_memory_mb, e.prefill_chunk_size) == (2048, 128)
    g = config.gateway
    assert (g.host, g.port, g.api_keys, g.worker_port) == ("127.0.0.2", 9000, ["k1", "k2", "k3"], 9001)
    o = config.observability
    assert (o.otlp_traces_endpoint, o.log_level, o.log_format) == ("http://127.0.0.1:4318/v1/traces", "debug", "json")


def test_vllm_flags_rank_above_env_and_set_env_above_defaults() -> None:
    env = {
        "PDSERVE_ENGINE_BLOCK_SIZE": "64",
        "PDSERVE_ENGINE_MAX_NUM_SEQS": "3",
        "PDSERVE_MODEL_SERVED_MODEL_NAME": "E",
    }
    _, config = serve_config(["--block-size", "8", "--set", "engine.max_num_seqs=5"], env)
    assert (config.engine.block_size, config.engine.max_num_seqs, config.model.served_model_name) == (8, 5, "E")
    _, config = serve_config(["--set", "engine.block_size=4", "--block-size", "8"], {})
    assert config.engine.block_size == 8  # the vLLM flag and --set name one field: the flag wins


def test_serve_passes_flags_to_every_member_as_env_over_inherited_ones() -> None:
    from cluster.roles import command_line_overrides
    from cluster.serve import cluster_env, parse_args

    args = parse_args(["--max-model-len", "256", "--served-model-name", "X", "--log-format", "json"])
    env = cluster_env(command_line_overrides(args, "gateway"), "/m", "127.0.0.1", [8001])
    assert env["PDSERVE_MODEL_MAX_MODEL_LEN"] == "256" and env["PDSERVE_MODEL_SERVED_MODEL_NAME"] == "X"
    assert env["PDSERVE_OBSERVABILITY_LOG_FORMAT"] == "json" and env["PDSERVE_MODEL_PATH"] == "/m"
    assert env["PDSERVE_DECODE_GATEWAY_ADDRESS"] == "tcp://127.0.0.1:8001"


def test_role_commands_take_vllm_flags() -> None:
    from cluster.roles import command_line_overrides, role_command

    p = argparse_for("decode")
    args = p.parse_args(["--block-size", "32", "--host", "lo", "--port", "0", "--log-level", "warning"])
    argv, _ = role_command("decode", None, command_line_overrides(args, "decode"), {})
    assert argv[3::2] == ["--set"] * 4
    assert set(argv[4::2]) == {
        "engine.block_size=32",
        "decode.host=127.0.0.1",
        "decode.http_port=0",
        "observability.log_level=warning",
    }
    args = argparse_for("gateway").parse_args(["--served-model-name", "X", "--port", "9000"])
    _, env = role_command("gateway", None, command_line_overrides(args, "gateway"), {"PDSERVE_GATEWAY_PORT": "1"})
    assert (env["PDSERVE_MODEL_SERVED_MODEL_NAME"], env["PDSERVE_GATEWAY_PORT"]) == ("X", "9000")


def argparse_for(role: str):
    import argparse

    from cluster.roles import add_config_args
    from cluster.vllm_flags import add_vllm_groups

    p = argparse.ArgumentParser()
    add_config_args(p)
    add_vllm_groups(p, role)
    return p


def test_serve_help_groups_flags_as_vllm_does() -> None:
    run = pdserve("serve", "--help")
    assert run.returncode == 0
    titles = [line[:-1] for line in run.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    for title in ("ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "ObservabilityConfig", "Frontend"):
        assert title in titles, titles
    assert "--no-enable-prefix-caching" in run.stdout and "(engine.kv_cache_memory_mb)" in run.stdout


def test_refused_and_unknown_flags_exit_non_zero_with_what_to_do() -> None:
    # A value argparse can judge alone is a usage error (2); a setting pdserve refuses is a configuration
    # error (78, EX_CONFIG), which `pdserve serve` never restarts.
    usage, config = 2, 78
    cases = [
        (
            ("serve", "--tensor-parallel-size", "2"),
            config,
            "--tensor-parallel-size 2: pdserve runs each worker on one device",
        ),
        (("decode", "-tp", "4"), config, "--tensor-parallel-size 4"),
        (("serve", "--gpu-memory-utilization", "0.9"), config, "use --kv-cache-memory-bytes"),
        (("prefill", "--kv-cache-memory-bytes", "1000"), config, "needs at least 1 MiB"),
        (("serve", "--dtype", "fp8"), usage, "argument --dtype: invalid choice: 'fp8'"),
        (("serve", "--max-model-len", "lots"), usage, "expected a token count"),
        (("gateway", "--frobnicate", "1"), usage, "unrecognized arguments: --frobnicate"),
        (("serve", "--log-format", "xml"), usage, "argument --log-format: invalid choice: 'xml'"),
        (("serve", "--served-model-name", "a", "b"), config, "pdserve serves one model under one name"),
    ]
    for args, code, message in cases:
        run = pdserve(*args)
        assert run.returncode == code, (args, run.stdout, run.stderr)
        assert message in run.stderr, (args, run.stderr)


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path: Path) -> None:
    import pytest

    from gateway.text.tokenizer import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="'missing.jinja' is neither a file nor a Jinja template"):
        load_chat_template("missing.jinja")


def test_seed_makes_unseeded_sampling_repeatable(tmp_path: Path) -> None:
    """engine.seed (--seed) seeds the generator unseeded requests share: two engines with one seed
    sample the same tokens at temperature 1, as vLLM's --seed makes them."""
    from tests.model_factory import tiny_model_dir

    model = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int) -> list[int]:
        llm = LLM(model, seed=seed, cpu_decode_linear="torch", cpu_decode_attention="torch", cpu_layer_ops="torch")
        [out] = llm.generate([[5, 9, 11, 13]], params)
        return list(out.outputs[0].token_ids)

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first  # 12 draws over the vocabulary: equal by chance ~never
