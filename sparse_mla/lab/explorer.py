"""Notebook 02's constexpr explorer: widgets -> recompile -> resources, mix, ISA, error, time.

:class:`ExplorerPanel` has a kernel selector (every registered kernel that cross-compiles for
the target and reads a pool format the panel can feed, :func:`kernels_for`: a dense pool, or the
FP8 cache quantized from it, :data:`POOL_FEEDS`) and one widget per launch choice of the
selected kernel: for the Triton kernels (a PrefillConfig launch: the bf16 one and the FP8-cache
one) ``EVEN_HD``, ``USE_EXP2``, ``BLOCK_H``, ``BLOCK_K``, ``num_warps``, ``num_stages``, the
AMD-only ``kpack`` / ``waves_per_eu`` and the NVIDIA-only register cap ``maxnreg``; for another
kernel one widget per field of its config class. Target and shape H x D are widgets too.
Notebook 05 shows the same panel opened on a Gluon kernel. Every change

1. checks the combination at once (``PrefillConfig.validate``, the ``EVEN_HD`` rule,
   :func:`sparse_mla.targets.validate_options`) and says why an invalid one is invalid;
2. cross-compiles the kernel for the target (:func:`sparse_mla.inspect.compile_prefill`) in a
   worker thread while a progress bar and a label say what is running; the panel never blocks;
3. runs the kernel at a small size (Triton's interpreter on CPU, the GPU when there is one)
   against the fp32 reference, and times it when the target is this machine's GPU.

The status line names one state (``panel.phase``), each with its own colour and words:
``compiling`` (working; the views of the previous setting stay greyed and marked stale until
replaced), ``ok``, ``invalid`` (the setting is refused before compiling), ``failed`` (the
compiler failed: one line names the pass, its first error and the setting, and the compiler's
whole output, e.g. MLIR's reproducer, is kept in the file ``panel.failure_log``), ``cannot-launch``
(it compiles but occupancy is 0, e.g. more LDS than a CU has: nothing is run) and ``stale``
(the panel stopped: closed, or a bug in its run). Invalid and failed settings clear every view;
nothing of an older setting is left looking current. The compiler's output is captured per
call, so a print from another cell during a compile still shows.

Results of an older widget state are dropped when they arrive late. ``panel.update(wait=True)``
(or ``panel.wait()`` after setting widget values) is the synchronous mode the tests use.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import html
import re
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import inspect as _inspect
from .. import runtime, targets
from ..prefill import PrefillConfig, default_config, launch_constexprs, sparse_mla_prefill
from ..reference import error_report, sparse_mla_prefill_ref
from .figures import (
    error_figure,
    html_table,
    mix_figure,
    occupancy_figure,
    png_size,
    pre_block,
    to_png,
)

__all__ = ["ExplorerPanel", "PanelState", "check_state", "error_run"]

NAMED_TARGETS = ("gfx950", "gfx942", "sm90", "sm100")
HEADS = (8, 16, 32, 64, 128)
HEAD_DIMS = (128, 256, 512, 576)


@dataclass(frozen=True)
class PanelState:
    """Everything one compile depends on: a target name, the shape and the launch config."""

    target: str
    num_heads: int
    head_dim: int
    config: Any  # the kernel's launch: a PrefillConfig (triton, triton_fp8) or its config class
    kernel: str = "triton"  # a name of sparse_mla.dispatch.KERNELS

    @property
    def is_amd(self) -> bool:
        return targets.get_target(self.target).is_amd

    @property
    def run_config(self) -> Any:
        """What ``sparse_mla_prefill(config=...)`` takes to run exactly this kernel and launch."""
        if self.kernel == "triton":
            return self.config
        from ..dispatch import Choice

        return Choice(self.kernel, self.config)

    @property
    def kv_format(self) -> str:
        """The pool format the kernel reads (a key of :data:`POOL_FEEDS`)."""
        from ..dispatch import kernel

        return kernel(self.kernel).kv_format

    def label(self) -> str:
        if not isinstance(self.config, PrefillConfig):
            knobs = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.config).items())
            return f"{self.target} H={self.num_heads} D={self.head_dim}: {self.kernel} {knobs}"
        c = self.config
        bits = [f"BLOCK_H={c.BLOCK_H}", f"BLOCK_K={c.BLOCK_K}", f"EVEN_HD={c.EVEN_HD}",
                f"USE_EXP2={c.USE_EXP2}", f"num_warps={c.num_warps}",
                f"num_stages={c.num_stages}"]  # fmt: skip
        if self.is_amd:
            bits += [f"kpack={c.kpack}", f"waves_per_eu={c.waves_per_eu}"]
        elif c.maxnreg is not None:
            bits.append(f"maxnreg={c.maxnreg}")
        name = "" if self.kernel == "triton" else f"{self.kernel} "
        return f"{self.target} H={self.num_heads} D={self.head_dim}: {name}" + " ".join(bits)


# Register caps offered on NVIDIA targets (ptxas takes 24..255 per thread).
MAXNREG = (64, 96, 128, 168, 200, 255)


def check_state(state: PanelState) -> str | None:
    """Why this combination cannot compile (one sentence), or None when it can."""
    if state.kernel != "triton":
        why = _check_kernel_state(state)
        if why or not isinstance(state.config, PrefillConfig):
            return why
    cfg = state.config  # Triton's launch (the bf16 or the FP8-cache kernel): Triton's checks
    try:
        cfg.validate()
    except ValueError as e:
        return str(e)
    consts = launch_constexprs(state.num_heads, state.head_dim, torch.bfloat16, cfg, has_sink=True)
    block_d = consts["BLOCK_D"]
    if cfg.EVEN_HD and (state.head_dim != block_d or state.num_heads % cfg.BLOCK_H):
        why = []
        if state.head_dim != block_d:
            why.append(f"head_dim {state.head_dim} is not a power of two (BLOCK_D={block_d})")
        if state.num_heads % cfg.BLOCK_H:
            why.append(f"H={state.num_heads} is not a multiple of BLOCK_H={cfg.BLOCK_H}")
        return "EVEN_HD=True needs head_dim == BLOCK_D and H % BLOCK_H == 0: " + "; ".join(why)
    opts: dict[str, Any] = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if state.is_amd:
        opts.update(kpack=cfg.kpack, waves_per_eu=cfg.waves_per_eu)
    elif cfg.maxnreg is not None:
        opts["maxnreg"] = cfg.maxnreg
    try:
        targets.validate_options(state.target, opts)
    except ValueError as e:
        return str(e)
    return None


def _check_kernel_state(state: PanelState) -> str | None:
    """check_state for a kernel other than Triton: its targets, the call it can take, and the
    launch (its config's own checks and the kernel's, e.g. a shared-memory budget)."""
    from .. import dispatch, tune

    arch = targets.get_target(state.target).name
    try:
        k = dispatch.kernel(state.kernel)
        why = k.unavailable(
            dispatch.Call(arch, state.num_heads, state.head_dim, kv_format=k.kv_format)
        )
        if why:
            return f"{state.kernel} cannot run H={state.num_heads} D={state.head_dim}: {why}"
        tune.kernel_launch(state.kernel, arch, state.num_heads, state.head_dim, base=state.config)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


# The pool formats the panel can feed a kernel (``Kernel.kv_format``, keys of
# sparse_mla.dispatch.FORMATS): each turns the panel's random dense bf16 [N, D] pool into
# (what the kernel reads, the [N', D] rows the fp32 reference reads for it). An FP8 cache is
# the pool quantized (sparse_mla.fp8.quantize, FP8_BLOCK_SIZE tokens a block), its reference
# rows the cache dequantized (exact; N' = whole blocks, slot s = row s, as the kernel reads).
FP8_BLOCK_SIZE = 64


def _dense_pool(kv: torch.Tensor) -> tuple[Any, torch.Tensor]:
    return kv, kv


def _fp8_pool(kv: torch.Tensor) -> tuple[Any, torch.Tensor]:
    from .. import fp8

    cache = fp8.quantize(kv.to(torch.bfloat16), FP8_BLOCK_SIZE)
    return cache, fp8.dequantize(cache)


POOL_FEEDS = {"dense": _dense_pool, "fp8_model1": _fp8_pool}


def uses_triton_controls(name: str) -> bool:
    """Whether kernel ``name``'s launch is a PrefillConfig (the Triton kernels: the bf16 one
    and the FP8-cache one), shown with the panel's Triton widgets; other kernels get one widget
    per field of their config class."""
    from .. import dispatch

    t = PrefillConfig
    return name == dispatch.FALLBACK or dispatch.kernel(name).config_type == (
        f"{t.__module__}:{t.__qualname__}"
    )


def kernels_for(target: str) -> list[str]:
    """The registered kernels that cross-compile for ``target`` and read a pool format the
    panel can feed (:data:`POOL_FEEDS`: dense, and the FP8 cache made from the same random
    pool); Triton first (every target)."""
    from .. import dispatch, tune

    arch = targets.get_target(target).name
    return [
        n
        for n, k in dispatch.KERNELS.items()
        if k.kv_format in POOL_FEEDS
        and (n == dispatch.FALLBACK or (k.compile_args is not None
                                        and arch in tune.kernel_targets(n)))
    ]  # fmt: skip


def default_kernel_line(state: PanelState) -> str:
    """Which kernel ``sparse_mla_prefill(..., config=None)`` runs for the state's target, shape
    and the selected kernel's pool format, and why (:func:`sparse_mla.dispatch.describe`)."""
    from .. import dispatch

    arch = targets.get_target(state.target).name
    fmt = state.kv_format
    try:
        line = dispatch.describe(arch, state.num_heads, state.head_dim, kv_format=fmt)
    except Exception as e:  # a broken config file must not break the panel
        line = f"{arch}: unknown ({type(e).__name__}: {e})"
    pool = "" if fmt == "dense" else f" (with {dispatch.FORMATS[fmt]})"
    return f"config=None runs{pool}, on " + line


