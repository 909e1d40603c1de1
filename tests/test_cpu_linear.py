"""The CPU matmul forms of engine/model/cpu_linear.py against F.linear, on the shapes and strides the engine
gives them (the MLP's down_proj reads a strided half of gate_up), how a row count picks its form, and
how timings pick the forms and the copies of a weight to hold."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_linear
from engine.model.cpu_linear import (
    LM_HEAD_SLICE_ROWS,
    PLAIN,
    ROW_BUCKETS,
    Linear,
    MatmulForms,
    _pick,
    exclusive_timing,
    linear_packed,
    linear_transposed,
    pack_weight,
)
from engine.model.loader import load_model
from kernels.cpu import native as cpu_native
from tests.model_factory import tiny_model_dir


@pytest.mark.parametrize("rows", [1, 5, 64, 200])
@pytest.mark.parametrize("slice_rows", [None, 7, 1024])
def test_linear_transposed_equals_f_linear(rows, slice_rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 48, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    out = linear_transposed(x, weight, slice_rows)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_transposed_reads_a_strided_input():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 40, generator=gen)
    gate = gate_up[:, :40]  # row stride 80, as F.silu(gate, inplace=True) leaves it for down_proj
    weight = torch.randn(24, 40, generator=gen)
    torch.testing.assert_close(
        linear_transposed(gate, weight), F.linear(gate.contiguous(), weight), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("rows", [1, 5, 64, 200])
def test_linear_packed_equals_f_linear_with_bias_and_a_strided_input(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 40, generator=gen), torch.randn(300, generator=gen)
    packed = pack_weight(weight)  # the pinned CPU torch has oneDNN: None here would be a broken build
    assert packed is not None and packed.is_mkldnn
    gate_up = torch.randn(rows, 2 * 40, generator=gen)
    strided = gate_up[:, :40]  # row stride 80: the MLP's down_proj input
    for x in (strided.contiguous(), strided):
        torch.testing.assert_close(
            linear_packed(x, packed, bias), F.linear(strided.contiguous(), weight, bias), rtol=1e-5, atol=1e-5
        )


def test_pack_weight_declines_what_it_was_not_measured_on_or_when_onednn_is_off(monkeypatch):
    assert pack_weight(torch.randn(8, 4, dtype=torch.float64)) is None
    assert pack_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not torch._C._get_mkldnn_enabled()
    assert pack_weight(torch.randn(8, 4)) is None


def everywhere(form: str, slice_rows: int | None = None) -> MatmulForms:
    """``form`` at every row bucket (the C kernel built here for "c"), prefill packed where that is the
    form, else plain."""
    native = cpu_native.load() if form == "c" else None
    assert form != "c" or native is not None, "the C kernels did not build here"
    return MatmulForms((form,) * len(ROW_BUCKETS), slice_rows, native, "packed" if form == "packed" else "plain")


ALL_TRANSPOSED = everywhere("transposed")
PACKED = everywhere("packed")


def use_forms_everywhere(model, form: str) -> None:
    """Every projection and the LM head in ``form``, whatever timing would choose."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.use_forms(everywhere(form))
    model.use_lm_head_forms(everywhere(form, LM_HEAD_SLICE_ROWS))


def test_a_row_count_takes_the_form_of_the_first_bucket_that_holds_it():
    only_16 = MatmulForms(tuple("transposed" if rows == 16 else "plain" for rows in ROW_BUCKETS))
    assert [r for r in range(1, 200) if only_16.form_for(r) == "transposed"] == list(range(9, 17))
    assert {PLAIN.form_for(r) for r in range(1, 200)} == {"plain"}
    assert ALL_TRANSPOSED.form_for(ROW_BUCKETS[-1] + 1) == "plain"  # past the last bucket: plain ...
    assert PACKED.form_for(ROW_BUCKETS[-1] + 1) == "packed"  # ... or packed, where that copy is held
    with pytest.raises(AssertionError):
        MatmulForms(("plain",))  # one form per bucket or none
    with pytest.raises(AssertionError):
        MatmulForms(("packed",) * len(ROW_BUCKETS), prefill="plain")  # one torch copy: packed or dense
    with pytest.raises(AssertionError):
        MatmulForms(("c",) * len(ROW_BUCKETS))  # the C form needs the kernels


