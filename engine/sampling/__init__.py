"""From logits to tokens: sampling parameters, the sampler, prompt logprobs, and structured outputs' grammars."""
