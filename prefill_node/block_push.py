"""Which blocks a step finished that the decode worker lacks, and where they go there.

After a step computes ``token_ids[c : c + n]`` of a job (``end = c + n``):

    blocks:  [ D has (skip)  | pushed earlier | full now: push | partial (tail) ]
             0     first_dst  next_block       end // bs        only pushed when end == len(token_ids)

A prefix hit on this node moves ``c`` past blocks nobody computed in this step; they still go out
when D lacks them, because ``next_block`` starts at D's ``skip_tokens // block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_manager import cdiv


@dataclass(slots=True)
class BlockPush:
    src_block_ids: list[int]  # this node's block ids
    dst_block_ids: list[int]  # the decode worker's, same order
    next_block: int  # the job's new next_block


def blocks_to_push(
    block_table: list[int],
    dst_block_ids: list[int],
    skip_tokens: int,
    next_block: int,
    end: int,
    num_tokens: int,
    block_size: int,
) -> BlockPush:
    """Blocks covered by ``end`` computed tokens not pushed yet (the tail too once ``end == num_tokens``)."""
    assert end <= num_tokens and len(block_table) >= cdiv(end, block_size), (end, num_tokens, len(block_table))
    first_dst = skip_tokens // block_size
    stop = cdiv(end, block_size) if end == num_tokens else end // block_size
    start = max(next_block, first_dst)
    indices = range(start, stop)
    return BlockPush(
        [block_table[i] for i in indices], [dst_block_ids[i - first_dst] for i in indices], max(stop, next_block)
    )