def bucket_times(**per_form: list[float]) -> list[dict[str, float]]:
    return [{form: times[i] for form, times in per_form.items()} for i in range(len(ROW_BUCKETS))]


def test_picking_forms_and_the_copies_to_hold():
    native = cpu_native.load()
    # buckets:        1   4   8   16  32  48  64  96  128
    plain = [5, 10, 20, 30, 40, 50, 60, 70, 80]
    transposed = [6, 9, 21, 31, 41, 51, 61, 71, 81]
    packed_fast = [7, 8, 10, 20, 30, 40, 50, 60, 70]  # wins 7 of 9 buckets against the dense forms
    c_small = [4, 5, 9, 40, 50, 60, 70, 80, 90]  # the fastest of all at 1, 4 and 8 rows
    # Without the C kernel: one copy, packed where it wins most buckets, else dense.
    only_packed = _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_fast), None, None)
    assert only_packed.per_bucket == ("packed",) * 9 and not only_packed.holds_dense
    packed_slow = [p + 100 for p in packed_fast]
    dense = _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_slow), None, None)
    assert dense.per_bucket == ("plain", "transposed") + ("plain",) * 7 and not dense.holds_packed
    # Where the C linear is the fastest at some buckets, its copy is held beside one torch copy: packed
    # is judged (and wins) on the other six; every bucket takes the fastest form held.
    both = _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_fast, c=c_small), None, native)
    assert both.per_bucket == ("c", "c", "c") + ("packed",) * 6 and both.prefill == "packed"
    assert both.holds_c and both.holds_packed and not both.holds_dense and both.native is native
    # Judged on its other buckets, dense wins: the C copy and the dense one.
    c_and_dense = _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_slow, c=c_small), None, native)
    assert c_and_dense.per_bucket == ("c", "c", "c") + ("plain",) * 6
    assert c_and_dense.holds_c and c_and_dense.holds_dense and not c_and_dense.holds_packed
    # The C linear the fastest everywhere: the torch copy for prefill is judged on the last bucket.
    c_fast = [t - 3 for t in packed_fast]
    all_c = _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_fast, c=c_fast), None, native)
    assert all_c.per_bucket == ("c",) * 9 and all_c.prefill == "packed" and all_c.form_for(1000) == "packed"
    # The C kernel never the fastest: as if it were not there.
    c_slow = [t + 100 for t in c_small]
    assert (
        _pick(bucket_times(plain=plain, transposed=transposed, packed=packed_fast, c=c_slow), None, native)
        == only_packed
    )


