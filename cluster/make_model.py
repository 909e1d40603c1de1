"""``pdserve make-model``: write a random-weight Hugging Face checkpoint of a supported family.

The checkpoint is complete enough for every consumer: ``config.json``, ``model.safetensors``,
``generation_config.json`` and a byte-level BPE tokenizer (trained offline on generated English-like
text) with a ChatML chat template, loadable by ``AutoTokenizer.from_pretrained``. Same arguments,
same files: weights come from ``torch.manual_seed(seed)``, the corpus from a fixed-seed generator.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "small", "llama3-8b")
# Shapes too large to write as random fp32 safetensors (32 GB): config.json, the generation config and a
# tokenizer only, for ``model.load_format: dummy`` (engine/model/dummy_weights.py) to make the weights.
CONFIG_ONLY = {"llama3-8b": "llama"}  # shape -> the one family it is

# Special tokens take the first ids, so every config shares bos/eos/pad ids with its tokenizer.
PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
PAD_ID, BOS_ID, EOS_ID, IM_END_ID = 0, 1, 2, 4
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DIMS = {
    # hidden, layers, heads, kv heads, intermediate, vocab, max positions
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=768, max_position_embeddings=2048),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536, vocab_size=32000, max_position_embeddings=8192),
    # Meta-Llama-3-8B's config.json (rope_theta 500000, rms_norm_eps 1e-5, untied), without its weights
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192),
}  # fmt: skip

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def build_config(family: str, size: str):
    """The transformers config of a family/size (no weights)."""
    from transformers import AutoConfig

    if family not in FAMILIES or size not in SIZES:
        raise ValueError(f"unknown family/size {family!r}/{size!r}; families: {FAMILIES}, sizes: {SIZES}")
    if CONFIG_ONLY.get(size, family) != family:
        raise ValueError(f"size {size!r} is a {CONFIG_ONLY[size]} shape, not {family}")
    dims = dict(_DIMS[size])
    dims["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    kwargs = dict(dims, rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  architectures=[_ARCHITECTURES[family]], dtype="float32")  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "llama" and size == "tiny":
        # Exercise Llama 3.1 scaling: with head_dim 16 the bands below/inside/above the window all occur.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
    if size == "llama3-8b":
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        kwargs.update(rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16")
    kwargs["rope_parameters"] = rope
    if family == "mistral":
        kwargs["sliding_window"] = None
    if family in ("qwen2", "qwen3"):
        kwargs.update(use_sliding_window=False, sliding_window=None, rope_theta=10000.0)
        # Tied embeddings, as the small Qwen releases ship them.
        kwargs["tie_word_embeddings"] = size == "tiny"
    model_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    return AutoConfig.for_model(model_type, **kwargs)


def english_like_corpus(num_chars: int, seed: int = 1234) -> list[str]:
    """Deterministic lines of English-like text (sentences from a fixed word list)."""
    rng = random.Random(seed)
    words = _WORDS.split()
    lines, total = [], 0
    while total < num_chars:
        sentences = []
        for _ in range(rng.randint(1, 4)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
            if rng.random() < 0.2:
                sentence += f" {rng.randint(0, 2025)}"
            sentences.append(sentence.capitalize() + rng.choice(".....?!,;:"))
        line = " ".join(sentences)
        lines.append(line)
        total += len(line) + 1
    return lines


def build_tokenizer(vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(english_like_corpus(300_000), trainer=trainer)
    assert tokenizer.get_vocab_size() <= vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    # The corpus runs out of merges long before a 32000 vocabulary. Fill the rest with plain word
    # tokens, so every id the model can emit decodes to text as in a released checkpoint: random
    # weights sample all ids alike, and an id with no text would stream as nothing at all.
    fillers = [
        AddedToken(f" w{i}", normalized=False, special=False) for i in range(tokenizer.get_vocab_size(), vocab_size)
    ]
    tokenizer.add_tokens(fillers)
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def make_model(family: str, size: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``out_dir`` (created if needed) and return it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = build_config(family, size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if size in CONFIG_ONLY:  # no weights: serve it with --load-format dummy
        config.save_pretrained(out)
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID).save_pretrained(
            out
        )
        build_tokenizer(config.vocab_size).save_pretrained(out)
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model)
    # Chat replies end with <|im_end|>; plain completions with </s>.
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID
    )
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def _perturb_vectors(model) -> None:
    """Random norm weights (around 1) and biases (around 0): at their init values of exactly 1 and 0
    a runtime that skipped a norm weight or a QKV bias would still match transformers."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_model(args.family, args.size, args.out, seed=args.seed)
    what = (
        "config and tokenizer (no weights: serve with --load-format dummy)"
        if args.size in CONFIG_ONLY
        else "checkpoint"
    )
    print(f"wrote {args.family}/{args.size} {what} to {path}")
    return 0


_WORDS = """
the of and to in a is that for it as was with be by on not he this are or his from at which but have
an they you were her she there been one all we their has would when if so what out up more will into
some them time could no than other then its about only new very also after many our these two may
first any like over such where most made through back much before how way even because good long
little own world great still years well man people under never same last might another while found
house day part right small place old work life home system water light city river mountain window
market garden story music letter answer question morning evening summer winter friend family school
teacher student paper number picture country dog cat bird tree flower sun moon star road car train
ship table chair door book word name hand head eye face voice color green blue red yellow white black
bright quiet warm cold strong gentle happy careful simple clear open early late quickly slowly always
often sometimes together again almost enough nothing something everything every each both between
around against during without within along across toward behind above below near far here today
tomorrow yesterday think know see look come go make take give find tell ask use feel try leave call
keep let begin seem help show hear play run move live believe bring write sit stand lose pay meet
include continue set learn change lead understand watch follow stop create speak read spend grow
open walk win offer remember love consider appear buy wait serve die send expect build stay fall cut
reach kill remain suggest raise pass sell require report decide pull model token server request cache
block memory prefill decode batch stream latency throughput engine kernel tensor layer attention
""".strip()


if __name__ == "__main__":
    raise SystemExit(main())
