"""``pdserve generate``: offline generation in one process (no gateway, no workers)."""

from __future__ import annotations

import argparse
import sys

from cluster.vllm_flags import add_lora_flags, lora_overrides


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the embedded small model)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--config", default=None, help="YAML config file (engine section is used)")
    add_lora_flags(p)
    p.add_argument("--lora-name", default="", help="run every prompt under this adapter of --lora-modules")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from engine.llm import LLM  # torch is imported only here
    from engine.sampling.params import SamplingError, SamplingParams

    try:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            ignore_eos=args.ignore_eos,
            lora_name=args.lora_name,
        )
    except SamplingError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    from configs.loader import load_config
    from configs.schema import EX_CONFIG, ConfigError

    try:
        config = load_config(args.config, overrides=lora_overrides(args))
    except ConfigError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return EX_CONFIG
    from configs.model_source import resolve_model

    try:
        model = resolve_model(args.model or config.model.path, config.model.cache_dir)
    except ConfigError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return EX_CONFIG
    try:
        llm = LLM(str(model), config=config)
    except ConfigError as e:  # an adapter that does not fit the model: named, with the mismatch
        print(f"pdserve generate: {e}", file=sys.stderr)
        return EX_CONFIG
    prompts = [llm.apply_chat_template(p) for p in args.prompt] if args.chat else args.prompt
    try:
        results = llm.generate(prompts, params)
    except ValueError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    for prompt, result in zip(args.prompt, results):
        for completion in result.outputs:
            print(
                f"--- prompt: {prompt!r} completion {completion.index} ({completion.finish_reason}, "
                f"{len(completion.token_ids)} tokens)"
            )
            print(completion.text)
    return 0