def default_kernel_map(
    state: PanelState,
    tokens: tuple[int, ...] | None = None,
    slots: tuple[int, ...] | None = None,
) -> str:
    """Which kernel ``config=None`` runs for the state's target, H, D and pool format at each
    token count (rows) and list length (columns, slots a token; default
    :data:`sparse_mla.dispatch.TABLE_TOKENS` and ``TABLE_SLOTS``):
    :func:`sparse_mla.dispatch.choice_table`, as ``sparse-mla which --table`` prints it."""
    from .. import dispatch

    arch = targets.get_target(state.target).name
    return dispatch.choice_table(arch, state.num_heads, state.head_dim, tokens, slots,
                                 kv_format=state.kv_format)  # fmt: skip


@dataclass(frozen=True)
class ErrorRun:
    """One small run of the kernel against the fp32 reference (and plain PyTorch in bf16)."""

    out: torch.Tensor
    ref: torch.Tensor
    baseline: torch.Tensor
    report: Any  # reference.ErrorReport
    device: str
    seconds: float


def error_run(
    state: PanelState, *, tokens: int = 2, slots: int = 64, pool: int = 256, seed: int = 0
) -> ErrorRun:
    """Run the kernel with ``state.config`` on random inputs (10% invalid slots, a sink) at
    [tokens, H, D]: on the GPU when there is one, else in Triton's interpreter. The pool is
    given in the kernel's format (:data:`POOL_FEEDS`: an FP8 kernel reads it quantized) and
    the fp32 reference reads the rows that format holds (the FP8 cache dequantized)."""
    from ..workloads import flashmla_uniform

    device = "cuda" if runtime.has_gpu() else "cpu"
    w = flashmla_uniform(
        tokens, state.num_heads, slots, pool, invalid_frac=0.1, D=state.head_dim, sink=True,
        seed=seed, device=device,
    )  # fmt: skip
    kv, rows = POOL_FEEDS[state.kv_format](w.kv)
    q, _, idx, indptr, scale = w.args()
    out = torch.full_like(q, float("nan"))  # an unwritten tile shows as NaN
    t0 = time.perf_counter()
    sparse_mla_prefill(q, kv, idx, indptr, scale, **w.kwargs(), out=out, config=state.run_config)
    seconds = time.perf_counter() - t0
    ref = sparse_mla_prefill_ref(q, rows, idx, indptr, scale, **w.kwargs())
    base = sparse_mla_prefill_ref(q, rows, idx, indptr, scale, **w.kwargs(), upcast=False)
    return ErrorRun(out.cpu(), ref.cpu(), base.cpu(), error_report(out, ref, base), device, seconds)


def _why_not_run(state: PanelState) -> str | None:
    """Why the panel does not run the state's kernel here (None: it runs it): what the kernel
    says of a call on this machine (CPU: Triton's interpreter, which runs the Triton kernels
    only), and a GPU of another arch than the kernel's targets."""
    from .. import dispatch, tune

    if state.kernel == dispatch.FALLBACK:
        return None
    k = dispatch.kernel(state.kernel)
    arch = runtime.arch() if runtime.has_gpu() else None
    call = dispatch.Call(arch, state.num_heads, state.head_dim, kv_format=k.kv_format)
    why = k.unavailable(call)
    if why and arch is None:
        return f"{state.kernel}: {why} (the CPU interpreter runs the Triton kernels only)"
    if why:
        return f"{state.kernel}: {why}"
    if arch is not None and arch not in tune.kernel_targets(state.kernel):
        return f"{state.kernel} runs on {', '.join(tune.kernel_targets(state.kernel))}; " \
            f"this GPU is {arch}"  # fmt: skip
    return None


