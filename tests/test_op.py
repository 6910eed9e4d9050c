"""The public entry as a registered torch op (torch.ops.sparse_mla.prefill): opcheck, and
torch.compile (fullgraph, reduce-overhead) against eager and the fp32 reference.

CPU cases run Triton's kernel in the interpreter, so they stay tiny; the GPU cases (marked
``gpu``) run every registered kernel at H 8/16/64/128."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_case, poisoned_like, runnable_everywhere

from sparse_mla import dispatch, op, runtime
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference

OP = torch.ops.sparse_mla.prefill.default


def _op_args(case, out, config=None, validate=None):
    return (*case.args(), case.attn_sink, out, config, validate)


@pytest.mark.parametrize(
    "T, H, D, dtype, index_dtype, sink, N",
    [
        (3, 4, 32, torch.bfloat16, torch.int32, True, 40),
        (2, 16, 16, torch.float16, torch.int64, False, 40),
        (0, 4, 32, torch.bfloat16, torch.int64, True, 40),  # T = 0
        (2, 4, 32, torch.float16, torch.int32, True, 0),  # empty pool: every token empty
    ],
)
def test_opcheck(T, H, D, dtype, index_dtype, sink, N):
    case = make_case(T, H, D, N=N, max_slots=12, dtype=dtype, index_dtype=index_dtype,
                     sink=sink, seed=T * 7 + H)  # fmt: skip
    torch.library.opcheck(OP, _op_args(case, poisoned_like(case.q)))
    # opcheck runs copies of the arguments: the op itself writes out as the reference says.
    out = poisoned_like(case.q)
    OP(*_op_args(case, out))
    rep = check_against_reference(out, *case.args(), attn_sink=case.attn_sink)
    assert rep.ok, rep


def test_opcheck_with_a_config_and_validate():
    case = make_case(4, 16, 32, N=30, max_slots=10, seed=11)
    spec = op.config_spec(dispatch.Choice("triton", {"BLOCK_K": 16}))
    torch.library.opcheck(OP, _op_args(case, poisoned_like(case.q), spec, True))
    out = poisoned_like(case.q)
    OP(*_op_args(case, out, spec, True))
    assert check_against_reference(out, *case.args(), attn_sink=case.attn_sink).ok


def test_empty_tokens_through_the_op():
    """Every token empty (all slots invalid): zeros, with and without out=."""
    case = make_case(3, 4, 32, N=20, max_slots=6, seed=5)
    idx = torch.full_like(case.kv_indices, -1)
    got = sparse_mla_prefill(case.q, case.kv, idx, case.kv_indptr, case.softmax_scale,
                             attn_sink=case.attn_sink)  # fmt: skip
    assert torch.equal(got, torch.zeros_like(case.q))


def test_config_spec_roundtrip():
    from sparse_mla.configs import PrefillConfig

    cfg = PrefillConfig(BLOCK_K=16, num_warps=2)
    spec = op.config_spec(cfg)
    assert op.config_object(spec) is cfg
    # Another process (a cached graph) rebuilds an equal object from the JSON alone.
    op._OBJECTS.pop(spec)
    assert op.config_object(spec) == cfg
    choice = dispatch.Choice("triton", {"BLOCK_K": 32})
    assert op.config_object(op.config_spec(choice)) is choice
    with pytest.raises(TypeError, match="config must be None, a dict, a Choice"):
        op.config_spec(3.5)


def _scaled_attention(q, kv, idx, indptr, scale, sink, config=None):
    o = sparse_mla_prefill(q * 0.5, kv, idx, indptr, scale, attn_sink=sink, config=config)
    return o.float() + 1.0


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_compile_fullgraph_equals_eager_interpreter(index_dtype):
    """fullgraph=True over a function calling the entry on CPU tensors (Triton interpreter):
    no graph break, the same bits as eager, and correct against the fp32 reference."""
    torch._dynamo.reset()
    case = make_case(3, 16, 32, N=40, max_slots=12, index_dtype=index_dtype, seed=3)
    args = (*case.args(), case.attn_sink)
    eager = _scaled_attention(*args)
    explained = torch._dynamo.explain(_scaled_attention)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(_scaled_attention, fullgraph=True, backend="inductor")
    got = compiled(*args)
    assert torch.equal(got, eager)
    q2 = (case.q * 0.5).to(case.q.dtype)
    rep = check_against_reference((got - 1.0).to(case.q.dtype), q2, *case.args()[1:],
                                  attn_sink=case.attn_sink)  # fmt: skip
    assert rep.ok, rep
    # New inputs of the same shapes run the compiled graph again, and still match eager.
    case2 = make_case(3, 16, 32, N=40, max_slots=12, index_dtype=index_dtype, seed=4)
    args2 = (*case2.args(), case2.attn_sink)
    assert torch.equal(compiled(*args2), _scaled_attention(*args2))


def test_compile_fullgraph_with_a_choice_argument():
    """A kernel forced by name (dispatch.Choice), passed as an argument of the compiled
    function: spelt out at trace time, no graph break."""
    torch._dynamo.reset()
    case = make_case(2, 16, 32, N=30, max_slots=10, seed=13)
    args = (*case.args(), case.attn_sink)
    choice = dispatch.Choice("triton")
    eager = _scaled_attention(*args, config=choice)
    got = torch.compile(_scaled_attention, fullgraph=True)(*args, config=choice)
    assert torch.equal(got, eager)


def test_compile_fullgraph_with_out_and_config():
    """out= given (mutated in place through the compiled graph) and a forced launch."""
    torch._dynamo.reset()
    from sparse_mla.configs import PrefillConfig

    cfg = PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4)
    case = make_case(2, 16, 32, N=30, max_slots=10, sink=False, seed=9)

    def f(q, kv, idx, indptr, out):
        sparse_mla_prefill(q, kv, idx, indptr, case.softmax_scale, out=out, config=cfg)
        return out.float().sum(-1)

    out_e, out_c = poisoned_like(case.q), poisoned_like(case.q)
    eager = f(case.q, case.kv, case.kv_indices, case.kv_indptr, out_e)
    got = torch.compile(f, fullgraph=True)(case.q, case.kv, case.kv_indices, case.kv_indptr,
                                           out_c)  # fmt: skip
    assert torch.equal(got, eager) and torch.equal(out_c, out_e)
    assert check_against_reference(out_c, *case.args()).ok


def test_validate_under_compile_runs_in_the_op():
    """validate=True checks kv_indptr's values when the compiled graph runs (in the op's real
    kernel, not at trace time): a bad kv_indptr raises, a good one runs."""
    torch._dynamo.reset()
    case = make_case(3, 4, 32, N=20, max_slots=6, seed=2)

    def f(q, kv, idx, indptr):
        return sparse_mla_prefill(q, kv, idx, indptr, case.softmax_scale, validate=True) * 2

    g = torch.compile(f, fullgraph=True)
    assert torch.equal(g(case.q, case.kv, case.kv_indices, case.kv_indptr),
                       f(case.q, case.kv, case.kv_indices, case.kv_indptr))  # fmt: skip
    bad = case.kv_indptr.clone()
    bad[1] = bad[-1] + 5
    with pytest.raises(ValueError, match="kv_indptr"):
        g(case.q, case.kv, case.kv_indices, bad)


# ----------------------------------------------------------------------------------------------
# GPU: every registered kernel, reduce-overhead, a toy model
# ----------------------------------------------------------------------------------------------


def _gpu_kernels(H: int, T: int):
    call = dispatch.Call(runtime.arch(), H, 512, torch.bfloat16, num_tokens=T)
    return [n for n, k in dispatch.KERNELS.items() if not k.why_not(call)]


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 64, 128])
def test_gpu_compile_fullgraph_every_kernel(H):
    T = 70
    case = make_case(T, H, 512, N=3000, max_slots=300, device="cuda", seed=H)
    args = (*case.args(), case.attn_sink)
    names = [*_gpu_kernels(H, T), None]
    for name in names:
        torch._dynamo.reset()
        cfg = None if name is None else dispatch.Choice(name)
        eager = _scaled_attention(*args, config=cfg)
        compiled = torch.compile(_scaled_attention, fullgraph=True)
        got = compiled(*args, config=cfg)
        assert torch.equal(got, eager), name
        q2 = (case.q * 0.5).to(case.q.dtype)
        rep = check_against_reference((got - 1.0).to(case.q.dtype), q2, *case.args()[1:],
                                      attn_sink=case.attn_sink)  # fmt: skip
        assert rep.ok, (name, rep)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64])
def test_gpu_reduce_overhead_replays_new_inputs(H):
    torch._dynamo.reset()
    T = 40

    def f(q, kv, idx, indptr, sink):
        return sparse_mla_prefill(q * 0.5, kv, idx, indptr, 512**-0.5, attn_sink=sink) + 1

    g = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for seed in range(5):  # warm-up, capture, then replays on new inputs
        case = make_case(T, H, 512, N=2000, max_slots=200, device="cuda", seed=100 + seed)
        args = (*case.args()[:4], case.attn_sink)
        got = g(*args).clone()
        assert torch.equal(got, f(*args)), seed


@pytest.mark.gpu
def test_gpu_two_layer_toy_model_compiles_end_to_end():
    """Two attention layers with projections between them, compiled whole (fullgraph)."""
    torch._dynamo.reset()
    H, D, T = 16, 512, 64

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D, bias=False, dtype=torch.bfloat16)
            self.sink = torch.nn.Parameter(torch.randn(H) * 0.5, requires_grad=False)

        def forward(self, x, kv, idx, indptr):
            q = self.proj(x)
            o = sparse_mla_prefill(q, kv, idx, indptr, D**-0.5, attn_sink=self.sink)
            return x + o

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def forward(self, x, kv, idx, indptr):
            for layer in self.layers:
                x = layer(x, kv, idx, indptr)
            return x

    torch.manual_seed(0)
    model = Model().cuda()
    case = make_case(T, H, D, N=1500, max_slots=200, device="cuda", seed=7)
    x = (torch.randn(T, H, D, device="cuda") * 0.1).to(torch.bfloat16)
    with torch.no_grad():
        eager = model(x, case.kv, case.kv_indices, case.kv_indptr)
        got = torch.compile(model, fullgraph=True)(x, case.kv, case.kv_indices, case.kv_indptr)
    assert torch.isfinite(got).all()
    assert torch.equal(got, eager)


def test_known_layout_still_checks_addresses_scale_and_values():
    """validate_inputs runs the layout checks once per layout; a later call of the same layout
    still has its scale, out's overlap with the inputs and (on CPU) kv_indptr checked."""
    T, H, D, N = 3, 4, 32, 10
    case = make_case(T, H, D, N=N, max_slots=6, seed=21)
    kv = case.kv.contiguous()
    out = poisoned_like(case.q)
    args = (case.q, kv, case.kv_indices, case.kv_indptr)
    sparse_mla_prefill(*args, case.softmax_scale, attn_sink=case.attn_sink, out=out)
    assert check_against_reference(out, *args, case.softmax_scale, attn_sink=case.attn_sink).ok
    # The same layout, with out sharing kv's memory.
    big = torch.zeros(T * H * D, dtype=kv.dtype)
    out2 = big.view(T, H, D)
    kv2 = big[: N * D].view(N, D)
    kv2.copy_(kv)
    with pytest.raises(ValueError, match="out overlaps kv"):
        sparse_mla_prefill(case.q, kv2, case.kv_indices, case.kv_indptr, case.softmax_scale,
                           attn_sink=case.attn_sink, out=out2)  # fmt: skip
    for bad in (float("inf"), float("nan"), 1e39):
        with pytest.raises(ValueError, match="softmax_scale"):
            sparse_mla_prefill(*args, bad, attn_sink=case.attn_sink, out=out)
    ptr = case.kv_indptr.clone()
    ptr[-1] = case.kv_indices.numel() + 1
    with pytest.raises(ValueError, match="past the end"):
        sparse_mla_prefill(case.q, kv, case.kv_indices, ptr, case.softmax_scale,
                           attn_sink=case.attn_sink, out=out)  # fmt: skip


