"""KV transfer bandwidth per transport vs raw pyzmq PUSH/PULL, memcpy (torch ``copy_``) and two ceilings.

    python -m benchmarks.transfer.kv_transfer [--quick] [--compare-insecure]
    python -m benchmarks.transfer.kv_transfer --kv-cache-dtype int8 [--prompt-tokens 1024]  (kv_dtype.py)

Layout: the ``small`` model (8 layers, 2 KV heads, head dim 64, fp32, block size 16 -> 128 KiB a block).
Each transfer: reserve on the receiver, send + commit, time until the receiver's commit event. Best of a few
repeats. Last line::

    zmq_vs_raw=<zmq / raw PUSH-PULL bandwidth> shm_vs_memcpy=<shm / copy_ bandwidth> ttft_share_4096=<share>

``ttft_share_4096``: zmq transfer time of a 4096-token prompt's KV / (that + pdserve's prefill time of
the ``small`` model for that prompt), also reported for 512 tokens. The transfer is counted whole, as if
it did not overlap prefill (the real node overlaps it per chunk), so this is an upper bound.

The ceilings (benchmarks/transfer/ceilings.py): ``block_memcpy``, the same blocks copied between two
pools of the same layout (what shm could at best do), and ``raw_tuned``, the same bytes over pdserve's own
zmq sockets and piece size with no protocol (what zmq could at best do). After the line above::

    shm_vs_block_memcpy=<shm / block memcpy bandwidth> zmq_vs_raw_zmq_tuned=<zmq / raw tuned bandwidth>

``--compare-insecure`` adds the socket transports with CurveZMQ on (the product's default, the
``zmq+curve`` and ``shm+curve`` columns; the plain columns are ``transfer.insecure``) and a last line
``curve_zmq_vs_plain=<bandwidth ratio> curve_shm_vs_plain=<ratio>`` (docs/security.md), the tuned raw
baseline with CURVE too (``raw_tuned+curve``), and a last line
``shm_curve_vs_block_memcpy=<ratio> zmq_curve_vs_raw_zmq_tuned_curve=<ratio>``.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import zmq
from prometheus_client import CollectorRegistry

from benchmarks.transfer import ceilings as transfer_ceilings
from benchmarks.transfer import kv_dtype
from benchmarks.transfer.transfer_steps import handshake, one_transfer
from engine.kv.pool import KVLayout, KVPool
from kvtransfer.channel import InprocServer, ZmqClient, ZmqServer
from kvtransfer.metrics import TransferMetrics
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.shm_pool import create_shared
from protocol.curve import ClusterKey, PlaneSecurity

MIB = 1 << 20
WINDOW_BLOCKS = 256  # credit window: 32 MiB in flight


def small_layout(num_blocks: int) -> KVLayout:
    return KVLayout(num_layers=8, num_blocks=num_blocks, block_size=16, kv_heads=2, head_dim=64, dtype=torch.float32)


def time_transport(transport: str, sizes_mib: list[int], repeats: int, curve: bool = False) -> dict[int, float]:
    """Seconds per transfer (best of ``repeats``) for each size; ``curve``: both ends CURVE-encrypted,
    each with its own client key, as two worker processes are."""
    key = ClusterKey.from_secret(bytes(32)) if curve else None
    layout = small_layout(max(sizes_mib) * MIB // small_layout(1).bytes_per_block)
    shared = create_shared(layout.shape, layout.dtype) if transport == "shm" else None
    dst = KVPool(layout, tensor=shared.tensor if shared else None)
    ctx = zmq.Context()
    server = (
        InprocServer()
        if transport == "loopback"
        else ZmqServer(
            ctx, "127.0.0.1", max_msg_size=WINDOW_BLOCKS * layout.bytes_per_block + MIB, security=PlaneSecurity(key)
        )
    )
    rx = KVReceiver(
        dst,
        "small",
        server,
        lambda ids: None,
        TransferMetrics(CollectorRegistry()),
        credits=WINDOW_BLOCKS,
        shm_pool_name=shared.name if shared else None,
    )
    channel = (
        server.connect() if transport == "loopback" else ZmqClient(ctx, server.endpoint, security=PlaneSecurity(key))
    )
    tx = KVSender(KVPool(layout, tensor=torch.randn(layout.shape)), "small", channel)
    handshake(rx, tx, transport)
    results = {}
    try:
        for size in sizes_mib:
            n = size * MIB // layout.bytes_per_block
            results[size] = min(one_transfer(rx, tx, f"{size}-{i}", n) for i in range(repeats))
            assert torch.equal(dst.tensor[:, :, :n], tx.pool.tensor[:, :, :n])  # the bytes really moved
    finally:
        rx.close()
        channel.close()
        if isinstance(server, ZmqServer):
            server.close_security()
        ctx.destroy(linger=0)
        if shared:
            shared.unlink()
    return results


def time_raw_zmq(sizes_mib: list[int], repeats: int, frame_bytes: int) -> dict[int, float]:
    """The same bytes over plain PUSH/PULL in frames of the transport's piece size, no protocol."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    results = {}
    for size in sizes_mib:
        payload = torch.randn(size * MIB // 4).view(torch.uint8).numpy()
        frames = [memoryview(payload)[i : i + frame_bytes] for i in range(0, len(payload), frame_bytes)]
        best = float("inf")
        for _ in range(repeats):
            sink = torch.empty(size * MIB, dtype=torch.uint8)  # the receiver lands bytes in its pool too
            start = time.perf_counter()
            thread = threading.Thread(target=lambda: [push.send(f, copy=False) for f in frames])
            thread.start()
            offset = 0
            for _ in frames:
                got = pull.recv(copy=False).buffer
                sink[offset : offset + len(got)] = torch.frombuffer(got, dtype=torch.uint8)
                offset += len(got)
            best = min(best, time.perf_counter() - start)
            thread.join()
        results[size] = best
    ctx.destroy(linger=0)
    return results


def time_memcpy(sizes_mib: list[int], repeats: int) -> dict[int, float]:
    results = {}
    for size in sizes_mib:
        src, dst = torch.randn(size * MIB // 4), torch.empty(size * MIB // 4)
        dst.copy_(src)  # first touch of dst's pages is not a copy cost
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        results[size] = best
    return results


def time_prefill(prompt_lens: list[int]) -> dict[int, float]:
    """pdserve's own prefill time (time to the first token, best of two) of the ``small`` model."""
    from configs.model_source import default_model_dir
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    llm = LLM(str(default_model_dir()))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for n in prompt_lens:
        best = float("inf")
        for _ in range(2):  # fresh tokens each time: no prefix-cache hit
            prompt = torch.randint(5, 32000, (n,), generator=gen).tolist()
            start = time.perf_counter()
            llm.generate([prompt], params)
            best = min(best, time.perf_counter() - start)
        results[n] = best
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1..16 MiB, fewer repeats")
    parser.add_argument(
        "--compare-insecure",
        action="store_true",
        help="also time zmq and shm with CurveZMQ on (the default in the product)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8"),
        default="auto",
        help="int8: only one prompt's KV in float32 and int8 side by side (benchmarks/transfer/kv_dtype.py)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="the prompt of --kv-cache-dtype int8")
    args = parser.parse_args()
    if args.kv_cache_dtype == "int8":
        kv_dtype.compare(args.prompt_tokens, repeats=40)
        return
    sizes = [1, 4, 16] if args.quick else [1, 4, 16, 64, 256]
    repeats = 2 if args.quick else 3
    frame_bytes = WINDOW_BLOCKS * small_layout(1).bytes_per_block

    timings = {t: time_transport(t, sizes, repeats) for t in ("loopback", "shm", "zmq")}
    if args.compare_insecure:
        timings.update({f"{t}+curve": time_transport(t, sizes, repeats, curve=True) for t in ("shm", "zmq")})
    timings["raw_zmq"] = time_raw_zmq(sizes, repeats, frame_bytes)
    timings["memcpy"] = time_memcpy(sizes, repeats)
    framings = time_ceilings(timings, sizes, repeats, args.compare_insecure)
    print(f"{'MiB/request':>12} " + " ".join(f"{name:>10}" for name in timings) + "   (GiB/s)")
    for size in sizes:
        print(f"{size:>12} " + " ".join(f"{size / 1024 / timings[name][size]:>10.2f}" for name in timings))
    print("raw_tuned framing per size (the faster): " + ", ".join(f"{k}: {v}" for k, v in framings.items()))

    largest = sizes[-1]
    zmq_vs_raw = timings["raw_zmq"][largest] / timings["zmq"][largest]
    shm_vs_memcpy = timings["memcpy"][largest] / timings["shm"][largest]
    share = {}
    prefill = time_prefill([512, 4096])
    for tokens in (512, 4096):
        kv_mib = tokens // 16 * small_layout(1).bytes_per_block // MIB  # 512 -> 4 MiB, 4096 -> 32 MiB
        transfer = time_transport("zmq", [kv_mib], repeats)[kv_mib]
        share[tokens] = transfer / (transfer + prefill[tokens])
        print(
            f"{tokens}-token prompt: KV {kv_mib} MiB, zmq transfer {transfer * 1e3:.1f} ms, "
            f"pdserve prefill (TTFT) {prefill[tokens] * 1e3:.1f} ms, transfer share {share[tokens]:.3f}"
        )
    print(f"zmq_vs_raw={zmq_vs_raw:.3f} shm_vs_memcpy={shm_vs_memcpy:.3f} ttft_share_4096={share[4096]:.3f}")
    if args.compare_insecure:
        print(
            " ".join(
                f"curve_{t}_vs_plain={timings[t][largest] / timings[f'{t}+curve'][largest]:.3f}" for t in ("zmq", "shm")
            )
        )
    print(ceiling_ratios(timings, largest, ""))
    if args.compare_insecure:
        print(ceiling_ratios(timings, largest, "+curve"))


def time_ceilings(timings: dict, sizes_mib: list[int], repeats: int, curve_too: bool) -> dict[str, str]:
    """Adds ``block_memcpy`` and ``raw_tuned`` (and ``raw_tuned+curve``) to ``timings``; returns the framing
    that was faster per baseline and size."""
    bytes_per_block = small_layout(1).bytes_per_block
    blocks = {size: size * MIB // bytes_per_block for size in sizes_mib}
    layout = small_layout(max(blocks.values()))
    src, dst = torch.randn(layout.shape), torch.empty(layout.shape)
    copied = transfer_ceilings.time_block_memcpy(src, dst, list(blocks.values()), repeats)
    timings["block_memcpy"] = {size: copied[n] for size, n in blocks.items()}
    framings = {}
    for suffix in ("", "+curve") if curve_too else ("",):
        # The server's message cap as time_transport's; pieces of half the window, as KVSender cuts them.
        pair = transfer_ceilings.RawZmqPair(WINDOW_BLOCKS * bytes_per_block + MIB, curve=bool(suffix))
        raw = transfer_ceilings.time_raw_zmq_tuned(src, dst, list(blocks.values()), WINDOW_BLOCKS // 2, repeats, pair)
        timings[f"raw_tuned{suffix}"] = {size: raw[n][0] for size, n in blocks.items()}
        framings.update({f"raw_tuned{suffix} {size} MiB": raw[n][1] for size, n in blocks.items()})
    return framings


def ceiling_ratios(timings: dict, size: int, suffix: str) -> str:
    """pdserve's bandwidth over each ceiling's at ``size`` MiB: shm over block memcpy, zmq over raw tuned."""
    tag = suffix.replace("+", "_")
    shm = timings["block_memcpy"][size] / timings[f"shm{suffix}"][size]
    zmq_ = timings[f"raw_tuned{suffix}"][size] / timings[f"zmq{suffix}"][size]
    return f"shm{tag}_vs_block_memcpy={shm:.3f} zmq{tag}_vs_raw_zmq_tuned{tag}={zmq_:.3f}"


if __name__ == "__main__":
    main()
