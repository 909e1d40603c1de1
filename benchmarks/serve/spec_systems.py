"""The served speculative decoding comparison (issue #46) on the real SmolLM2-135M-Instruct, float32:

- ``coloc-spec``: ``pdserve serve --prefill 0 --decode 1`` with n-gram speculation (SPEC, the engine
  benchmark's configuration: benchmarks/engine/spec_decode.py);
- ``coloc-nospec``: the same without it;
- ``llama-spec``: llama-server on the f32 GGUF of the same checkpoint (converted and its greedy output
  checked against transformers, as for ``llama``) with its own prompt-lookup speculation
  (``--spec-type ngram-simple``, this build's flags; ``llama-server --help`` lists ngram-simple,
  ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache and the draft-model types), ``--parallel`` = streams.

Each runs the ``spec`` workload: chat prompts of benchmarks/engine/spec_workloads.py, ``spec_copy``
(repeat, correct or rewrite a given docs paragraph: the output copies the prompt) and ``spec_free``
(open questions), SPEC_OUTPUT_LEN tokens each (EOS ignored), a closed loop at each of SPEC_STREAMS.

``spec_headlines`` (the last line of ``python -m benchmarks.serve`` when these systems ran), each a
ratio of output tokens/s in the same run, defined here before any was measured:

    spec_copy_1          coloc-spec / coloc-nospec, spec_copy, 1 stream    (issue: >= 1.8)
    spec_free_1          coloc-spec / coloc-nospec, spec_free, 1 stream    (issue: >= 0.95)
    spec_free_16         coloc-spec / coloc-nospec, spec_free, 16 streams  (issue: >= 1.0, noise aside)
    spec_vs_llama_copy_1 coloc-spec / llama-spec, spec_copy, 1 stream      (issue: >= 1.3)
"""

from __future__ import annotations

import json

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC_STREAMS = (1, 4, 16)
SPEC_OUTPUT_LEN = 128
SPEC_KINDS = ("spec_copy", "spec_free")  # the workload labels of the runs (benchmarks/engine/spec_workloads.py)
LLAMA_SPEC_FLAGS = ("--spec-type", "ngram-simple")
SPEC_SYSTEMS = ("coloc-spec", "coloc-nospec", "llama-spec")


def spec_engine_section() -> dict:
    return {"speculative_config": json.dumps(SPEC)}


def spec_headlines(report) -> dict[str, float]:
    """The four ratios above, nan where a run is missing; ``report``: serve.report.Report."""
    from benchmarks.serve.report import _ratio, _value, streams_load

    def tps(system: str, kind: str, streams: int) -> float:
        load = streams_load(streams)
        run = next((r for r in report.runs if (r.system, r.workload, r.load) == (system, kind, load)), None)
        return _value(run, "tps")

    return {
        "spec_copy_1": _ratio(tps("coloc-spec", "spec_copy", 1), tps("coloc-nospec", "spec_copy", 1)),
        "spec_free_1": _ratio(tps("coloc-spec", "spec_free", 1), tps("coloc-nospec", "spec_free", 1)),
        "spec_free_16": _ratio(tps("coloc-spec", "spec_free", 16), tps("coloc-nospec", "spec_free", 16)),
        "spec_vs_llama_copy_1": _ratio(tps("coloc-spec", "spec_copy", 1), tps("llama-spec", "spec_copy", 1)),
    }