def test_cached_choice_reads_the_shipped_files_under_the_user_root(tmp_path, monkeypatch):
    """Outside use_root, the entry's cached choice reads the user root over the shipped files,
    as choose() and the bench's labels do: with no user file every grid point (the shipped
    sm90 file's recorded buckets among them) gets choose()'s answer; a user file then wins for
    its shape and the shipped file still answers the others. (From 493daea the cached choice
    read the user root alone, so on a machine without a user file the shipped recorded choices
    were never run: sm90 GLM H32 ran gluon_ws_small, 1.04x the recorded gluon_ws.)"""
    from sparse_mla import bench, configs

    runnable_everywhere(monkeypatch)
    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(user))
    assert configs.roots() == (user, configs.CONFIG_ROOT)
    kv = torch.zeros(64, 512, dtype=torch.bfloat16)

    def both(H, T):
        got = dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, T)
        want = dispatch.choose(dispatch.Call("sm90", H, 512, torch.bfloat16, kv, T))
        assert (got.kernel, got.launch, got.reason) == (want.kernel, want.launch,
                                                         want.reason), (H, T)  # fmt: skip
        return got

    recorded = 0
    for H in bench.GRID_HEADS:
        for T in bench.GRID_TOKENS:
            reason = both(H, T).reason
            recorded += reason.startswith("recorded")
            assert "DEFAULT.json" not in reason, reason  # a shipped entry's file is not named
    assert recorded > 0, "no grid point read the shipped sm90 file"
    prov = {"device": "test", "date": "2026-12-02", "source": "test", "times_ms": {"triton": 1}}
    tprov = {"device": "test", "triton": "3.6.0", "date": "2026-12-02", "workload": "w",
             "time_ms": 1.0, "sweep_size": 1}  # fmt: skip
    launch = {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    before = dispatch.choice_stamp("sm90")
    path = configs.config_path("sm90", user)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"kernel": {"name": "triton", "provenance": prov}, "launch": launch,
             "provenance": tprov}  # fmt: skip
    path.write_text(json.dumps({"H64_D512": entry}))
    assert dispatch.choice_stamp("sm90") != before
    got = both(64, 16384)
    assert got.kernel == "triton" and got.reason.endswith(f" [{path}]"), got.reason
    assert (
        both(32, 16384).reason
        == dispatch.choose(
            dispatch.Call("sm90", 32, 512, torch.bfloat16, kv, 16384), root=configs.CONFIG_ROOT
        ).reason
    )


