"""Records of the serving plane: gateway <-> workers, and decode worker -> prefill worker.

Sockets (every bind on a configured interface, never all interfaces by default):

    gateway   ROUTER bound at gateway.host:gateway.worker_port. Each worker connects one DEALER whose
              ZeroMQ identity is its worker_id.
              worker -> gateway: Heartbeat (also the registration), TokenEvent (or a step's worth as
              TokenEvents), PromptLogprobs, Busy, Goodbye
              gateway -> worker: HeartbeatAck (both roles), Generate (decode only), AbortRequest (both)
              Several gateways may serve one pool: a worker connects one DEALER to each
              (worker/gateway_links.py) and answers a request on the gateway that sent it.
    prefill   ROUTER bound at prefill.host:prefill.port (its ``address`` in heartbeats).
              decode -> prefill: PrefillJob, AbortRequest;  prefill -> decode: PrefillFailed
    decode    KV receiver (kvtransfer) bound at decode.host:decode.kv_port; prefill workers write there.

One request, disaggregated (n = 1):
    gateway --Generate(prefill_address=P)--> D: prefix match, reserve blocks for the uncached suffix
    D --PrefillJob(range [skip, len), dst blocks, generation, sample_first)--> P
    P: chunked prefill; KV of each finished chunk -> D (kvtransfer); samples the first token,
       --TokenEvent(index 0, offset 0)--> gateway at once (TTFT), Commit(first token) -> D
    D: adopts the blocks, decodes; --TokenEvent(offset 1, 2, ...)--> gateway until finished
With n > 1, D asks P for [skip, len - 1) with sample_first = False, computes the last prompt token
itself and forks the n completions copy-on-write: the prompt's KV crosses the wire once.
The gateway orders a completion's tokens by ``offset``; a completion ends with a finish_reason or
an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import wire_record

ROLES = ("prefill", "decode")
FINISH_REASONS = ("", "stop", "length")  # "" while the completion is still running
# Whose fault a failure is: the gateway's circuit breaker counts it against that worker. "decode" and
# "prefill" name the request's decode worker and the prefill worker it relied on; "none" is nobody's
# (a deadline, a drain, a request the client made wrong). "" on a TokenEvent that is no error.
CULPRITS = ("", "decode", "prefill", "none")


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a token's bias: [-100, 100] (gateway and engine both check it)
# What a structured output may ask for (engine/sampling/structured_output.py), and how long its text may be: a
# Generate frame also carries the prompt, all within the codec's 1 MB.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
MAX_REASONING_END_CHARS = 64
MAX_CACHE_SALT_CHARS = 1024
MAX_LORA_NAME_CHARS = 256


@wire_record("serve.token_bias")
@dataclass(slots=True)
class TokenBias:
    """One entry of a request's logit_bias (msgpack maps here have string keys only)."""

    token_id: int
    bias: float


@wire_record("serve.structured_output")
@dataclass(slots=True)
class StructuredOutput:
    """The grammar a request's output must follow (vLLM's structured outputs, OpenAI's response_format)."""

    kind: str  # one of STRUCTURED_OUTPUT_KINDS
    # json: the JSON schema's text; json_object: ""; regex: the pattern; choice: a JSON list of the
    # strings allowed; grammar: EBNF (xgrammar's dialect, GBNF-like, with a ``root`` rule)
    spec: str = ""
    # The grammar applies after this text is in the output ("" from the first token): a reasoning
    # parser's end tag, for an output that starts inside the model's reasoning (vLLM's behaviour).
    after: str = ""

    def __post_init__(self) -> None:
        assert self.kind in STRUCTURED_OUTPUT_KINDS, f"unknown structured output kind {self.kind[:40]!r}"
        assert len(self.spec) <= MAX_STRUCTURED_OUTPUT_CHARS, f"{len(self.spec)} characters of grammar"
        assert len(self.after) <= MAX_REASONING_END_CHARS, f"{len(self.after)} characters of reasoning end"


