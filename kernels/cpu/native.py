"""The CPU kernels in C, built on first use and called through ctypes: decode attention over the paged
KV (decode.c), prefill attention of prompt chunks over it (prefill.c), ``x @ w^T`` for the
few rows of a decode step (linear.c), and a layer's RMSNorm with its residual add, its rotary
embedding with the K/V store and its SwiGLU product (layer_ops.c).

``load()`` compiles them into one library with the machine's C compiler (``$CC``, else ``cc``) through
kernels/cpu/build.py (for this very CPU, cached on disk). Where no compiler works, it logs why once and
returns None, and the engine keeps the torch path.

Where no OpenMP build works it builds without (``NativeLibrary.threaded`` is then False), and the
engine uses that one-thread build up to ``SERIAL_MAX_THREADS``. ctypes releases the GIL around the call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kernels.cpu import paged_call
from kernels.cpu.build import SERIAL, THREADED, Sources, Variant, build_library, library_path

log = logging.getLogger(__name__)

SOURCES = Sources(
    name="cpu_native",
    sources=tuple(
        Path(__file__).with_name(name)
        for name in (
            "decode.c",
            "decode_int8.c",
            "kv_int8_ops.c",
            "prefill.c",
            "prefill_tile.c",
            "linear.c",
            "layer_ops.c",
            "decode_step.c",
            "decode_step_team.c",
        )
    ),
    headers=tuple(
        Path(__file__).with_name(name)
        for name in ("vector.h", "decode_loop.h", "decode_step.h", "int8_rows.h", "rope.h", "prefill.h")
    ),
)
_SIZE = ctypes.c_int64
_PTR = ctypes.c_void_p
# A build without OpenMP runs on the calling thread alone. On the 2-core Xeon, its one thread took half
# the time of the torch path on two (batch 16: 0.29 against 0.60 ms per layer; batch 64: 1.41 against
# 2.67; context 64-600). With twice the threads torch would about catch up (estimated: this machine
# has two cores), so past this many the engine keeps torch.
SERIAL_MAX_THREADS = 4


class Projection(ctypes.Structure):
    """One projection's weight for ``pdserve_decode_step_f32``: the C linear's packed float32 copy
    (``NativeLibrary.pack_linear``) with ``type`` -1, or quantized rows (kernels/cpu/quant.c's type id);
    with ``split`` > 0, the first ``split`` output rows only, the rest at ``w2`` in ``type2``
    (kernels/cpu/decode_step.h)."""

    _fields_ = [
        ("w", _PTR),
        ("type", _SIZE),
        ("row_bytes", _SIZE),
        ("split", _SIZE),
        ("w2", _PTR),
        ("type2", _SIZE),
        ("row_bytes2", _SIZE),
    ]


class DecodeLayer(ctypes.Structure):
    """One layer's weights for ``pdserve_decode_step_f32`` (kernels/cpu/decode_step.c): the norms' weights,
    the qkv bias (may be None) and the four projections."""

    _fields_ = [
        *((name, _PTR) for name in ("input_norm", "post_norm", "qkv_bias")),
        *((name, Projection) for name in ("qkv", "o", "gate_up", "down")),
    ]


class DecodeShape(ctypes.Structure):
    """The model's shape for ``pdserve_decode_step_f32``; ``cache_floats``: one layer's K cache, in
    elements of the pool (bytes for an int8 pool, ``kv_int8`` 1); ``quant_linear``: the quantized
    kernel's address (``QuantLibrary.linear_address``), else None."""

    _fields_ = [
        *((name, _SIZE) for name in ("hidden", "num_heads", "kv_heads", "head_dim", "inter", "block_size")),
        ("cache_floats", _SIZE),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("quant_linear", _PTR),  # kernels/cpu/quant.c's pdserve_quant_linear, where a projection is quantized
        ("kv_int8", _SIZE),
        # kernels/cpu/quant.c's pdserve_quant_linear_team, or None: a step of up to TEAM_ROWS rows whose
        # projections are all quantized then runs one parallel region per layer (decode_step_team.c)
        ("quant_team", _PTR),
        ("quant_scratch_stride", _SIZE),  # bytes of quant_scratch each thread has there
    ]


class NativeLibrary:
    """The loaded kernels: ``supports(group, head_dim)``, ``paged_decode(...)`` and ``paged_prefill(...)``
    for attention, ``supports_linear(in, out)``, ``pack_linear(weight)`` and ``linear(x, packed)``;
    ``threaded``: whether they run on OpenMP threads."""

    def __init__(self, path: Path):
        self.name = path.name  # carries the hash of the source, flags and compiler it was built from
        self._lib = ctypes.CDLL(str(path))
        self.threaded = bool(self._lib.pdserve_native_threaded())  # False: it runs on the caller's thread
        self._supported = self._lib.pdserve_decode_supported
        self._supported.argtypes = [_SIZE, _SIZE]
        self._supported.restype = ctypes.c_int
        self._decode = paged_call.bind(self._lib.pdserve_paged_decode_f32, paged_call.DECODE_ARGTYPES)
        self._prefill = paged_call.bind(self._lib.pdserve_paged_prefill_f32, paged_call.PREFILL_ARGTYPES)
        self._lib.pdserve_prefill_scratch_bytes.restype = _SIZE
        self._prefill_scratch_bytes = int(self._lib.pdserve_prefill_scratch_bytes())
        self._linear_supported = self._lib.pdserve_linear_supported
        self._linear_supported.argtypes = [_SIZE, _SIZE]
        self._linear_supported.restype = ctypes.c_int
        self._linear = self._lib.pdserve_linear_f32
        self._linear.argtypes = [_PTR, _SIZE, _SIZE, _PTR, _SIZE, _PTR, _PTR, ctypes.c_int]
        self._linear.restype = None
        self._pack_linear = self._lib.pdserve_linear_pack_f32
        self._pack_linear.argtypes = [_PTR, _SIZE, _SIZE, _PTR, ctypes.c_int]
        self._pack_linear.restype = None
        self._lib.pdserve_linear_block.restype = _SIZE
        self.linear_block = int(self._lib.pdserve_linear_block())  # NR: outputs side by side in a packed weight
        self._rms_norm = self._lib.pdserve_rms_norm_f32
        self._rms_norm.argtypes = [_PTR, _SIZE, _PTR, _PTR, _PTR, _SIZE, _SIZE, ctypes.c_float, ctypes.c_int]
        self._rms_norm.restype = None
        self._rope_store = self._lib.pdserve_rope_store_f32
        self._rope_store.argtypes = [
            _PTR,
            _SIZE,
            _SIZE,
            _SIZE,
            _SIZE,
            _SIZE,
            _PTR,
            _PTR,
            _PTR,
            _PTR,
            _PTR,
            ctypes.c_int,
        ]
        self._rope_store.restype = None
        self._silu_mul = self._lib.pdserve_silu_mul_f32
        self._silu_mul.argtypes = [_PTR, _SIZE, _PTR, _SIZE, _SIZE, ctypes.c_int]
        self._silu_mul.restype = None
        self._decode_step_work = self._lib.pdserve_decode_step_work
        self._decode_step_work.argtypes = [ctypes.POINTER(DecodeShape), _SIZE, _SIZE, _SIZE]
        self._decode_step_work.restype = _SIZE
        self._team_takes = self._lib.pdserve_decode_team_takes
        self._team_takes.argtypes = [ctypes.POINTER(DecodeLayer), _SIZE, ctypes.POINTER(DecodeShape), _SIZE]
        self._team_takes.restype = ctypes.c_int
        self._decode_step = self._lib.pdserve_decode_step_f32
        self._decode_step.argtypes = [
            ctypes.POINTER(DecodeLayer),
            _SIZE,
            ctypes.POINTER(DecodeShape),
            *(_PTR, _SIZE, _PTR, _PTR, _PTR, _PTR, _PTR, _SIZE, _PTR, _SIZE, _PTR, _PTR, ctypes.c_int),
        ]
        self._decode_step.restype = None

    def supports(self, group: int, head_dim: int) -> bool:
        return bool(self._supported(group, head_dim))

    def symbol(self, name: str):
        """A C function of the library, for bindings kept in their own files (kv_int8.py)."""
        return getattr(self._lib, name)

    def paged_decode(
        self,
        q: torch.Tensor,  # [batch, num_heads, head_dim] float32; rows may be strided, heads packed
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float32, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, max_blocks] int64, contiguous
        context_lens: torch.Tensor,  # [batch] int64, each >= 1
        max_context: int,  # >= every context length
        scale: float,
    ) -> torch.Tensor:  # [batch, num_heads, head_dim]
        paged_call.check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, torch.float32)
        return paged_call.paged_decode(
            self._decode, q, k_cache, v_cache, block_tables, context_lens, max_context, scale
        )

    def paged_prefill(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32; rows may be strided, heads packed
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] float32, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [batch, max_blocks] int64, contiguous, every id in the pool
        context_lens: torch.Tensor,  # [batch] int64
        query_start_loc: torch.Tensor,  # [batch + 1] int64; every chunk >= 1 query, <= its context
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of each request's chunk over its paged context (kernels/cpu/prefill.c)."""
        paged_call.check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, torch.float32)
        work = self.prefill_scratch(torch.get_num_threads())  # per-thread tiles
        return paged_call.paged_prefill(
            self._prefill, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, work
        )

    def prefill_scratch(self, threads: int) -> torch.Tensor:
        """The prefill kernels' work area (prefill.c's Scratch) for ``threads`` threads, 64-byte aligned."""
        return torch.empty(threads * self._prefill_scratch_bytes, dtype=torch.uint8)

    def supports_linear(self, in_features: int, out_features: int) -> bool:
        return bool(self._linear_supported(in_features, out_features))

    def takes_weight(self, weight: torch.Tensor) -> bool:
        """Whether ``pack_linear`` takes this ``[out, in]`` weight (float32, a shape it has tiles for)."""
        return weight.dtype == torch.float32 and self.supports_linear(weight.shape[1], weight.shape[0])

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """The copy of ``weight`` ([out, in] float32, a shape ``takes_weight``) that ``linear`` reads:
        ``[out / NR, in, NR]``, each block of NR outputs side by side for every input (kernels/cpu/linear.c)."""
        assert self.takes_weight(weight)
        weight = weight.contiguous()
        out_features, in_features = weight.shape
        packed = torch.empty((out_features // self.linear_block, in_features, self.linear_block), dtype=torch.float32)
        self._pack_linear(weight.data_ptr(), out_features, in_features, packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for x [rows, in] float32 and ``packed = pack_linear(weight)``.
        Returns [rows, out]."""
        blocks, in_features, block = packed.shape
        assert x.dtype == packed.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == in_features
        assert block == self.linear_block and packed.is_contiguous()
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        x = x.contiguous()
        out = torch.empty((x.shape[0], blocks * block), dtype=torch.float32)
        self._linear(
            x.data_ptr(),
            x.shape[0],
            in_features,
            packed.data_ptr(),
            blocks * block,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of the rows of x ([rows, dim] float32, rows may be strided) by ``weight`` ([dim]). With
        ``residual`` ([rows, dim], contiguous): ``residual += x`` first, in place, and the sum is what is
        normalised. Returns a new [rows, dim]."""
        rows, dim = x.shape
        assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1 and weight.shape == (dim,)
        assert weight.is_contiguous()
        assert residual is None or (
            residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape
        )
        out = torch.empty((rows, dim), dtype=torch.float32)
        self._rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Rotates the query and key heads of each ``qkv`` row ([tokens, >= (heads + 2 kv_heads) * head_dim]
        float32, rows may be strided) in place with its ``cos``/``sin`` ([tokens, head_dim / 2] each,
        contiguous; broadcast dims of size 1 allowed), then stores its K and V at cache slot
        ``slots[t]`` (int64, every one below the caches' slots: the caller checks, the C code does not)."""
        tokens = qkv.shape[0]
        head_dim = k_cache.shape[-1]
        assert qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (num_heads + 2 * kv_heads) * head_dim
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == tokens * (head_dim // 2)
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (tokens,)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        assert k_cache.shape[-2] == kv_heads and head_dim % 2 == 0
        self._rope_store(
            qkv.data_ptr(),
            qkv.stride(0),
            tokens,
            num_heads,
            kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of each row ``[gate | up]`` of ``gate_up`` ([rows, 2 * inter] float32, rows
        may be strided). Returns a new contiguous [rows, inter]."""
        rows, width = gate_up.shape
        assert gate_up.dtype == torch.float32 and gate_up.stride(1) == 1 and width % 2 == 0
        out = torch.empty((rows, width // 2), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def team_takes(self, layers, shape: DecodeShape, rows: int) -> bool:
        """Whether ``decode_step`` runs a step of ``rows`` rows one parallel region per layer
        (kernels/cpu/decode_step_team.c: every projection quantized, ``shape.quant_team`` set, few rows)."""
        return bool(self._team_takes(layers, len(layers), ctypes.byref(shape), rows))

    def decode_step(
        self,
        layers,  # ctypes array of DecodeLayer, one per layer
        shape: DecodeShape,
        x: torch.Tensor,  # [rows, hidden] float32 contiguous: the embeddings; the model's output after
        pool: torch.Tensor,  # the KV pool [layers, 2, blocks, block_size, kv_heads, head_dim], contiguous
        cos: torch.Tensor,  # [rows, head_dim / 2] each, contiguous (broadcast dims of size 1 allowed)
        sin: torch.Tensor,
        slots: torch.Tensor,  # [rows] int64, each inside the pool (checked by the caller)
        block_tables: torch.Tensor,  # [rows, max_blocks] int64 contiguous, ids inside the pool (checked)
        context_lens: torch.Tensor,  # [rows] int64, each >= 1
        max_context: int,  # >= every context length, <= max_blocks * block_size
        # uint8, QuantLibrary.scratch_bytes(rows, widest input); with shape.quant_team, that many bytes
        # (shape.quant_scratch_stride) for each of torch.get_num_threads() threads
        quant_scratch: torch.Tensor | None = None,
    ) -> None:
        """Every decoder layer of a decode step (one new token per row), in place in ``x``
        (kernels/cpu/decode_step.c): the same kernels, in the same order, as the layers' forward."""
        rows = x.shape[0]
        assert x.dtype == cos.dtype == torch.float32 and x.is_contiguous() and pool.is_contiguous()
        assert pool.dtype == (torch.int8 if shape.kv_int8 else torch.float32)
        assert x.shape[1] == shape.hidden and len(layers) * 2 * shape.cache_floats == pool.numel()
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == rows * shape.head_dim // 2
        assert slots.dtype == block_tables.dtype == context_lens.dtype == torch.int64 and slots.shape == (rows,)
        assert block_tables.is_contiguous() and context_lens.is_contiguous() and block_tables.shape[0] == rows
        assert block_tables.shape[1] * shape.block_size >= max_context
        assert (quant_scratch is None) == (shape.quant_linear is None)
        assert quant_scratch is None or (quant_scratch.dtype == torch.uint8 and quant_scratch.is_contiguous())
        assert not shape.quant_team or quant_scratch.numel() >= torch.get_num_threads() * shape.quant_scratch_stride
        ctx_pad = -(-max_context // 16) * 16
        threads = torch.get_num_threads()
        work = torch.empty(self._decode_step_work(ctypes.byref(shape), rows, ctx_pad, threads), dtype=torch.float32)
        self._decode_step(
            layers,
            len(layers),
            ctypes.byref(shape),
            x.data_ptr(),
            rows,
            pool.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            ctx_pad,
            work.data_ptr(),
            None if quant_scratch is None else quant_scratch.data_ptr(),
            torch.get_num_threads(),
        )


def build(compiler: str, variant: Variant = THREADED) -> Path:
    """These kernels' library, compiled (or found already compiled) by ``compiler``; raises on a failed build."""
    return build_library(SOURCES, compiler, variant)


@functools.cache
def load() -> NativeLibrary | None:
    """The kernels, built if need be; None (logged once) where they cannot be built or loaded here.

    The OpenMP build first; where that fails (clang without libomp, Apple's clang, which has no
    -fopenmp) the build without it. A variant already in the cache is taken before any build is
    tried, so a failing OpenMP build costs its second or so once, not at every start."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning(
            "no C compiler (CC=%s): CPU decode attention, linears and layer ops stay on the torch path",
            os.environ.get("CC", "cc"),
        )
        return None
    variants = sorted((THREADED, SERIAL), key=lambda v: not library_path(SOURCES, compiler, v).exists())  # cached first
    failures = []
    for variant in variants:
        try:
            library = NativeLibrary(build(compiler, variant))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            failures.append(str(e))
            continue
        if failures:
            log.warning("C kernels built without OpenMP, so they run on one thread: %s", failures[0])
        return library
    log.warning(
        "C kernels unavailable, CPU decode attention, linears and layer ops stay on the torch path: %s", failures[-1]
    )
    return None