def test_cached_choice_sees_an_export_into_the_shipped_root(tmp_path, monkeypatch):
    """The entry stats the shipped file once a process (dispatch._SHIPPED); an export into the
    shipped root (tune.export_kernel_choice) clears that, so the next call reads the new choice."""
    from sparse_mla import configs, tune

    runnable_everywhere(monkeypatch)
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    user.mkdir()
    monkeypatch.setattr(configs, "CONFIG_ROOT", shipped)
    monkeypatch.setattr(configs, "_ROOTS_BY_ENV", {})
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(user))
    kv = torch.zeros(64, 512, dtype=torch.bfloat16)
    dispatch.clear_cache()
    try:
        first = dispatch.choose_cached("sm90", 64, 512, torch.bfloat16, kv, 16384)
        assert first.reason.startswith("rule for sm90 H=64"), first.reason
        row = {"timestamp": "2026-12-02T10:00:00+00:00", "device": "NVIDIA H200",
               "torch": "2.11", "triton": "3.6.0", "commit": "c0ffee", "workload": "csa_h64",
               "T": "16384", "H": "64", "D": "512", "ok": "True"}  # fmt: skip
        triton_cfg = {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
        rows = [{**row, "provider": "triton", "config": json.dumps(triton_cfg), "ms": "1.0"},
                {**row, "provider": "gluon_ws", "config": "{}", "ms": "2.0"}]  # fmt: skip
        tune.export_kernel_choice(rows, "sm90", root=shipped, source="unit test")
        again = dispatch.choose_cached("sm90", 64, 512, torch.bfloat16, kv, 16384)
        assert again.kernel == "triton" and again.reason.startswith("recorded H64_D512")
        assert str(shipped) not in again.reason  # the shipped file is not named
    finally:
        dispatch.clear_cache()


def test_cached_choice_is_choose_at_every_list_length(tmp_path, monkeypatch):
    """With the shipped sm90 file (choices split by slots per token below T = 32), the entry's
    cached choice answers as choose() on both sides of every slot bound of every grid head
    count, whatever order the lengths come in; a call of unknown length takes the longest."""
    from sparse_mla import bench

    runnable_everywhere(monkeypatch)
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(tmp_path))  # an empty user root
    kv = torch.zeros(64, 512, dtype=torch.bfloat16)
    split = 0
    for H in bench.GRID_HEADS:
        bounds = dispatch.slot_bounds("sm90", H, 512)
        split += len(bounds) > 0
        lengths = sorted({0, 1, 100_000, *bounds, *(b - 1 for b in bounds if b)})
        for T in (1, 3, 4, 16, 31, 64, 1024):
            for slots in (*lengths[::-1], *lengths, None):
                nnz = None if slots is None else T * slots
                got = dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, T, nnz)
                want = dispatch.choose(dispatch.Call("sm90", H, 512, torch.bfloat16, kv, T, nnz))
                assert (got.kernel, got.launch, got.reason) == (
                    want.kernel, want.launch, want.reason), (H, T, slots)  # fmt: skip
        unknown = dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, 4)
        longest = dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, 4, 4 * 100_000)
        assert (unknown.kernel, unknown.reason) == (longest.kernel, longest.reason), H
    # Every grid head count was measured at short and long lists below T = 32, and at each the
    # choice splits by length.
    assert split == len(bench.GRID_HEADS)