@wire_record("serve.sampling")
@dataclass(slots=True)
class SamplingSpec:
    """Sampling of one request; field names and meanings are engine.SamplingParams'."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top k
    logit_bias: list[TokenBias] = field(default_factory=list)  # engine.SamplingParams.logit_bias as a list
    allowed_token_ids: list[int] | None = None  # None: any token; else only these are sampled
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob plus the top k
    structured_output: StructuredOutput | None = None  # None: any output
    # vLLM's cache_salt: "" shares prefix KV with every unsalted request; else only with the same salt
    # (it enters the first block's hash, protocol/hashing.py). Not sampling, but it travels with it to
    # every node that hashes the prompt's blocks.
    cache_salt: str = ""
    # "" for the base model, else the LoRA adapter the request runs under (a served name, /v1/models):
    # every node computes its KV with that adapter and hashes its blocks under it (protocol/hashing.py)
    lora_name: str = ""
    lora_path: str = ""  # the adapter's directory as the gateway lists it: hashed with the name, checked by workers

    def __post_init__(self) -> None:
        assert len(self.lora_name) <= MAX_LORA_NAME_CHARS, f"{len(self.lora_name)} characters of lora_name"
        assert self.max_tokens >= 1 and self.n >= 1, (self.max_tokens, self.n)
        assert 0 <= self.min_tokens <= self.max_tokens, (self.min_tokens, self.max_tokens)
        assert len(self.cache_salt) <= MAX_CACHE_SALT_CHARS, f"{len(self.cache_salt)} characters of cache_salt"

    @property
    def computes_whole_prompt(self) -> bool:
        """Prompt logprobs: every prompt token is computed, whatever a worker caches (cached tokens have
        no logits)."""
        return self.prompt_logprobs is not None

    @property
    def prefills_on_decode(self) -> bool:
        """Prompt logprobs with n > 1: the decode worker prefills the prompt itself, since a prefill
        worker's job would stop short of the last prompt token (see the module docstring)."""
        return self.computes_whole_prompt and self.n > 1

    def logit_bias_map(self) -> dict[int, float] | None:
        """``logit_bias`` as engine.SamplingParams takes it (None when empty)."""
        return {b.token_id: b.bias for b in self.logit_bias} or None


@wire_record("serve.generate")
@dataclass(slots=True)
class Generate:
    """gateway -> decode worker."""

    rid: str
    token_ids: list[int]  # the whole prompt
    sampling: SamplingSpec
    prefill_address: str  # the chosen prefill worker's endpoint; "" = prefill locally on this worker
    deadline: float  # time.time() after which every node drops the request and frees its blocks
    traceparent: str = ""  # W3C trace context of the gateway's request span; "" = not traced
    # The sending gateway's id (its HeartbeatAck's): where the request's events go back to, and whose
    # loss aborts it. "" from a gateway that never acks (tests): any link not yet acked answers.
    gateway_id: str = ""
    # The prefill worker's CURVE public key (z85) as it registered: the decode worker takes this request's
    # KV from that key only. "" on an insecure plane or with local prefill.
    prefill_key: str = ""

    def __post_init__(self) -> None:
        assert self.token_ids, "empty prompt"


@wire_record("serve.abort")
@dataclass(slots=True)
class AbortRequest:
    """gateway -> either worker, decode -> prefill. Idempotent; unknown rids are ignored."""

    rid: str
    reason: str = ""


@wire_record("serve.logprob")
@dataclass(slots=True)
class TokenLogprobRecord:
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)  # best first
    top_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.top_ids) == len(self.top_logprobs)


@wire_record("serve.tokens")
@dataclass(slots=True)
class TokenEvent:
    """worker -> gateway: new tokens of one completion of one request."""

    rid: str
    index: int  # which completion, 0 .. n-1
    offset: int  # tokens of this completion sent before these; the gateway orders by it
    token_ids: list[int]
    logprobs: list[TokenLogprobRecord] | None = None  # one per token when asked for
    finish_reason: str = ""  # "" while running; "stop" | "length" on the completion's last event
    num_cached_tokens: int = -1  # prompt tokens not recomputed; >= 0 on the decode worker's first event
    error: str = ""  # non-empty: the request failed on the worker; nothing more follows for it
    # With error: the worker refused the request as one it can never serve (the client's fault: a bad
    # grammar, a prompt past the context), before doing any work for it.
    refused: bool = False
    # With error, from the decode worker: whose fault it was (CULPRITS; "" = the sender's own). The gateway
    # takes "prefill" only when the request had a prefill worker, and a prefill worker's error as its own.
    culprit: str = ""

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert self.culprit in CULPRITS, f"unknown culprit {self.culprit[:20]!r}"
        assert self.logprobs is None or len(self.logprobs) == len(self.token_ids)


TOKEN_EVENTS_PER_FRAME = 64  # a TokenEvents frame with top-20 logprobs per event stays near 64 KB


