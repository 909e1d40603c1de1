"""The ctypes binding the quantized (kernels/cpu/quant.py) and 16-bit (kernels/cpu/half.py) weight
libraries share: one C interface over rows of weight bytes, its symbols named by the library's prefix
(``pdserve_quant_*``, ``pdserve_half_*``), so ``QuantLinear`` (engine/quant/linear.py) and the fused
decode step (kernels/cpu/decode_step.c) take either.

  linear_into(tag, x, m, in, rows, out, row_bytes, bias, y, ldy, scratch, threads)   y = x @ W^T (+ bias)
  linear_team_into(...)        the same, called by every thread of a caller's OpenMP region (C callers)
  dequantize(tag, rows, start, count, in, row_bytes, out, threads)   rows as float32
  scratch_bytes(m, in)         work space one linear_into takes for m rows of activations as it rounds them
                               (m rows of x times act_terms in the quantized library)
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kernels.cpu.build import Sources, Variant, build_library

log = logging.getLogger(__name__)

_SIZE, _PTR = ctypes.c_int64, ctypes.c_void_p


class RowKernelLibrary:
    """``linear(type, x, rows)`` and ``dequantize(type, rows, start, count)`` over weight rows of the formats
    in ``type_ids`` (name -> the C library's tag)."""

    act_terms = 1  # the int8 terms a row of x is rounded to (quant.c; engine/quant/kernel_inputs.py)

    def __init__(self, path: Path, prefix: str, type_ids: dict[str, int]):
        self.name = path.name
        self._lib = ctypes.CDLL(str(path))
        self._prefix, self._type_ids = prefix, type_ids
        self._scratch_bytes = self.symbol("scratch_bytes")
        self._scratch_bytes.argtypes = [_SIZE, _SIZE]
        self._scratch_bytes.restype = _SIZE
        # y's rows ldy floats apart: a column range of a wider output (engine/quant/parts.py)
        self._linear = self.symbol("linear_into")
        self._linear.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _PTR, _SIZE, _SIZE, _PTR, _PTR]
        self._linear.argtypes += [_SIZE, _PTR, ctypes.c_int]  # ldy, scratch, threads
        self._linear.restype = None
        self._team = self.symbol("linear_team_into")  # for C callers only: its address
        self._dequantize = self.symbol("dequantize")
        self._dequantize.argtypes = [ctypes.c_int, _PTR, _SIZE, _SIZE, _SIZE, _SIZE, _PTR, ctypes.c_int]
        self._dequantize.restype = None

    def symbol(self, name: str):
        """The library's ``pdserve_<prefix>_<name>``."""
        return getattr(self._lib, f"pdserve_{self._prefix}_{name}")

    def tag(self, type_name: str) -> int:
        """The C library's tag for ``type_name`` as this library object runs it."""
        return self._type_ids[type_name]

    def check_rows(self, rows: torch.Tensor, in_features: int) -> None:
        """What a format family asks of ``rows`` for ``in_features`` inputs, beyond being uint8 rows."""

    def linear(
        self,
        type_name: str | int,
        x: torch.Tensor,
        rows: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [m, in] float32 @ W^T (+ bias)`` for W held as ``rows`` ([out, row_bytes] uint8), into ``out``
        ([m, out], its rows may be apart: a column range of a wider tensor) or a new tensor. Returns it.
        ``type_name``: a key of the library's formats, or a tag of its own (a measured variant)."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == in_features
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        self.check_rows(rows, in_features)
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == rows.shape[:1])
        x = x.contiguous()
        m, out_features = x.shape[0], rows.shape[0]
        y = torch.empty((m, out_features), dtype=torch.float32) if out is None else out
        assert y.dtype == torch.float32 and y.shape == (m, out_features) and (m < 2 or y.stride(1) == 1), y.stride()
        scratch = torch.empty(self.scratch_bytes(m, in_features), dtype=torch.uint8)
        tag = type_name if isinstance(type_name, int) else self.tag(type_name)
        ldy = y.stride(0) if m > 1 else out_features
        self._linear(
            tag, x.data_ptr(), m, in_features, rows.data_ptr(), out_features, rows.shape[1],
            None if bias is None else bias.data_ptr(), y.data_ptr(), ldy, scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    @property
    def linear_address(self) -> int:
        """The address of ``linear_into``, for C callers (kernels/cpu/decode_step.c's fused step)."""
        return ctypes.cast(self._linear, ctypes.c_void_p).value

    @property
    def team_address(self) -> int:
        """The address of ``linear_team_into``: ``linear`` for every thread of a caller's OpenMP region
        (kernels/cpu/decode_step_team.c)."""
        return ctypes.cast(self._team, ctypes.c_void_p).value

    def scratch_bytes(self, rows: int, in_features: int) -> int:
        """Bytes of work space one ``linear`` of ``rows`` rows of ``in_features`` values takes."""
        return int(self._scratch_bytes(rows * self.act_terms, in_features))  # the C side counts quantized rows

    def dequantize(
        self, type_name: str, rows: torch.Tensor, in_features: int, start: int = 0, count: int | None = None
    ) -> torch.Tensor:
        """Rows ``[start, start + count)`` of W as float32 ``[count, in]``."""
        assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous()
        count = rows.shape[0] - start if count is None else count
        assert start >= 0 and start + count <= rows.shape[0]
        out = torch.empty((count, in_features), dtype=torch.float32)
        self._dequantize(
            self.tag(type_name), rows.data_ptr(), start, count, in_features, rows.shape[1], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


L = TypeVar("L", bound=RowKernelLibrary)


def load_built(sources: Sources, variant: Variant, make: Callable[[Path], L], kind: str, fallback: str) -> L | None:
    """``make`` of ``sources`` built as ``variant`` for this machine, its path logged; None where no
    compiler builds it here, logged with what the engine does instead (``fallback``). ``kind``: the
    library's name in the log ("quantized C kernels")."""
    cc = os.environ.get("CC", "cc")
    compiler = shutil.which(cc)
    if compiler is None:
        log.warning("no C compiler (CC=%s): %s", cc, fallback)
        return None
    try:
        library = make(build_library(sources, compiler, variant))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("%s unavailable, %s: %s", kind, fallback, e)
        return None
    log.info("%s: %s, %s code path", kind, library.name, library.instructions)
    return library