@pytest.mark.parametrize("form", ["plain", "transposed", "packed", "c"])
@pytest.mark.parametrize("rows", [3, ROW_BUCKETS[-1], ROW_BUCKETS[-1] + 1])
def test_linear_module_matches_nn_linear_with_bias(form, rows):
    gen = torch.Generator().manual_seed(rows)
    reference = torch.nn.Linear(32, 64, bias=True)  # 64 outputs: a shape the C kernel takes
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, 32, generator=gen))
        reference.bias.copy_(torch.randn(64, generator=gen))
    layer = Linear(32, 64, bias=True)
    layer.load_state_dict(reference.state_dict())
    layer.use_forms(everywhere(form))
    x = torch.randn(rows, 32, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_c", [False, True], ids=["torch", "torch+c"])
def test_timed_forms_cover_every_projection_shape_once_and_the_lm_head(with_c):
    model, _ = load_model(tiny_model_dir("qwen2"))  # qwen2: a bias on qkv_proj
    native = cpu_native.load() if with_c else None
    chosen = model.choose_cpu_matmul_forms(native)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    shapes = {f"{m.out_features}x{m.in_features}" for m in linears}
    assert set(chosen) == shapes | {"lm_head"}
    for m in linears:  # one timing per shape, shared by every layer
        assert m.forms is chosen[f"{m.out_features}x{m.in_features}"]
        assert len(m.forms.per_bucket) == len(ROW_BUCKETS) and m.forms.slice_rows is None
        assert m.forms.native in (None, native)
        # The copies held are the ones the chosen forms read: one torch copy, and the C one where it won.
        held = (m.copies.dense is not None, m.copies.packed is not None, m.copies.c is not None)
        assert held == (m.forms.holds_dense, m.forms.holds_packed, m.forms.holds_c) and sum(held[:2]) == 1
        assert (m.weight is not None) == m.forms.holds_dense
    assert model.lm_head_forms is chosen["lm_head"] and model.lm_head_forms.slice_rows == LM_HEAD_SLICE_ROWS
    assert (model.lm_head_copies.packed is not None) == model.lm_head_forms.holds_packed
    assert (model.lm_head_copies.c is not None) == model.lm_head_forms.holds_c


def test_a_process_times_each_model_shape_once_per_thread_count_and_kernels(monkeypatch, tmp_path):
    """A second engine of one model in one process takes the first one's forms (so a test's reference
    engine rounds as the engine under test does); a new thread count or kernel set is timed afresh."""
    monkeypatch.setenv("PDSERVE_CPU_FORMS_CACHE_DIR", str(tmp_path))  # nothing stored by earlier tests
    timings = []  # the kernels each timing ran with
    real = cpu_linear._timed_picks
    monkeypatch.setattr(cpu_linear, "_picked", {})
    monkeypatch.setattr(cpu_linear, "_timed_picks", lambda *args: timings.append(args[3]) or real(*args))
    native = cpu_native.load()
    first = load_model(tiny_model_dir("qwen2"))[0].choose_cpu_matmul_forms(native)
    second = load_model(tiny_model_dir("qwen2"))[0].choose_cpu_matmul_forms(native)
    assert len(timings) == 1 and second == first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        load_model(tiny_model_dir("qwen2"))[0].choose_cpu_matmul_forms(native)
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 2
    without_c = load_model(tiny_model_dir("qwen2"))[0].choose_cpu_matmul_forms(None)
    assert timings == [native, native, None]
    assert all(forms.native is None for forms in without_c.values())


@pytest.mark.parametrize("form", ["transposed", "packed", "c"])
def test_model_logits_are_the_same_in_every_form(form):
    # Whatever the timing picks, the model computes the same logits (the parity tests check the timed
    # choice against transformers).
    model, config = load_model(tiny_model_dir("qwen2"))
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain_logits = model.compute_logits(hidden)
        plain_mlp = model.layers[0].mlp(hidden)
        use_forms_everywhere(model, form)
        torch.testing.assert_close(model.compute_logits(hidden), plain_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.layers[0].mlp(hidden), plain_mlp, rtol=1e-5, atol=1e-5)


def test_form_timing_is_exclusive_across_processes(tmp_path):
    """Workers started together time their forms one after another: each child holds the lock for
    0.3 s and records when; no two holds overlap, and a lock file that cannot be opened blocks nothing."""
    lock, log = tmp_path / "timing.lock", tmp_path / "holds"
    child = (
        "import sys, time\n"
        "from engine.model.cpu_linear import exclusive_timing\n"
        "with exclusive_timing(sys.argv[1]):\n"
        "    start = time.time(); time.sleep(0.3)\n"
        "    open(sys.argv[2], 'a').write(f'{start} {time.time()}\\n')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", child, str(lock), str(log)]) for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    holds = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(holds) == 3
    assert all(earlier[1] <= later[0] for earlier, later in zip(holds, holds[1:]))
    with exclusive_timing(str(tmp_path / "missing-dir" / "timing.lock")):  # cannot be created: no lock
        pass