@wire_record("serve.tokens_batch")
@dataclass(slots=True)
class TokenEvents:
    """worker -> gateway: the TokenEvents of one engine step for requests of that gateway, in one frame.
    One frame per token of every stream cost the decode worker a send and the gateway a receive, a
    decode and a dispatch each (at 16 streams, 16 of each per step); the gateway takes each event of a
    batch as if it came alone, checking it against the request it names."""

    events: list[TokenEvent]

    def __post_init__(self) -> None:
        assert 0 < len(self.events) <= TOKEN_EVENTS_PER_FRAME


PROMPT_LOGPROBS_PER_FRAME = 256  # a PromptLogprobs frame with top-20 entries stays near 100 KB


@wire_record("serve.prompt_logprobs")
@dataclass(slots=True)
class PromptLogprobs:
    """worker -> gateway, before the request's first TokenEvent and from the same worker: the logprobs of
    prompt tokens ``start + 1 .. start + len(logprobs)`` (token 0 has none), in frames of at most
    PROMPT_LOGPROBS_PER_FRAME entries. Sent by whoever computed the whole prompt."""

    rid: str
    start: int  # entries before this frame's first one
    logprobs: list[TokenLogprobRecord]  # the prompt token's logprob and the top k, one per token
    ranks: list[int]  # each prompt token's rank under the model (1 = most likely)

    def __post_init__(self) -> None:
        assert self.start >= 0 and len(self.ranks) == len(self.logprobs) <= PROMPT_LOGPROBS_PER_FRAME


@wire_record("serve.busy")
@dataclass(slots=True)
class Busy:
    """decode worker -> gateway, at once: it cannot reserve blocks for this request now."""

    rid: str
    reason: str


@wire_record("serve.heartbeat")
@dataclass(slots=True)
class Heartbeat:
    """worker -> gateway every heartbeat interval; the first one registers the worker."""

    worker_id: str  # also the worker's DEALER identity at the gateway
    role: str  # "prefill" | "decode"
    address: str  # prefill: its job endpoint; decode: its KV receiver endpoint
    incarnation: str  # new on every process start
    block_size: int
    kv_blocks_total: int
    kv_blocks_free: int  # free + evictable cached blocks
    kv_blocks_in_use: int  # referenced by live requests or reservations (excludes evictable cache)
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens still to compute
    draining: bool = False  # finishing in-flight work; send it nothing new
    # HMAC(cluster key, the worker's CURVE public key, worker_id, incarnation) in hex: proves membership
    # (protocol/curve.py); "" on an insecure plane.
    proof: str = ""
    lora_names: list[str] = field(default_factory=list)  # LoRA adapters loaded (requests may name them)
    hot_lora_names: list[str] = field(default_factory=list)  # of those, the ones in device slots now
    # The cluster's adapter list as this worker last applied it (LoRAAdapterSet: its stamp, names and
    # paths; stamp (0, "") = the worker's config). Every gateway reads it: the newest list any worker
    # holds is the one every gateway serves, and a worker behind it is sent it.
    lora_set_version: int = 0
    lora_set_gateway: str = ""
    lora_set_names: list[str] = field(default_factory=list)
    lora_set_paths: list[str] = field(default_factory=list)
    lora_set_signature: str = ""  # the gateway's signature of that list, as received (LoRAAdapterSet)
    lora_errors: list[str] = field(default_factory=list)  # "name: why" of adapters in that list it could not load
    # Liveness apart from load (worker/liveness.py): heartbeats come from a thread of their own, so a long
    # step cannot silence a live worker; these tell the gateway a busy worker from a wedged one. A step is
    # one turn of the worker's loop (its messages and one engine step), so a loop wedged anywhere shows.
    steps_completed: int = 0  # turns of the worker's loop ended since it started
    step_running_s: float = 0.0  # how long the turn under way has run (a wedged loop's grows without end)

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role
        assert self.steps_completed >= 0 and 0.0 <= self.step_running_s < float("inf"), "bad step progress"
        assert 0 <= self.kv_blocks_in_use <= self.kv_blocks_total, (self.kv_blocks_in_use, self.kv_blocks_total)
        assert self.lora_set_version >= 0 and len(self.lora_set_names) == len(self.lora_set_paths), "bad LoRA list"
        assert all(0 < len(n) <= MAX_LORA_NAME_CHARS for n in self.lora_set_names), "bad adapter name"