def _time_on_gpu(state: PanelState) -> float:
    """Median ms of a DSv4 CSA call (T=4096, top-k 512 + window 128) with this config."""
    import triton.testing

    from ..workloads import dsv4_csa

    w = dsv4_csa(4096, state.num_heads, D=state.head_dim, device="cuda", big_buffer=True)
    kv = POOL_FEEDS[state.kv_format](w.kv)[0]
    q, _, idx, indptr, scale = w.args()
    out = torch.empty_like(q)
    fn = lambda: sparse_mla_prefill(q, kv, idx, indptr, scale, **w.kwargs(), out=out,  # noqa: E731
                                    config=state.run_config)  # fmt: skip
    fn()
    return float(triton.testing.do_bench(fn, return_mode="median"))


# The panel's states, each with its own colour and words. ``phase`` is one of these keys.
STATES: dict[str, tuple[str, str]] = {
    "idle": ("#555555", "idle"),
    "compiling": ("#0060c0", "working"),
    "ok": ("#007000", "ok"),
    "invalid": ("#b00000", "invalid setting"),
    "failed": ("#9c00a8", "compile failed"),
    "cannot-launch": ("#c25e00", "cannot launch"),
    "stale": ("#808080", "stale"),
}

# Views from an older setting are greyed until the current setting's result replaces them.
_STYLE = (
    "<style>.sml-explorer .sml-stale{opacity:.35;filter:grayscale(100%)}"
    ".sml-explorer .sml-stale::before{content:'stale: from the previous setting';"
    "display:block;font:italic 11px sans-serif;color:#808080}</style>"
)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # panels to mark stale when the process exits


@atexit.register
def _mark_panels_stale() -> None:
    for panel in list(_LIVE):
        with contextlib.suppress(Exception):  # the process is going away: never fail its exit
            panel.kernel_exiting()


def _set_image(image, png: bytes) -> None:
    """Show PNG bytes in an ipywidgets Image at the PNG's own width (at most the output's)."""
    image.width = str(png_size(png)[0])  # the height follows (aspect kept when scaled down)
    image.value = png


def _status(text: str, color: str = "#333") -> str:
    return f"<span class='sml-status' style='color:{color}'>{html.escape(text)}</span>"


def _state_html(phase: str, detail: str) -> str:
    color, words = STATES[phase]
    text = f"{words}: {detail}" if detail else words
    return (
        f"<span class='sml-status sml-state-{phase}' data-state='{phase}' "
        f"style='color:{color};font-weight:bold'>{html.escape(text)}</span>"
    )