def test_cached_choice_is_choose_at_every_token_count(tmp_path):
    """choose_cached answers as choose() does on both sides of every token bound (recorded
    buckets and RULE's), and sees a rewritten configs file at once."""
    from sparse_mla import configs

    times = {"gluon_ws_small": 1.0, "gluon_ws": 1.0, "triton": 1.0}
    prov = {"device": "test", "date": "2026-12-01", "source": "test", "times_ms": times}
    launch = {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    tprov = {"device": "test", "triton": "3.6.0", "date": "2026-12-01", "workload": "w",
             "time_ms": 1.0, "sweep_size": 1}  # fmt: skip

    def write(kernels):
        path = configs.config_path("sm90", tmp_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"kernel": kernels, "launch": launch, "provenance": tprov}
        path.write_text(json.dumps({"H64_D512": entry, "H16_D512": entry}))

    write([{"name": "gluon_ws_small", "tokens": [0, 100], "provenance": prov},
           {"name": "triton", "tokens": [100, 300], "provenance": prov},
           {"name": "gluon_ws", "tokens": [300, None], "provenance": prov}])  # fmt: skip
    kv = torch.zeros(64, 512, dtype=torch.bfloat16)  # a CPU pool: the Gluon kernels cannot run
    with configs.use_root(tmp_path):
        for H in (16, 64, 40):
            for T in (1, 99, 100, 101, 127, 128, 299, 300, 5000):
                got = dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, T)
                want = dispatch.choose(dispatch.Call("sm90", H, 512, torch.bfloat16, kv, T))
                assert (got.kernel, got.launch, got.reason) == (want.kernel, want.launch,
                                                                 want.reason), (H, T)  # fmt: skip
                assert dispatch.choose_cached("sm90", H, 512, torch.bfloat16, kv, T) is got
        assert dispatch.token_bounds("sm90", 64, 512) == (0, 100, 128, 300)
        before = dispatch.choose_cached("sm90", 64, 512, torch.bfloat16, kv, 150).reason
        write({"name": "gluon_ws", "provenance": prov})
        after = dispatch.choose_cached("sm90", 64, 512, torch.bfloat16, kv, 150).reason
        assert "gluon_ws recorded" in after and before != after
