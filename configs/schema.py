"""The typed pdserve configuration: one section per concern, every field documented.

Sources, later wins (configs/loader.py):   defaults < YAML < env PDSERVE_<SECTION>_<FIELD> < CLI overrides
A field's allowed values and bounds live in its metadata (``choices``, ``minimum``) and are checked once
after all layers are merged. Adding a field = one line here; adding a section = one class plus one
line in PdserveConfig. Stdlib only: torch-free processes (gateway, cluster) import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A bad config key or value; the message names the dotted key, the value and where it came from."""


# The exit status of a process that stops on a ConfigError (sysexits.h EX_CONFIG): starting it again
# as it is cannot help, so supervisors (cluster/local_cluster.py) do not restart it.
EX_CONFIG = 78


def _field(default, *, choices: tuple | None = None, minimum: float | None = None):
    return field(default=default, metadata={"choices": choices, "minimum": minimum})


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("", "int8")  # "": the checkpoint's own weights (a GGUF file keeps its blocks either way)
QUANT_ACTIVATIONS = ("int8", "int16")  # kernels/cpu/quant.py's ACTIVATIONS
TRANSPORTS = ("auto", "loopback", "shm", "cuda_ipc", "zmq")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(slots=True)
class ModelConfig:
    path: str = ""  # Hugging Face directory or hub id; "" = the small model embedded for tests and demos
    dtype: str = _field("auto", choices=DTYPES)  # weights and KV dtype; auto: bfloat16 on GPU, float32 on CPU
    # vLLM's --load-format: auto = the checkpoint's safetensors; dummy = random weights made on the device
    # in the target dtype from config.json alone (speed at a model's shape without its checkpoint)
    load_format: str = _field("auto", choices=LOAD_FORMATS)
    max_model_len: int | None = _field(None, minimum=1)  # context limit in tokens; None: the model's own
    # vLLM's --quantization: "int8" = per-channel weight-only int8 made at load (CPU, float32 checkpoints;
    # engine/quant/int8.py)
    quantization: str = _field("", choices=QUANTIZATIONS)
    # How the quantized CPU kernels round activations (GGUF blocks, int8): int8 = to int8 blocks of 16, as
    # llama.cpp does in blocks of 32 (fastest); int16 = and what that left as a second int8 term: x to
    # 1/64516 of each block's max, the output of the weights alone, at up to twice the integer work at
    # many rows (docs/engine.md)
    quant_activations: str = _field("int8", choices=QUANT_ACTIVATIONS)
    cache_dir: str = ""  # where the embedded default model is made on first use; "" = ~/.cache/pdserve
    served_model_name: str = (
        ""  # the name clients put in "model"; "" = path as given (the default model: "pdserve-small")
    )
    # The chat template (vLLM's --chat-template): a Jinja file's path, or the template itself; "" = the
    # model's own (chat_template.jinja or tokenizer_config.json)
    chat_template: str = ""

    def name_for_clients(self) -> str:
        """What /v1/models lists and the metrics' model_name label says, in every process alike."""
        return self.served_model_name or self.path or "pdserve-small"


