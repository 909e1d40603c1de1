"""The gateway's token-id bound: the tokenizer's highest id (added tokens included, however far above its
base vocabulary) and the model's embedding rows, as vLLM bounds prompt ids."""

from __future__ import annotations

from gateway.text.tokenizer import Tokenizer
from tests.model_factory import ADDED_IN_GAP_ID, ADDED_PAST_EMBEDDING_ID, added_tokens_model_dir


def test_added_tokens_above_the_token_count_are_valid_up_to_the_embedding():
    tok = Tokenizer(added_tokens_model_dir())
    # the layout under test: fewer tokens than the highest id, so a bound by count refuses real tokens
    assert tok.vocab_size == 702 and tok.max_token_id == ADDED_PAST_EMBEDDING_ID and tok.num_embeddings == 768
    assert tok.id_limit == 768
    assert tok.is_valid_id(ADDED_IN_GAP_ID) and tok.is_valid_id(0) and tok.is_valid_id(699)
    assert tok.decode([ADDED_IN_GAP_ID], skip_special_tokens=False) == "<|extra_0|>"
    assert not tok.is_valid_id(ADDED_PAST_EMBEDDING_ID) and not tok.is_valid_id(768) and not tok.is_valid_id(-1)
    assert tok.id_range_error(ADDED_PAST_EMBEDDING_ID) == (
        "token id 800 is out of range [0, 768): the tokenizer's highest id is 800; the model's embedding has 768 rows"
    )


def test_a_bare_tokenizer_is_bounded_by_its_highest_id(tok_dir):
    tok = Tokenizer(tok_dir)  # no config.json next to it
    assert tok.num_embeddings is None and tok.id_limit == tok.max_token_id + 1 == tok.vocab_size