class ExplorerPanel:
    """The constexpr explorer (module docstring). Display it with ``display(panel)`` or
    ``panel.widget``; read the latest results from ``result`` (a CompileResult), ``invalid``
    (why the current combination is invalid, or None), ``error`` (an ErrorRun) and
    ``time_ms``.

    Args:
        target: initial target name (``"local"`` is offered when a GPU is present).
        num_heads, head_dim: initial shape.
        kernel: initial kernel, a name of :data:`sparse_mla.dispatch.KERNELS` that compiles
            for ``target`` (:func:`kernels_for`); its launch is loaded as on a widget change.
        run_errors: run the kernel against fp32 after each compile.
        error_tokens, error_slots: size of that run (the interpreter costs ~30 ms per program
            per tile at D=512).
        time_gpu: time on the GPU (default: when a GPU is present).
    """

    def __init__(
        self,
        target: str = "gfx950",
        num_heads: int = 16,
        head_dim: int = 512,
        *,
        run_errors: bool = True,
        error_tokens: int = 2,
        error_slots: int = 64,
        time_gpu: bool | None = None,
        start: bool = True,
        kernel: str = "triton",
    ):
        import ipywidgets as W

        self.run_errors = run_errors
        self.error_tokens, self.error_slots = error_tokens, error_slots
        self.time_gpu = runtime.has_gpu() if time_gpu is None else time_gpu
        self.result: _inspect.CompileResult | None = None
        self.pinned: _inspect.CompileResult | None = None
        self.invalid: str | None = None
        self.failure: str | None = None  # one line: which pass failed, at which setting
        self.failure_log: str | None = None  # the file with the compiler's whole output
        self.phase = "idle"  # a key of STATES
        self.detail = ""
        self.error: ErrorRun | None = None
        self.time_ms: float | None = None
        self.dropped = 0  # results that arrived after a newer widget state
        self.in_compile = threading.Event()  # set while the worker is inside a compile
        self._gen = 0
        self._lock = threading.Lock()
        self._future: cf.Future | None = None
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sml-explorer")
        self._error_cache: dict[tuple, ErrorRun] = {}
        self._names: dict[Any, str] = {}  # compile key -> registered kernel name

        choices = list(NAMED_TARGETS) + (["local"] if runtime.has_gpu() else [])
        if target not in choices:
            raise ValueError(f"target must be one of {choices}, got {target!r}")
        if kernel not in kernels_for(target):
            raise ValueError(
                f"kernel must be one of {kernels_for(target)} on {target}, got {kernel!r}"
            )
        cfg = default_config(num_heads, head_dim)
        style = {"description_width": "88px"}

        # One Layout per widget: hiding a vendor-only control sets its layout.display, and a
        # shared Layout would hide every control that shares it.
        def lay():
            return W.Layout(width="220px")

        self.w_target = W.Dropdown(options=choices, value=target, description="target",
                                   style=style, layout=lay())  # fmt: skip
        self.w_heads = W.Dropdown(options=sorted({*HEADS, num_heads}), value=num_heads,
                                  description="H (heads)", style=style, layout=lay())  # fmt: skip
        self.w_dim = W.Dropdown(options=sorted({*HEAD_DIMS, head_dim}), value=head_dim,
                                description="D (head dim)", style=style, layout=lay())  # fmt: skip
        self.w_even = W.Checkbox(value=True, description="EVEN_HD", indent=False)
        self.w_exp2 = W.Checkbox(value=cfg.USE_EXP2, description="USE_EXP2", indent=False)
        self.w_prefetch = W.Checkbox(value=cfg.PREFETCH_KV, description="PREFETCH_KV",
                                     indent=False)  # fmt: skip
        self.w_block_h = W.Dropdown(options=[16, 32, 64, 128], value=cfg.BLOCK_H,
                                    description="BLOCK_H", style=style, layout=lay())  # fmt: skip
        self.w_block_k = W.Dropdown(options=[16, 32, 64, 128], value=cfg.BLOCK_K,
                                    description="BLOCK_K", style=style, layout=lay())  # fmt: skip
        self.w_warps = W.Dropdown(options=[1, 2, 4, 8, 16], value=cfg.num_warps,
                                  description="num_warps", style=style, layout=lay())  # fmt: skip
        self.w_stages = W.Dropdown(options=[1, 2, 3, 4], value=cfg.num_stages,
                                   description="num_stages", style=style, layout=lay())  # fmt: skip
        self.w_kpack = W.Dropdown(options=[1, 2], value=1, description="kpack", style=style,
                                  layout=lay())  # fmt: skip
        self.w_waves = W.Dropdown(options=list(range(0, 9)), value=0,
                                  description="waves_per_eu", style=style,
                                  layout=lay())  # fmt: skip
        self.w_maxnreg = W.Dropdown(options=[("off", 0)] + [(str(n), n) for n in MAXNREG],
                                    value=cfg.maxnreg or 0, description="maxnreg", style=style,
                                    layout=lay())  # fmt: skip
        self.w_kernel = W.Dropdown(options=kernels_for(target), value=kernel,
                                   description="kernel", style=style, layout=lay())  # fmt: skip
        self.w_kernel.add_class("sml-kernel")
        self.knob_widgets: dict[str, Any] = {}  # the knobs of a kernel without Triton's launch
        self.knob_box = W.VBox(layout=W.Layout(min_width="236px"))
        self.knob_box.add_class("sml-knobs")
        self._kernel_base: Any = None  # the launch the knob widgets were loaded from
        self.launch_origin = W.HTML()
        self.launch_origin.add_class("sml-launch-origin")
        self.w_pin = W.Button(description="pin as baseline", icon="thumb-tack",
                              tooltip="diff later variants against this compile")  # fmt: skip
        self.w_unpin = W.Button(description="unpin")
        self.progress = W.IntProgress(value=0, min=0, max=3, description="",
                                      layout=W.Layout(width="220px"))  # fmt: skip
        self.status = W.HTML(_state_html("idle", ""))
        self.resources = W.HTML()
        self.resources.add_class("sml-resources")
        # align_self: the chart keeps its own height instead of stretching to the table's.
        # Each image gets its PNG's own width in pixels (set_image): an <img> without a width
        # inside a flex box was drawn 0x0 until the next change; max_width 100% keeps it
        # inside the output area when that is narrower.
        self.mix_image = W.Image(
            format="png", layout=W.Layout(max_width="100%", align_self="flex-start")
        )
        self.occupancy_image = W.Image(
            format="png", layout=W.Layout(max_width="100%", align_self="flex-start")
        )
        self.isa = W.HTML()
        self.isa_search = W.Text(placeholder="search the ISA (regular expression)",
                                 layout=W.Layout(width="320px"))  # fmt: skip
        self.isa_scope = W.ToggleButtons(options=["whole kernel", "main loop"],
                                         value="whole kernel")  # fmt: skip
        self.isa_search.observe(lambda _: self._show_isa(), names="value")
        self.isa_scope.observe(lambda _: self._show_isa(), names="value")
        self.by_line_view = W.HTML()
        self.diff_view = W.HTML(_status("pin a compile to diff against it"))
        # Measured stalls per source line (Nsight Compute), on demand: a profile takes minutes.
        self.profile_button = W.Button(description="profile with ncu", icon="tachometer",
                                       tooltip="Nsight Compute: stall reasons per source line "
                                       "of the current kernel and launch on this GPU")  # fmt: skip
        self.profile_view = W.HTML()
        self.profile_view.add_class("sml-profile")
        # The profiled call's workload: T tokens of DSv4 CSA, after `context` cached tokens
        # (from 4 x top-k on, whole lists; sparse-mla profile --tokens / --context).
        self.profile_tokens = W.BoundedIntText(value=4096, min=1, max=1 << 20, description="T",
                                               layout=W.Layout(width="160px"))  # fmt: skip
        self.profile_context = W.BoundedIntText(value=0, min=0, max=1 << 24,
                                                description="context",
                                                layout=W.Layout(width="200px"))  # fmt: skip
        self.profile_button.on_click(lambda _: self.profile())
        self.profile_result = None
        self.error_image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.error_text = W.HTML()
        self.time_text = W.HTML()
        self.default_text = W.HTML()
        self.default_text.add_class("sml-default-kernel")
        if not runtime.has_gpu():  # nothing to time: no empty "no time" line
            self.time_text.layout.display = "none"
        self.views = [self.resources, self.mix_image, self.occupancy_image, self.isa,
                      self.by_line_view,
                      self.diff_view, self.error_text, self.error_image,
                      self.time_text]  # fmt: skip

        self.controls = [self.w_target, self.w_kernel, self.w_heads, self.w_dim, self.w_even,
                         self.w_exp2,
                         self.w_prefetch, self.w_block_h, self.w_block_k, self.w_warps,
                         self.w_stages, self.w_kpack, self.w_waves, self.w_maxnreg]  # fmt: skip
        for w in self.controls:
            w.observe(self._on_change, names="value")
        self.w_pin.on_click(lambda _: self.pin())
        self.w_unpin.on_click(lambda _: self.unpin())

        # Columns no narrower than their 220px controls (a flex box would shrink and clip them).
        left = W.VBox([self.w_target, self.w_kernel, self.w_heads, self.w_dim, self.w_block_h,
                       self.w_block_k], layout=W.Layout(min_width="236px"))  # fmt: skip
        mid = W.VBox([self.w_warps, self.w_stages, self.w_kpack, self.w_waves, self.w_maxnreg,
                      W.HBox([self.w_even, self.w_exp2])],
                     layout=W.Layout(min_width="236px"))  # fmt: skip
        right = W.VBox([self.w_prefetch, self.w_pin, self.w_unpin, self.progress, self.status])
        isa_box = W.VBox([W.HBox([self.isa_search, self.isa_scope]), self.isa])
        profile_box = W.VBox([W.HBox([self.profile_button, self.profile_tokens,
                                      self.profile_context]), self.profile_view])  # fmt: skip
        tabs = W.Tab(children=[isa_box, self.by_line_view, self.diff_view, profile_box])
        tabs.set_title(0, "ISA")
        tabs.set_title(1, "by source line")
        tabs.set_title(2, "diff vs pinned")
        tabs.set_title(3, "profile (ncu)")
        self.tabs = tabs
        self.widget = W.VBox([
            W.HTML(_STYLE),
            W.HBox([left, mid, self.knob_box, right]),
            self.launch_origin,
            W.HBox([self.resources, W.VBox([self.mix_image, self.occupancy_image],
                                           layout=W.Layout(min_width="0", flex="1 1 auto"))],
                   layout=W.Layout(flex_flow="row wrap", max_width="100%")),
            self.time_text,
            self.default_text,
            self.error_text,
            self.error_image,
            tabs,
        ])  # fmt: skip
        self.widget.add_class("sml-explorer")
        self._sync_visibility()
        self._loading = False
        self.load_tuned(update=False)
        self._profile_note()
        # Kernel > Restart stops this process: say so in the page before it goes (defect 3:
        # the old table stayed under a green "ok" while the widgets had no kernel behind them).
        _LIVE.add(self)
        if start:
            self.update()

    # -- state -----------------------------------------------------------------------------

    def state(self) -> PanelState:
        """The widgets' current values as a PanelState."""
        name = self.w_kernel.value
        if not uses_triton_controls(name):
            knobs = {f: w.value for f, w in self.knob_widgets.items()}
            launch = dataclasses.replace(self._kernel_base, **knobs)
            return PanelState(self.w_target.value, self.w_heads.value, self.w_dim.value, launch,
                              name)  # fmt: skip
        amd = targets.get_target(self.w_target.value).is_amd
        cfg = PrefillConfig(
            BLOCK_H=self.w_block_h.value,
            BLOCK_K=self.w_block_k.value,
            num_warps=self.w_warps.value,
            num_stages=self.w_stages.value,
            EVEN_HD=self.w_even.value,
            USE_EXP2=self.w_exp2.value,
            PREFETCH_KV=self.w_prefetch.value,
            kpack=self.w_kpack.value if amd else None,
            waves_per_eu=self.w_waves.value if amd else None,
            maxnreg=None if amd else (self.w_maxnreg.value or None),
        )
        return PanelState(self.w_target.value, self.w_heads.value, self.w_dim.value, cfg, name)

    def set(self, **values: Any) -> None:
        """Set several widgets at once with a single update, e.g. ``set(BLOCK_K=64,
        num_warps=8)``; keys are the widget descriptions."""
        first = {k: values[k] for k in ("target", "kernel") if k in values}
        with self._hold():
            for k, v in first.items():  # the kernel (and its knob widgets) before the knobs
                (self.w_target if k == "target" else self.w_kernel).value = v
        by_name = {w.description.split(" ")[0]: w for w in self.controls}
        by_name.update(H=self.w_heads, D=self.w_dim)
        if not uses_triton_controls(self.w_kernel.value):
            by_name.update(self.knob_widgets)
        unknown = sorted(set(values) - set(by_name))
        if unknown:
            raise ValueError(f"set: unknown control(s) {unknown}; expected {sorted(by_name)}")
        with self._hold():
            for k, v in values.items():
                w = by_name[k]
                if (
                    k not in first
                    and isinstance(getattr(w, "options", None), tuple)
                    and (v not in [o[1] if isinstance(o, tuple) else o for o in w.options])
                ):
                    w.options = [*w.options, v]  # a value the list lacks: offer it
                w.value = v
        self.update()

    def load_tuned(self, update: bool = True) -> str:
        """Set the knobs to the launch the selected kernel runs at the target and shape: the
        tuned entry (Triton), the launch recorded for the kernel (others), else its default.
        Called when the target, H, D or the kernel changes in the widgets; returns (and shows)
        where the launch came from."""
        from .. import tune

        name, target = self.w_kernel.value, self.w_target.value
        H, D = self.w_heads.value, self.w_dim.value
        try:
            launch, origin = tune.base_launch(name, target, H, D)
        except Exception as e:  # a broken config file must not break the panel
            launch, origin = None, f"not loaded ({type(e).__name__}: {e})"
        with self._hold():
            if uses_triton_controls(name) and launch is not None:
                even = launch_constexprs(H, D, torch.bfloat16, launch, has_sink=True)["EVEN_HD"]
                for w, v in ((self.w_block_h, launch.BLOCK_H), (self.w_block_k, launch.BLOCK_K),
                             (self.w_warps, launch.num_warps), (self.w_stages, launch.num_stages),
                             (self.w_even, even), (self.w_exp2, launch.USE_EXP2),
                             (self.w_prefetch, launch.PREFETCH_KV),
                             (self.w_kpack, launch.kpack or 1),
                             (self.w_waves, launch.waves_per_eu or 0),
                             (self.w_maxnreg, launch.maxnreg or 0)):  # fmt: skip
                    opts = getattr(w, "options", None)
                    if opts is not None and v not in [o[1] if isinstance(o, tuple) else o
                                                      for o in opts]:  # fmt: skip
                        w.options = [*opts, v]
                    w.value = v
            elif launch is not None:
                self._build_knobs(name, launch)
        self.launch_origin.value = (
            f"<div class='sml-launch-origin' style='color:#555;font-size:12px'>{html.escape(name)}"
            f" launch loaded from {html.escape(origin)}</div>"
        )
        if update:
            self.update()
        return origin

    def _build_knobs(self, name: str, launch: Any) -> None:
        """One widget per field of the kernel's launch: a checkbox for a flag, else a list of
        the registry's values for it (and the launch's own)."""
        import ipywidgets as W

        from .. import dispatch, tune

        allowed = dispatch.kernel(name).knobs
        widgets: dict[str, Any] = {}
        for f, kind in tune.knob_types(name).items():
            v = getattr(launch, f)
            if kind is bool:
                w = W.Checkbox(value=bool(v), description=f, indent=False)
            else:
                opts = sorted({*allowed.get(f, ()), v} - {None})
                w = W.Dropdown(options=opts, value=v, description=f,
                               style={"description_width": "110px"},
                               layout=W.Layout(width="220px"))  # fmt: skip
            w.add_class("sml-knob")
            w.observe(self._on_change, names="value")
            widgets[f] = w
        self.knob_widgets = widgets
        self._kernel_base = launch
        note = [] if widgets else [W.HTML(f"<i>{html.escape(name)} has no knobs yet</i>")]
        self.knob_box.children = tuple(widgets.values()) + tuple(note)

    def _hold(self):
        panel = self

        class _Hold:
            def __enter__(self):
                self.before = panel._held
                panel._held = True

            def __exit__(self, *exc):
                panel._held = self.before

        return _Hold()

    _held = False

    def _triton_controls(self) -> list:
        return [self.w_block_h, self.w_block_k, self.w_warps, self.w_stages, self.w_kpack,
                self.w_waves, self.w_maxnreg, self.w_even, self.w_exp2,
                self.w_prefetch]  # fmt: skip

    def _sync_visibility(self) -> None:
        triton = uses_triton_controls(self.w_kernel.value)
        amd = targets.get_target(self.w_target.value).is_amd
        for w in self._triton_controls():
            w.layout.display = None if triton else "none"
        for w in (self.w_kpack, self.w_waves):
            w.layout.display = None if amd and triton else "none"
        self.w_maxnreg.layout.display = "none" if amd or not triton else None
        self.knob_box.layout.display = "none" if triton else None

    def _on_change(self, change) -> None:
        owner = change["owner"]
        if owner is self.w_target:
            offered = kernels_for(self.w_target.value)
            with self._hold():
                keep = self.w_kernel.value if self.w_kernel.value in offered else "triton"
                self.w_kernel.options = offered
                self.w_kernel.value = keep
        if owner is self.w_kernel and not uses_triton_controls(self.w_kernel.value):
            from .. import tune

            launch, _ = tune.base_launch(self.w_kernel.value, self.w_target.value,
                                         self.w_heads.value, self.w_dim.value)  # fmt: skip
            self._build_knobs(self.w_kernel.value, launch)
        if owner in (self.w_target, self.w_kernel):
            self._sync_visibility()
        if not self._held:
            if owner in (self.w_target, self.w_kernel, self.w_heads, self.w_dim):
                self.load_tuned(update=False)  # the shape's tuned launch (issue 23, defect 6)
            self.update()

    # -- running -----------------------------------------------------------------------------

    def update(self, wait: bool = False, timeout: float = 600.0) -> cf.Future | None:
        """Recompile for the widgets' state in the worker thread (``wait``: block until done)."""
        state = self.state()
        with self._lock:
            self._gen += 1
            gen = self._gen
        self.default_text.value = (
            f"<div class='sml-default'>{html.escape(default_kernel_line(state))}"
            "<details><summary>by token count and list length</summary><pre>"
            f"{html.escape(default_kernel_map(state))}</pre></details></div>"
        )
        self.invalid = check_state(state)
        self.failure = self.failure_log = None
        if self.invalid is not None:
            self.result = None
            self.error = None
            self.time_ms = None
            self._future = None
            self.progress.value = 0
            self.progress.bar_style = "danger"
            self._clear_views()
            self._set_phase("invalid", self.invalid)
            self.resources.value = (
                "<div class='sml-invalid' style='color:#b00000;max-width:520px'><b>Invalid "
                f"setting.</b> {html.escape(self.invalid)}</div>"
            )
            return None
        self.progress.value = 0
        self.progress.bar_style = "info"
        self._grey_views()
        self._set_phase("compiling", f"compiling for {state.target} ...")
        self._future = self._executor.submit(self._job, gen, state)
        if wait:
            self.wait(timeout)
        return self._future

    # -- states and views ------------------------------------------------------------------

    def _set_phase(self, phase: str, detail: str = "") -> None:
        self.phase, self.detail = phase, detail
        self.status.value = _state_html(phase, detail)

    def status_text(self) -> str:
        """The panel's state in plain words (what the coloured status line says)."""
        words = STATES[self.phase][1]
        return f"{words}: {self.detail}" if self.detail else words

    def _grey_views(self) -> None:
        """Mark every view that shows something as stale (from the previous setting)."""
        for v in self.views:
            shown = bool(v.value) and v.layout.display != "none"
            if shown:
                v.add_class("sml-stale")

    def _fresh(self, *views) -> None:
        for v in views:
            v.remove_class("sml-stale")
            if v is not self.time_text or runtime.has_gpu():
                v.layout.display = None

    def _clear_views(self) -> None:
        """Empty every view: nothing of an older setting stays on screen (images are hidden,
        not emptied, so the browser shows no broken-image icon)."""
        for v in self.views:
            v.remove_class("sml-stale")
            if v in (self.mix_image, self.occupancy_image, self.error_image):
                v.layout.display = "none"
                v.value = b""
            else:
                v.value = ""
        self.diff_view.value = _status("pin a compile to diff against it")

    def wait(self, timeout: float = 600.0) -> None:
        """Block until the latest update has finished (re-raises a bug in the panel itself)."""
        fut = self._future
        if fut is not None:
            fut.result(timeout=timeout)

    def _current(self, gen: int) -> bool:
        with self._lock:
            current = gen == self._gen
        if not current:
            self.dropped += 1
        return current

    def _job(self, gen: int, state: PanelState) -> None:
        if not self._current(gen):
            return
        try:
            self._run(gen, state)
        except Exception as e:  # a bug in the panel: say so, keep the older views greyed
            if self._current(gen):
                self._set_phase(
                    "stale", f"the run for this setting stopped ({type(e).__name__}: {e}); "
                    "the greyed views are from an older setting"
                )  # fmt: skip
            raise

    def _run(self, gen: int, state: PanelState) -> None:
        try:
            # compile_prefill captures the compiler's output per call (a failed pass's MLIR
            # reproducer, ptxas's PTX dump) and keeps it in a file named by the failure.
            self.in_compile.set()
            if state.kernel == "triton":
                res = _inspect.compile_prefill(
                    state.target, state.config, num_heads=state.num_heads,
                    head_dim=state.head_dim, dtype="bf16", has_sink=True,
                )  # fmt: skip
            else:
                res = _inspect.compile_kernel(
                    state.kernel, state.target, num_heads=state.num_heads,
                    head_dim=state.head_dim, config=state.config,
                )[1]  # fmt: skip
            failure = None
        except Exception as e:  # a compiler failure is a result to show, not a crash
            res, failure = None, e
        finally:
            self.in_compile.clear()
        if not self._current(gen):
            return
        if res is None:
            self._show_failure(failure)
            return
        self.result = res
        self._names[res.key] = state.kernel
        self._show_compile(state, res)
        self.progress.value = 1
        how = (
            f"from the in-memory cache (first compile took {res.compile_seconds:.2f} s)"
            if res.from_cache
            else f"compiled in {res.compile_seconds:.2f} s"
        )

        if res.resources.occupancy == 0:
            self._show_cannot_launch(state, res)
            return

        self.error = None
        no_run = _why_not_run(state)
        if self.run_errors and no_run:
            self._show_not_run(no_run)
        elif self.run_errors:
            self._set_phase("compiling", "running the kernel against fp32 ...")
            if state.kernel == "triton":
                key = (state.num_heads, state.head_dim, *launch_constexprs(
                    state.num_heads, state.head_dim, torch.bfloat16, state.config, has_sink=True
                ).items())  # fmt: skip
            else:
                key = (state.kernel, state.num_heads, state.head_dim, repr(state.config))
            run = self._error_cache.get(key)
            if run is None:
                run = error_run(state, tokens=self.error_tokens, slots=self.error_slots)
                self._error_cache[key] = run
            if not self._current(gen):
                return
            self.error = run
            self._show_error(run, state)
        else:
            self.error_text.value, self.error_image.value = "", b""
            self.error_image.layout.display = "none"
        self.progress.value = 2

        self.time_ms = None
        if self.time_gpu and state.target == "local" and not no_run:
            self._set_phase("compiling", "timing on the GPU ...")
            ms = _time_on_gpu(state)
            if not self._current(gen):
                return
            self.time_ms = ms
        self._show_time(state)
        self.progress.value = 3
        self.progress.bar_style = "success"
        self._set_phase("ok", f"{state.target}, {how}")

    def _show_not_run(self, why: str) -> None:
        self.error_image.remove_class("sml-stale")
        self.error_image.layout.display = "none"
        self.error_image.value = b""
        self.error_text.value = (
            f"<div class='sml-error' style='color:#555'>error vs fp32: not run: "
            f"{html.escape(why)}</div>"
        )
        self._fresh(self.error_text)

    def _show_failure(self, e: BaseException | None) -> None:
        self.result = None
        self.error = None
        self.time_ms = None
        self.failure = _inspect.failure_reason(e, limit=2000) if e is not None else "unknown"
        log = getattr(e, "log_path", None)
        self.failure_log = str(log) if log else None
        self.progress.bar_style = "danger"
        self._clear_views()
        self._set_phase("failed", self.failure.split("; setting ")[0])
        keep = (
            f"<br>Compiler output and reproducer: <code class='sml-failure-log'>"
            f"{html.escape(self.failure_log)}</code>"
            if self.failure_log
            else ""
        )
        self.resources.value = (
            f"<div class='sml-failed' style='color:{STATES['failed'][0]};max-width:900px'>"
            f"<b>Compile failed.</b> {html.escape(self.failure)}{keep}</div>"
        )

    def _show_cannot_launch(self, state: PanelState, res: _inspect.CompileResult) -> None:
        r = res.resources
        why = r.next_step or "occupancy 0"
        self.error = None
        self.time_ms = None
        for v in (self.error_text, self.time_text):
            v.remove_class("sml-stale")
        self.error_image.remove_class("sml-stale")
        self.error_image.layout.display = "none"
        self.error_image.value = b""
        self.error_text.value = (
            "<div class='sml-error' style='color:#c25e00'>error vs fp32: not run, this config "
            "cannot launch</div>"
        )
        self.time_text.value = ""
        self.progress.bar_style = "warning"
        self._set_phase(
            "cannot-launch", f"{state.target}: {why} (occupancy {r.occupancy} "
            f"{res.target.occupancy_unit}: {r.limits_text()})"
        )  # fmt: skip

    # -- views -------------------------------------------------------------------------------

    def resource_rows(self) -> list[tuple[str, Any, Any]]:
        """(name, current, pinned) rows of the resource table."""
        res = self.result
        if res is None:
            return []
        pin = self.pinned if (self.pinned and self.pinned.target.backend == res.target.backend) \
            else None  # fmt: skip

        def rows(r: _inspect.CompileResult) -> list[tuple[str, Any]]:
            c = r.constexprs
            keys = ("BLOCK_H", "BLOCK_K", "BLOCK_D", "EVEN_HD", "USE_EXP2", "PREFETCH_KV")
            if not all(k in c for k in keys):  # another kernel: its plain constexprs
                keys = tuple(k for k, v in c.items() if isinstance(v, (bool, int, str)))
            name = self._names.get(r.key)
            out = [("target", r.target.name),
                   ("kernel", f"{name} ({r.kernel_name})" if name else r.kernel_name),
                   ("constexprs", " ".join(f"{k}={c[k]}" for k in keys)),
                   ("options", " ".join(f"{k}={v}" for k, v in r.options.items()))]  # fmt: skip
            out += list(r.resources.as_rows())
            out += [("occupancy", f"{r.resources.occupancy} {r.target.occupancy_unit}"),
                    ("spill bytes", r.resources.spill_bytes),
                    ("instructions", r.mix.get("total"))]  # fmt: skip
            return out

        cur = rows(res)
        old = dict(rows(pin)) if pin else {}
        return [(k, v, old.get(k) if pin else None) for k, v in cur]

    def _show_compile(self, state: PanelState, res: _inspect.CompileResult) -> None:
        pin = self.pinned is not None and self.pinned.target.backend == res.target.backend
        header = ["resource", "current", "pinned"] if pin else ["resource", "value"]
        rows = [r if pin else r[:2] for r in self.resource_rows()]
        self.resources.value = html_table(rows, header, cls="sml-resource-table")
        base = self.pinned.mix if pin else None
        _set_image(self.mix_image, to_png(mix_figure(res.mix, base)))
        _set_image(self.occupancy_image,
                   to_png(occupancy_figure(res, self.pinned if pin else None)))  # fmt: skip
        self._fresh(self.resources, self.mix_image, self.occupancy_image, self.isa,
                    self.by_line_view, self.diff_view)  # fmt: skip
        self._show_isa()
        self._show_by_line()
        self._show_diff()

    def _show_isa(self) -> None:
        """The ISA view: the whole kernel or the main loop's body, filtered by the search."""
        res = self.result
        if res is None:
            return
        kind = "SASS" if res.target.backend == "cuda" else "AMDGCN"
        if self.isa_scope.value == "main loop":
            lm = _inspect.by_line(res)
            if lm.loop is None:
                lines, what = [], "main loop: none found"
            else:
                lines = [
                    (f"{t}:" if k == "label" else f"    {t}") + (f"   ; {f}:{n}" if n else "")
                    for i, (k, t, (f, n), _) in enumerate(lm.listing)
                    if i in lm.loop.indices or (k == "label" and t == lm.loop.label)
                ]
                what = f"main loop body (label {lm.loop.label}), {lm.loop.mix['total']} instrs"
        else:
            lines, what = res.isa.splitlines(), f"{len(res.isa.splitlines())} lines"
        pattern = self.isa_search.value.strip()
        if pattern:
            try:
                rx = re.compile(pattern, re.IGNORECASE)
            except re.error as e:
                self.isa.value = _status(f"search: not a regular expression ({e})", "#b00")
                return
            hits = [f"{i + 1:5d}  {ln}" for i, ln in enumerate(lines) if rx.search(ln)]
            what += f"; {len(hits)} lines match {pattern!r}"
            lines = hits
        self.isa.value = (
            f"<div class='sml-isa-header'>{kind} for {html.escape(res.label)}: "
            f"{html.escape(what)}</div>" + pre_block("\n".join(lines), cls="sml-isa")
        )

    def _show_by_line(self) -> None:
        """Per kernel source line: instructions, matrix ops, loads, stores, exp2, spills and how
        many sit in the main loop; the hotter the line, the darker its row."""
        res = self.result
        if res is None:
            return
        lm = _inspect.by_line(res)
        header, rows = _inspect.by_line_rows(lm)
        top = max((r[1] for r in rows), default=1) or 1
        cells = "".join(f"<th style='text-align:left;padding:1px 6px'>{html.escape(h)}</th>"
                        for h in header)  # fmt: skip
        body = []
        for r in rows:
            shade = int(255 - 120 * r[1] / top)
            tds = "".join(f"<td style='padding:1px 6px;white-space:pre'>{html.escape(str(v))}</td>"
                          for v in r)  # fmt: skip
            body.append(f"<tr style='background:rgb(255,{shade},{shade})'>{tds}</tr>")
        table = (
            "<table class='sml-by-line' style='border-collapse:collapse;font-family:monospace;"
            f"font-size:11px'><tr>{cells}</tr>{''.join(body)}</table>"
        )
        self.by_line_view.value = (
            pre_block(_inspect.loop_table(res), cls="sml-loop-mix", max_height="16em")
            + f"<div style='max-height:30em;overflow:auto'>{table}</div>"
        )

    def _show_diff(self) -> None:
        res, pin = self.result, self.pinned
        if pin is None or res is None:
            self.diff_view.value = _status("pin a compile to diff against it")
            return
        if pin.target.backend != res.target.backend:
            self.diff_view.value = _status(
                f"pinned {pin.target.name} and current {res.target.name} are different backends"
            )
            return
        d = _inspect.diff(pin, res)
        by_line = _inspect.diff_by_line(pin, res)
        n_lines = len(d.isa_diff.splitlines())
        caption = f"instructions by source line: {len(by_line)} lines changed (largest first)"
        header = ["source line", "a", "b", "change", "source"]
        raw = pre_block(
            d.isa_diff or "(ISA identical after normalising)", cls="sml-diff", max_height="30em"
        )
        self.diff_view.value = (
            f"<div>a = pinned: {html.escape(pin.label)}<br>b = current: "
            f"{html.escape(res.label)}</div>"
            + pre_block(d.summary(), cls="sml-diff-summary", max_height="20em")
            # The change column within the tab's width: the source cut to 48 characters.
            + html_table(
                [[*r[:4], r[4][:48]] for r in by_line[:40]],
                header,
                cls="sml-diff-by-line",
                caption=caption,
            )
            + f"<details><summary>normalised ISA diff ({n_lines} lines)</summary>{raw}</details>"
        )

    def _show_error(self, run: ErrorRun, state: PanelState) -> None:
        r = run.report
        color = "#070" if r.ok else "#b00"
        where = "Triton interpreter (CPU)" if run.device == "cpu" else run.device
        self.error_text.value = (
            f"<div class='sml-error' style='color:{color}'>error vs fp32, {tuple(run.out.shape)} "
            f"on {html.escape(where)} ({run.seconds:.2f} s): {html.escape(str(r))}</div>"
        )
        title = f"error against fp32 of {state.label()}"
        _set_image(self.error_image,
                   to_png(error_figure(run.out, run.ref, run.baseline, title=title)))  # fmt: skip
        self._fresh(self.error_text, self.error_image)

    def _show_time(self, state: PanelState) -> None:
        if self.time_ms is not None:
            text = (f"time on {html.escape(runtime.device_name())}: {self.time_ms:.3f} ms "
                    f"(DSv4 CSA, T=4096, H={state.num_heads}, top-k 512 + window 128)")  # fmt: skip
        elif not runtime.has_gpu():
            text = "time: no GPU on this machine (compile and interpreter results only)"
        else:
            text = "time: pick target 'local' to time on this machine's GPU"
        self.time_text.value = f"<div class='sml-time'>{text}</div>"
        self._fresh(self.time_text)

    # -- profile (Nsight Compute) ---------------------------------------------------------

    def _profile_note(self) -> None:
        from .. import profile as prof

        why = prof.unavailable()
        self.profile_button.disabled = why is not None
        self.profile_view.value = _status(
            f"profile: {why}" if why else "profile: runs the current kernel and launch once on "
            "this GPU under Nsight Compute (target 'local'; about a minute)"
        )  # fmt: skip

    def profile(self, num_tokens: int | None = None, context: int | None = None) -> None:
        """Profile the current kernel and launch on this GPU through Nsight Compute: the
        kernel's stall reasons and the source lines with the most stall samples (blocks; the
        tab says why when ncu or a GPU is missing). ``num_tokens`` / ``context``: the DSv4 CSA
        workload's T and the tokens cached before it (``sparse-mla profile --context``: from
        4 x top-k on, whole lists; None: the tab's T and context boxes)."""
        from .. import profile as prof

        num_tokens = self.profile_tokens.value if num_tokens is None else num_tokens
        context = self.profile_context.value if context is None else context

        why = prof.unavailable()
        if why:
            self.profile_view.value = _status(f"profile: {why}", "#b00")
            return
        state = self.state()
        if state.target != "local":
            self.profile_view.value = _status("profile: pick target 'local' (this GPU)", "#b00")
            return
        self.profile_view.value = _status("profiling under ncu ...", STATES["compiling"][0])
        try:
            p = prof.profile(state.kernel, state.num_heads, state.head_dim,
                             launch=state.config, num_tokens=num_tokens,
                             context=context)  # fmt: skip
        except Exception as e:  # ncu's failure is a result to show
            self.profile_view.value = _status(f"profile failed: {e}", "#b00")
            return
        self.profile_result = p
        self.profile_view.value = pre_block(prof.profile_table(p), cls="sml-profile-table",
                                            max_height="40em")  # fmt: skip

    # -- pinning -----------------------------------------------------------------------------

    def pin(self) -> None:
        """Keep the current compile as the baseline for the diff and the table's second column."""
        if self.result is None:
            self.diff_view.value = _status("nothing compiled to pin", "#b00")
            return
        self.pinned = self.result
        self._show_compile(self.state(), self.result)

    def unpin(self) -> None:
        self.pinned = None
        if self.result is not None:
            self._show_compile(self.state(), self.result)
        else:
            self._show_diff()

    def kernel_exiting(self) -> None:
        """Mark every view stale: the Python process behind the widgets is stopping (a kernel
        restart or shutdown), so a widget change will not recompile anything."""
        with self._lock:
            self._gen += 1
        self._grey_views()
        self.progress.bar_style = ""
        self._set_phase("stale", "the kernel stopped (restarted?): these views are from before; "
                        "run the notebook's cells again for a live panel")  # fmt: skip

    def close(self) -> None:
        """Stop the worker thread (pending results are dropped)."""
        with self._lock:
            self._gen += 1
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._grey_views()
        self._set_phase("stale", "panel closed; the views are from its last setting")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return f"ExplorerPanel({self.state().label()})"

    def with_config(self, **changes: Any) -> PanelState:
        """The current state with config fields replaced (no widget change)."""
        s = self.state()
        return replace(s, config=replace(s.config, **changes))