@dataclass(slots=True)
class EngineConfig:
    block_size: int = _field(16, minimum=1)  # tokens per KV block; P and D must agree (handshake checks)
    kv_cache_memory_mb: int = _field(1024, minimum=1)  # memory budget of the node's KV pool
    num_kv_blocks: int | None = _field(None, minimum=1)  # exact pool size in blocks; overrides the budget
    # What the KV pool stores (vLLM's --kv-cache-dtype): auto = the model's dtype; int8 = int8 with a
    # float16 scale per 16 values of a token's head (CPU and GPU); fp8 = e4m3, scale 1.0, saturated at
    # +-448 (GPUs of compute capability 8.9 or newer). P and D must agree.
    kv_cache_dtype: str = _field("auto", choices=("auto", "int8", "fp8"))
    max_num_seqs: int = _field(64, minimum=1)  # sequences in one decode batch at most
    max_num_batched_tokens: int = _field(2048, minimum=1)  # tokens computed in one step (prefill + decode)
    prefill_chunk_size: int = _field(512, minimum=1)  # prompt tokens one request may compute per step
    enable_prefix_caching: bool = True  # reuse full blocks whose token hash chain matches
    seed: int | None = None  # seeds the sampler unseeded requests share; None: a fresh seed per process
    num_threads: int | None = _field(None, minimum=1)  # torch CPU threads; None: torch's default
    # CPU decode attention: "c" = the C kernel (kernels/cpu/decode.c), built at first use with the
    # machine's compiler, torch where it cannot be built or has no copy for the model; "torch" = torch only
    cpu_decode_attention: str = _field("c", choices=("c", "torch"))
    # CPU prefill attention (prompt chunks): "c" = the C kernel (kernels/cpu/prefill.c), built like the
    # decode one, torch's SDPA where it cannot be built or has no copy for the model; "torch" = SDPA only
    cpu_prefill_attention: str = _field("c", choices=("c", "torch"))
    # CPU linears at few rows (decode steps): "c" = the C kernel (kernels/cpu/linear.c) at the row counts
    # where it times faster than torch's forms at load (which may keep a weight both dense and packed);
    # "torch" = torch's forms only
    cpu_decode_linear: str = _field("c", choices=("c", "torch"))
    # CPU layer steps: "c" = RMSNorm with its residual add, RoPE with the K/V store and SwiGLU's product
    # in C (kernels/cpu/layer_ops.c; float32 weights); "torch" = torch only
    cpu_layer_ops: str = _field("c", choices=("c", "torch"))
    # Structured outputs (engine/sampling/grammar_compiles.py): a request whose grammar has not compiled this long
    # after it arrived is refused (xgrammar cannot stop the compile; it ends on its thread, unread).
    grammar_compile_timeout_s: float = _field(30.0, minimum=0.001)
    grammar_compile_threads: int = _field(2, minimum=1)  # grammars compiling at once on a worker
    grammar_cache_mb: int = _field(
        512, minimum=0
    )  # compiled grammars kept, by xgrammar's measure of each; least recently used out (vLLM's 512)
    # Speculative decoding on the decode worker, vLLM's --speculative-config JSON (engine/spec/config.py):
    # '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'. Empty: off.
    speculative_config: str = ""


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"  # interface to bind; never all interfaces unless asked for
    port: int = _field(8000, minimum=0)  # HTTP port (0: any free port)
    api_keys: list[str] = field(default_factory=list)  # accepted bearer keys; empty: no auth
    # Bearer keys that may load/unload LoRA adapters at run time; empty: those routes are off (403)
    admin_api_keys: list[str] = field(default_factory=list)
    # Salt every request's prefix-cache hashes with its API key: keys share no prefix KV (nor cache timing)
    cache_salt_per_api_key: bool = False
    # Origins whose browser pages may call the API (CORS, as vLLM's --allowed-origins); ["*"]: any.
    # Empty: no CORS headers (a page from another origin cannot read an answer).
    allowed_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = _field(1 << 20, minimum=1)  # larger request bodies get 413
    request_timeout_s: float = _field(600.0, minimum=0.0)  # end-to-end deadline of one request
    worker_heartbeat_s: float = _field(5.0, minimum=0.0)  # workers re-register this often
    worker_timeout_s: float = _field(15.0, minimum=0.0)  # a worker silent this long is dropped
    # A worker whose one step (a turn of its loop) has run this long is stuck: out of rotation, its requests
    # failed or retried, back once a step ends. Heartbeats come from their own thread, so a long step alone
    # never silences a worker. 300: SGLang's --watchdog-timeout and vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS;
    # 15x the slowest full step seen (2048 prompt tokens in 20 s on 2 loaded cores). 0: never.
    worker_step_timeout_s: float = _field(300.0, minimum=0.0)
    worker_port: int = _field(8001, minimum=0)  # ZeroMQ ROUTER port workers connect their DEALERs to
    max_queued_requests: int = _field(64, minimum=0)  # per pool: requests waiting for KV room; beyond: 503
    queue_timeout_s: float = _field(5.0, minimum=0.0)  # a queued request gives up (503) after this
    # Uncached suffixes up to this prefill on D itself while every P has more than this waiting.
    local_prefill_max_tokens: int = _field(256, minimum=0)
    routing_policy: str = _field("prefix", choices=("prefix", "least_loaded", "round_robin"))  # picks D
    # Chat output readers, as vLLM's --reasoning-parser and --tool-call-parser: <think> reasoning into the
    # message's reasoning field (gateway/text/reasoning/); the model's own tool calls for tool_choice "auto"
    # (gateway/text/tool_parsers/). "none": off (reasoning stays in content; "auto" is a 400).
    reasoning_parser: str = _field("none", choices=("none", "deepseek_r1", "qwen3"))
    tool_call_parser: str = _field(
        "none",
        choices=("none", "hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "granite"),
    )
    # Memory for the Responses API's stored answers (previous_response_id, GET /v1/responses/{id}); the
    # least recently used go first. Per gateway process. 0: nothing is stored (store: false is echoed).
    responses_store_mb: int = _field(64, minimum=0)
    # prompt_logprobs (k <= 20, vLLM's max_logprobs) hold (k + 1) entries per prompt token per choice in
    # gateway memory (~0.5 KB each once formatted): a request needing more is a 400 naming this limit.
    # 262144: e.g. a 12k-token prompt at k = 20, or a 130k-token one at k = 1.
    max_prompt_logprobs_entries: int = _field(262144, minimum=0)
    # HTTP time limits (gateway/http/limits.py): a request's line and headers must arrive this long after
    # the connection opens (or the previous response ends), its body this long after the headers; a
    # client that accepts no response bytes this long (its socket full) is dropped and its requests aborted.
    http_header_timeout_s: float = _field(10.0, minimum=0.001)
    http_body_timeout_s: float = _field(30.0, minimum=0.001)
    http_write_timeout_s: float = _field(30.0, minimum=0.001)
    # Open HTTP connections at most: a request on one opened past it gets 503 (OpenAI error JSON,
    # Retry-After) and its connection is closed. 0: no limit.
    max_connections: int = _field(1024, minimum=0)
    # A stream that has sent nothing this long (queued, prefilling) sends an SSE comment ": keep-alive",
    # so proxies keep it open and a client gone is noticed; a stream starts at the latest after this long
    # (a refusal after that comes in-band). 0: never.
    sse_keepalive_s: float = _field(15.0, minimum=0.0)
    # A Redis every gateway replica shares the Responses API's store in (redis://host:port/db), so that
    # any replica reads back and goes on from any response; "": this process's memory (one gateway).
    responses_store_url: str = ""


@dataclass(slots=True)
class PrefillConfig:
    host: str = "127.0.0.1"  # interface the prefill worker binds
    port: int = _field(8100, minimum=0)  # its control port (0: any free port)
    gateway_address: str = "tcp://127.0.0.1:8001"  # the gateway's worker ROUTER (gateway.worker_port)
    http_port: int = _field(8101, minimum=0)  # /metrics, /health, /ready (0: any free port)
    worker_id: str = ""  # its identity at the gateway; "" = prefill-<hostname>-<pid>
    drain_timeout_s: float = _field(30.0, minimum=0.0)  # on SIGTERM: in-flight jobs get this long


@dataclass(slots=True)
class DecodeConfig:
    host: str = "127.0.0.1"  # interface the decode worker binds
    port: int = _field(8200, minimum=0)  # its control port (0: any free port)
    gateway_address: str = "tcp://127.0.0.1:8001"  # the gateway's worker ROUTER (gateway.worker_port)
    kv_port: int = _field(8201, minimum=0)  # KV receiver (kvtransfer ROUTER) prefill workers write to (0: any)
    http_port: int = _field(8202, minimum=0)  # /metrics, /health, /ready (0: any free port)
    worker_id: str = ""  # its identity at the gateway; "" = decode-<hostname>-<pid>
    drain_timeout_s: float = _field(30.0, minimum=0.0)  # on SIGTERM: in-flight requests get this long
    # CPU threads a step adds while none of its prompts is out at a prefill worker; pdserve serve sets it to the
    # prefill worker's threads when one prefill worker shares the host with this one (decode_node/step_threads.py)
    idle_prefill_threads: int = _field(0, minimum=0)


@dataclass(slots=True)
class TransferConfig:
    transport: str = _field("auto", choices=TRANSPORTS)  # auto: best the peer pair supports
    lease_seconds: float = _field(30.0, minimum=0.0)  # a reservation not renewed this long is freed
    max_frame_bytes: int = _field(64 << 20, minimum=1)  # larger wire frames are rejected
    # The cluster secret (`pdserve keygen > FILE`; a Kubernetes Secret or compose secret mounted as a
    # file): CurveZMQ encryption and authentication of every worker-plane socket. Required by every role
    # unless `insecure` (`pdserve serve` makes one for its local cluster). docs/security.md.
    cluster_key_file: str = ""
    insecure: bool = False  # plain TCP between gateway and workers: only on a network nobody else reaches


@dataclass(slots=True)
class ClusterConfig:
    num_prefill: int = _field(1, minimum=0)  # prefill workers `pdserve cluster` starts (0: decode prefills)
    num_decode: int = _field(1, minimum=1)  # decode workers `pdserve cluster` starts
    # gateways `pdserve serve` starts on gateway.port, +1, ... (their worker ports likewise), in front of
    # the same pools; with more than one they share a Responses store in Redis (gateway.responses_store_url,
    # or a redis-server started for them)
    num_gateways: int = _field(1, minimum=1)
    # GPUs (CUDA_VISIBLE_DEVICES entries) the workers take turns over, prefill then decode; each worker's
    # own GPU is its cuda:0 (cluster/gpu_placement.py). Empty: every worker sees what `pdserve serve` sees.
    devices: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ObservabilityConfig:
    log_level: str = _field("info", choices=("debug", "info", "warning", "error", "critical"))
    log_format: str = _field("text", choices=("text", "json"))  # json: one object per line (worker/logs.py)
    # OTLP endpoint of a trace collector: http://127.0.0.1:4318/v1/traces (HTTP/protobuf), or
    # http://127.0.0.1:4317 with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc; "" = no tracing (no span is
    # made). OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is read when this is unset (docs/observability.md).
    otlp_traces_endpoint: str = ""


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving, as vLLM's --enable-lora flags (engine/lora/manager.py). Adapters are PEFT
    directories each worker reads from its own filesystem (the same path on every host)."""

    enable_lora: bool = False  # serve LoRA adapters; requests name one as their "model"
    lora_modules: list[str] = field(default_factory=list)  # NAME=PATH of each adapter served from the start
    max_loras: int = _field(1, minimum=1)  # adapters in a worker's device slots at once (more run, paged in LRU)
    max_lora_rank: int = _field(16, minimum=1)  # adapters of a higher rank are refused
    max_cpu_loras: int | None = _field(None, minimum=1)  # adapters kept in host memory; None: max_loras

    def modules(self) -> dict[str, str]:
        """``lora_modules`` as name -> path; raises ConfigError for an entry that is not NAME=PATH."""
        parsed: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"lora.lora_modules: {entry!r} is not NAME=PATH")
            parsed[name.strip()] = path.strip()
        if parsed and not self.enable_lora:
            raise ConfigError("lora.lora_modules names adapters but lora.enable_lora is false (--enable-lora)")
        return parsed


@dataclass(slots=True)
class PdserveConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
