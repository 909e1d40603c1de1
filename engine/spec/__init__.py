"""Speculative decoding: proposers of draft tokens and their verification against the target model."""
