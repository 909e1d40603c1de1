"""Runs llama.cpp's own ``convert_hf_to_gguf.py`` on pdserve's benchmark model, unedited, with the two
things it lacks for this checkpoint supplied from outside:

1. Its pre-tokenizer. The converter names a BPE tokenizer's pre-tokenizer by the hash of the ids it
   gives for a fixed text, and knows only published models' hashes; pdserve's offline tokenizer
   (``cluster/make_model.py``) is a byte-level BPE whose pre-tokenizer is GPT-2's split regex, so an
   unknown hash on a tokenizer.json saying exactly that (``ByteLevel``, ``use_regex``) is GPT-2's, which
   llama.cpp calls ``gpt-2``. Any other unknown tokenizer still fails as the converter would.
2. ``mistral_common`` and ``sentencepiece``, which the converter imports but needs only for other
   kinds of checkpoint (ONLY_FOR_OTHER_CHECKPOINTS); when they are not installed, empty stand-ins
   let it import them.

    python -m benchmarks.peers.gguf_convert LLAMA_CPP_DIR MODEL_DIR OUT.gguf [--outtype f32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

GPT2_PRE_TOKENIZER = "gpt-2"


def is_gpt2_byte_level(model_dir: Path) -> bool:
    """Whether the checkpoint's tokenizer.json pre-tokenizes as GPT-2 does: byte-level with its regex."""
    pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


# Modules the converter imports unconditionally but needs only for checkpoints of other kinds, each
# with the names it imports from them: a Mistral-format checkpoint (mistral_common) or one with a
# SentencePiece ``tokenizer.model`` (sentencepiece; the converter raises FileNotFoundError for its
# absence right after the import, and goes on to the tokenizer.json path).
ONLY_FOR_OTHER_CHECKPOINTS = {
    "mistral_common.tokens.tokenizers.base": {"TokenizerVersion": None},
    "mistral_common.tokens.tokenizers.multimodal": {"DATASET_MEAN": None, "DATASET_STD": None},
    "mistral_common.tokens.tokenizers.tekken": {"Tekkenizer": None},
    "mistral_common.tokens.tokenizers.sentencepiece": {"SentencePieceTokenizer": None},
    "sentencepiece": {"SentencePieceProcessor": None},
}


def _stand_in_missing_modules() -> None:
    """Empty modules for those of ONLY_FOR_OTHER_CHECKPOINTS that are not installed (a checkpoint that
    needed them would fail on the stand-ins, which is not what this converts)."""
    for dotted, attrs in ONLY_FOR_OTHER_CHECKPOINTS.items():
        top = dotted.split(".")[0]
        if top not in sys.modules and importlib.util.find_spec(top) is not None:
            continue
        parts = dotted.split(".")
        for depth in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
        sys.modules[dotted].__dict__.update(attrs)


def _text_model_class(converter):
    try:  # llama.cpp of llama-cpp-python 0.3.36 keeps its model classes in conversion/ beside the script
        from conversion.base import TextModel
    except ImportError:  # older releases: in convert_hf_to_gguf.py itself
        return converter.TextModel
    return TextModel


def _map_our_pre_tokenizer(converter, model_dir: Path) -> None:
    text_model = _text_model_class(converter)
    known = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_byte_level(model_dir):
                raise
            return GPT2_PRE_TOKENIZER

    text_model.get_vocab_base_pre = get_vocab_base_pre


def convert(llama_cpp_dir: Path, model_dir: Path, out: Path, outtype: str = "f32") -> None:
    import transformers  # noqa: F401  first: it probes for mistral_common itself and must not see a stand-in

    _stand_in_missing_modules()
    sys.path.insert(0, str(llama_cpp_dir))  # the converter then puts its own gguf-py on the path
    import convert_hf_to_gguf as converter

    _map_our_pre_tokenizer(converter, model_dir)
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    converter.main()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.gguf_convert", description=__doc__)
    p.add_argument("llama_cpp_dir", type=Path)
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", default="f32")
    args = p.parse_args(argv)
    convert(args.llama_cpp_dir, args.model_dir, args.out, args.outtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