@wire_record("serve.heartbeat_ack")
@dataclass(slots=True)
class HeartbeatAck:
    """gateway -> worker, for every Heartbeat: the gateway is alive, and this is its id (new on every
    gateway start). A worker that hears no ack from a gateway for its timeout takes it for dead and
    aborts that gateway's requests; an ack with another id on the same link means it restarted."""

    gateway_id: str

    def __post_init__(self) -> None:
        assert 0 < len(self.gateway_id) <= 64, "gateway id of 1 to 64 characters"


@wire_record("serve.lora_adapters")
@dataclass(slots=True)
class LoRAAdapterSet:
    """gateway -> every worker: the cluster's LoRA adapters, the whole list (``/v1/load_lora_adapter``
    and ``/v1/unload_lora_adapter`` at any gateway change it). ``(version, gateway_id)`` stamps it: a
    worker applies a list only when its stamp is newer than the one it holds (loads what it lacks from
    each path, drops what is not listed) and reports the stamp and list in its heartbeats (with any
    load errors). A gateway stamps a change one above the newest version it has seen; two gateways
    changing at once pick the same version and the higher gateway id wins (the other one sees its
    change lost and makes it again on top)."""

    version: int
    names: list[str]
    paths: list[str]  # directories on the worker's filesystem, one per name
    gateway_id: str = ""  # the gateway that made this list ("": the workers' config, version 0)
    # Ed25519 by a gateway member key over the rest (hex; "" when insecure or version 0): workers carry
    # the list between gateways but cannot make one (gateway/workers/lora_list.py)
    signature: str = ""

    @property
    def stamp(self) -> tuple[int, str]:
        return (self.version, self.gateway_id)

    def as_dict(self) -> dict[str, str]:
        return dict(zip(self.names, self.paths))

    def __post_init__(self) -> None:
        assert self.version >= 0 and len(self.names) == len(self.paths), (self.version, len(self.names))
        assert all(0 < len(n) <= MAX_LORA_NAME_CHARS for n in self.names), "bad adapter name"


@wire_record("serve.goodbye")
@dataclass(slots=True)
class Goodbye:
    """worker -> gateway when it has drained and is about to exit."""

    worker_id: str


@wire_record("serve.prefill_job")
@dataclass(slots=True)
class PrefillJob:
    """decode -> prefill: compute KV for ``token_ids[skip_tokens:]`` and write it into ``dst_block_ids``.

    token_ids:  [ cached on D (skip) | to transfer .......................... ]
                0                    skip_tokens (multiple of block size)    len(token_ids)
    dst_block_ids[i] receives the block of tokens [skip + i*bs, skip + (i+1)*bs).
    """

    rid: str
    token_ids: list[int]  # prompt tokens whose KV D needs (the whole prompt, or all but the last)
    skip_tokens: int  # D already holds KV for these (its prefix cache); P need not send them
    dst_block_ids: list[int]
    generation: int  # transfer generation; a retry uses a new one, fencing off late writes
    kv_address: str  # D's KV receiver endpoint
    sample_first: bool  # sample the first token, stream it to the gateway, carry it in the Commit
    sampling: SamplingSpec
    deadline: float  # time.time()
    # D's KV receiver incarnation: a P whose sender is handshaken with another one (D restarted in place,
    # same kv_address) handshakes again before the job; one from an incarnation it outlived fails the job
    kv_incarnation: str = ""
    traceparent: str = ""  # W3C trace context of the decode worker's request span; "" = not traced
    gateway_id: str = ""  # the Generate's: the gateway the first token streams to

    def __post_init__(self) -> None:
        assert 0 <= self.skip_tokens < len(self.token_ids), (self.skip_tokens, len(self.token_ids))


@wire_record("serve.prefill_failed")
@dataclass(slots=True)
class PrefillFailed:
    """prefill -> decode: the job cannot be done (bad job, deadline, transfer failure)."""

    rid: str
    generation: int
    reason: str
    # Whose fault, as the prefill worker sees it: "prefill" (its own: an adapter it cannot load, its
    # limits), "decode" (a job it could not take, a KV receiver that did not answer or refused it), "none"
    # (the deadline, a drain). The decode worker passes it on to the gateway in its error event.
    culprit: str = "prefill"

    def __post_init__(self) -> None:
        assert self.culprit in CULPRITS[1:], f"unknown culprit {self.culprit[:20]!r}"
