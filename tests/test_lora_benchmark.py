"""benchmarks.serve.lora's arithmetic and systems: a system's throughput over rounds is its tokens over
its time (a ratio of sums, not a mean of per-round ratios), and the two systems differ only in LoRA."""

from __future__ import annotations

import pytest

from benchmarks.serve.lora import sections, total_per


def test_throughput_over_rounds_is_a_ratio_of_sums():
    runs = [
        {"run": "base", "output_tokens": 100, "wall_s": 1.0, "cpu_s": 2.0},
        {"run": "base", "output_tokens": 300, "wall_s": 5.0, "cpu_s": 2.0},
        {"run": "lora", "output_tokens": 100, "wall_s": 4.0, "cpu_s": 1.0},
    ]
    assert total_per(runs, "base", "wall_s") == pytest.approx(400 / 6.0)  # not (100 + 60) / 2
    assert total_per(runs, "base", "cpu_s") == pytest.approx(100.0)
    assert total_per(runs, "lora", "wall_s") == pytest.approx(25.0)


def test_the_two_systems_differ_only_in_their_lora_section():
    lora = {"enable_lora": True, "lora_modules": ["a0=/x"], "max_loras": 4, "max_lora_rank": 16}
    base, with_lora = sections(None), sections(lora)
    assert "lora" not in base and with_lora.pop("lora") == lora
    assert with_lora == base and base["engine"]["enable_prefix_caching"] is True
