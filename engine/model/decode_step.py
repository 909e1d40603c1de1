"""A decode step's decoder layers as one C call (kernels/cpu/decode_step.c), where the step allows it.

The layers' forward calls ~10 kernels per layer from Python; at a decode step of a few sequences the
calls (argument checks, output tensors, ctypes conversion) cost about a fifth of the step. This runs the
same kernels in the same order from C, so its output is the same bits as the layer-by-layer path.

It takes a step when every row decodes one token through the C decode kernel (the runner's plan is a
``NativeDecode`` of every row), no LoRA adapter is in the step, and every projection computes that many
rows with a C kernel: a float ``Linear`` the C linear (the forms timed at load pick it for the row
count), a ``QuantLinear`` (engine/quant/linear.py, a GGUF or ``--quantization`` model) its ``int`` form,
kernels/cpu/quant.c's very function, which the C step calls through its address (a ``QuantParts`` of two
formats: one call per format, engine/quant/parts.py). Otherwise the layers
run one by one as before.
"""

from __future__ import annotations

import torch

from engine.kv.pool import KVPool
from engine.lora.manager import LoRAStep
from engine.model.cpu_linear import Linear
from engine.quant.linear import QuantLinear
from engine.quant.parts import QuantParts
from engine.step.attention_metadata import AttentionMetadata
from kernels.cpu.native import DecodeLayer, DecodeShape, NativeLibrary, Projection
from kernels.cpu.row_library import RowKernelLibrary
from kernels.triton.paged_decode import NativeDecode


class FusedDecodeStep:
    def __init__(self, model, native: NativeLibrary):
        """``model``: a CausalLM with C layer ops and chosen forms (``CausalLM.use_fused_decode`` checks)."""
        config = model.config
        self.native = native
        self.layers = (DecodeLayer * len(model.layers))()
        self._projections = _projections(model)
        for entry, layer in zip(self.layers, model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv_bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data_ptr()
            entry.qkv, entry.o = _projection(attn.qkv_proj), _projection(attn.o_proj)
            entry.gate_up, entry.down = _projection(mlp.gate_up_proj), _projection(mlp.down_proj)
        # the quantized kernels (one library for all: engine/quant/apply.py loads it once), where any
        self.quant: RowKernelLibrary | None = next((m.lib for m in _quantized(self._projections)), None)
        self._widest_input = max(config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size)
        self.shape = DecodeShape(
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            inter=config.intermediate_size,
            eps=model.layers[0].input_layernorm.eps,
            scale=model.layers[0].self_attn.scale,
            quant_linear=None if self.quant is None else self.quant.linear_address,
            quant_team=None if self.quant is None else self.quant.team_address,
        )
        self._takes_rows: dict[int, bool] = {}

    @staticmethod
    def fits(model) -> bool:
        """Whether a model can take it: C layer ops, no per-head q/k norms, every projection a float
        ``Linear`` with its C copy held (the forms picked the C linear for some row count) or a
        ``QuantLinear``, all of these on one quantized library."""
        if not model.native_layer_ops or model.config.qk_norm:
            return False
        projections = _projections(model)
        if len({m.lib for m in _quantized(projections)}) > 1:
            return False
        return all(
            isinstance(m, (QuantLinear, QuantParts))
            or (isinstance(m, Linear) and m.copies is not None and m.copies.c is not None)
            for m in projections
        )

    def takes(self, rows: int, meta: AttentionMetadata, lora: LoRAStep | None) -> bool:
        plan = meta.plan
        if plan is None or not isinstance(plan.decode, NativeDecode) or plan.decode_tokens is not None:
            return False
        if lora is not None and lora.groups:
            return False
        takes = self._takes_rows.get(rows)
        if takes is None:
            takes = self._takes_rows[rows] = all(_in_c(m, rows) for m in self._projections)
        return takes

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_pool: KVPool, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every layer over ``x`` (the step's embeddings, updated in place): what the model's forward returns."""
        decode = meta.plan.decode
        layout = kv_pool.layout
        self.shape.block_size = layout.block_size
        self.shape.cache_floats = layout.num_blocks * layout.block_size * layout.kv_heads * layout.row_dim
        self.shape.kv_int8 = layout.dtype == torch.int8
        rows = x.shape[0]
        quant_scratch = None
        if self.quant is not None:  # one space per thread: kernels/cpu/decode_step_team.c's threads each use one
            stride = -(-self.quant.scratch_bytes(rows, self._widest_input) // 64) * 64
            self.shape.quant_scratch_stride = stride
            quant_scratch = torch.empty(torch.get_num_threads() * stride, dtype=torch.uint8)
        self.native.decode_step(
            self.layers,
            self.shape,
            x,
            kv_pool.tensor,
            cos,
            sin,
            meta.slot_mapping,
            decode.block_tables,
            decode.context_lens,
            decode.max_context,
            quant_scratch,
        )
        return x


def _projections(model) -> list:
    """Every layer's four projections (engine/model/layers.py): what the fused step reads in C."""
    return [
        m
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def _quantized(projections: list) -> list[QuantLinear]:
    """The ``QuantLinear`` modules among ``projections``, a split projection's runs included."""
    runs = [r for m in projections for r in (m.runs if isinstance(m, QuantParts) else [m])]
    return [r for r in runs if isinstance(r, QuantLinear)]


def _projection(module) -> Projection:
    """The fused step's record of one projection's weight (``fits`` checked its kind)."""
    if isinstance(module, QuantLinear):
        rows = module.qweight.rows
        return Projection(rows.data_ptr(), module.lib.tag(module.qweight.type_name), rows.shape[1])
    if isinstance(module, QuantParts):  # two runs (parts.MAX_RUNS): the second from column ``split`` on
        first, second = module.runs
        return Projection(
            first.qweight.rows.data_ptr(),
            first.lib.tag(first.qweight.type_name),
            first.qweight.rows.shape[1],
            first.qweight.out_features,
            second.qweight.rows.data_ptr(),
            second.lib.tag(second.qweight.type_name),
            second.qweight.rows.shape[1],
        )
    return Projection(module.copies.c.data_ptr(), -1, 0)


def _in_c(module, rows: int) -> bool:
    """Whether ``module`` computes ``rows`` rows with the kernel the fused step calls."""
    if isinstance(module, QuantLinear):
        return module.form_for(rows) == "int"
    if isinstance(module, QuantParts):
        return all(run.form_for(rows) == "int" for run in module.runs)
    return module.forms.form_for(rows) == "c"
