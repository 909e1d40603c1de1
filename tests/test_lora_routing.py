"""LoRA in the block hashes and the router: each adapter (and the base) hashes a prompt's blocks apart,
the same on the gateway and in the engine (where a pinned adapter's files digest joins in); a request goes only to workers that hold its adapter, and
among equals to one that holds it in a device slot."""

from dataclasses import replace

from engine.kv.block_manager import BlockManager
from engine.lora.adapter import LoRAAdapter
from engine.sampling.params import SamplingParams
from engine.sched.sequence import Sequence
from gateway.workers.registry import Role, WorkerRegistry
from gateway.workers.router import Policy, Router, RouterParams
from protocol.hashing import block_hashes, lora_identity, root_hash
from tests.test_gateway_router import BS, hb


def test_every_adapter_and_salt_hashes_a_prompt_apart():
    prompt = list(range(3 * BS))
    roots = {(salt, lora): root_hash(salt, lora) for salt in ("", "t1") for lora in ("", "a", "b")}
    assert len(set(roots.values())) == len(roots)
    assert roots["", ""] == 0 and roots["t1", ""] == root_hash("t1")  # unchanged where no adapter is named
    chains = {key: block_hashes(prompt, BS, *key) for key in roots}
    assert len({h for chain in chains.values() for h in chain}) == 3 * len(roots)  # no block shared


def test_the_engine_caches_under_the_gateways_hashes():
    bm = BlockManager(16, BS)
    prompt = list(range(2 * BS + 1))
    seq = Sequence(0, prompt, SamplingParams(lora_name="a", lora_path="/x"))
    bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(seq)
    assert bm.match_prefix(prompt, lora=lora_identity("a", "/x")) == (seq.block_table[:2], 2 * BS)
    # the base, another adapter, the same name loaded again from elsewhere
    for other in ("", lora_identity("b", "/x"), lora_identity("a", "/y")):
        assert bm.match_prefix(prompt, lora=other) == ([], 0), other
    assert [bm.block_hash[b] for b in seq.block_table[:2]] == block_hashes(prompt, BS, lora=lora_identity("a", "/x"))


def test_a_pinned_adapters_files_digest_enters_the_engines_hashes():
    """On a worker a request holds its adapter's weights, whose files' digest joins the name and path:
    the same name and directory with other bytes (rewritten in place, loaded again) shares no KV."""
    bm = BlockManager(16, BS)
    prompt = list(range(2 * BS + 1))
    seq = Sequence(0, prompt, SamplingParams(lora_name="a", lora_path="/x"))
    seq.params.lora_adapter = LoRAAdapter("a", "/x", 1, 1.0, frozenset(), {}, digest="d1")  # no weights needed
    bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(seq)
    assert bm.match_prefix(prompt, lora=lora_identity("a", "/x", "d1")) == (seq.block_table[:2], 2 * BS)
    for other in (lora_identity("a", "/x"), lora_identity("a", "/x", "d2")):
        assert bm.match_prefix(prompt, lora=other) == ([], 0), other


def worker(wid, role=Role.DECODE, in_use=0, loras=(), hot=()):
    return replace(hb(wid, role, in_use=in_use), lora_names=list(loras), hot_lora_names=list(hot))


def test_router_sends_an_adapters_request_only_where_it_is_loaded_hot_first():
    reg = WorkerRegistry()
    for w in (
        worker("d1"),
        worker("d2", in_use=30, loras=["a"]),
        worker("d3", in_use=50, loras=["a"], hot=["a"]),
        worker("p1", Role.PREFILL),
        worker("p2", Role.PREFILL, loras=["a"]),
    ):
        reg.observe(w, 0.0)
    router = Router(reg, RouterParams(BS, Policy.PREFIX, local_prefill_max_tokens=0))
    prompt = list(range(3 * BS))
    base = router.route(prompt)
    assert (base.decode_worker, base.prefill_worker) == ("d1", "p1")  # least loaded; every worker serves the base
    lora = router.route(prompt, lora_name="a")
    assert (lora.decode_worker, lora.prefill_worker) == ("d3", "p2")  # no hit anywhere: the hot one beats load
    assert lora.decode_cached_tokens == 0  # the base's blocks on d1 are no hit for the adapter
    assert router.route(prompt, lora_name="b") is None  # nobody holds it: no worker can take it
