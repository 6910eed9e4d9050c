"""The one algorithm of the Gluon MLA kernel, shared by MLA decode and DSv4 sparse prefill.

One program owns one row (a decode request or a prefill token), a block of BLOCK_H heads and one
KV split. It walks the row's CSR slot list BLOCK_K slots at a time, double-buffered:

    load slot ids -> async gather of the KV rows into shared memory (next tile in flight while
    this one computes) -> S = Q K^T (+ Q_pe K_pe^T in decode) -> online softmax (base 2) -> O += P V

Q stays in shared memory and is read in HEAD_DIM/DK chunks for S, so registers hold the fp32
accumulator, one chunk of each operand and the softmax state. Invalid slots (s < 0 or s >= N)
are masked in the gather (never read), get -inf logits, and their V rows are zeroed in registers
so uninitialised shared memory cannot reach the output. With one split the epilogue adds the
sink, normalises and stores (a row with no valid slot stores zeros); with several splits it
stores the split's normalised partial output and base-2 LSE, and then either the last split of
the (row, head block) to arrive combines them in the same launch (``FUSED_REDUCE``: an arrival
counter per (row, head block), zero at rest) or ``_mla_reduce_kernel`` does, a second launch.

Arch pieces come from ``cdna4.py`` / ``hopper.py`` (``ARCH`` constexpr); layouts arrive as
constexprs built on the host for the target (``launch.py``), so this file names no hardware.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import _consts
from . import cdna4, hopper

LOG2E = gl.constexpr(_consts.LOG2E)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _gather(smem, base_ptr, row_off, valid, offs_c, ARCH: gl.constexpr, USE_BUFFER: gl.constexpr):
    if ARCH == "cdna4":
        cdna4.gather_rows(smem, base_ptr, row_off, valid, offs_c, USE_BUFFER)
    else:
        hopper.gather_rows(smem, base_ptr, row_off, valid, offs_c, USE_BUFFER)


@gluon.jit
def _commit(ARCH: gl.constexpr):
    if ARCH == "cdna4":
        cdna4.commit()
    else:
        hopper.commit()


@gluon.jit
def _wait(num_outstanding: gl.constexpr, ARCH: gl.constexpr):
    if ARCH == "cdna4":
        cdna4.wait(num_outstanding)
    else:
        hopper.wait(num_outstanding)


@gluon.jit
def _mma(a, b, acc, ARCH: gl.constexpr):
    if ARCH == "cdna4":
        return cdna4.mma(a, b, acc)
    else:
        return hopper.mma(a, b, acc)


@gluon.jit
def _issue_tile(
    kv_smem,
    pe_smem,
    kv_ptr,
    kpe_ptr,
    slot,
    valid,
    stride_kvn,
    stride_kpen,
    offs_d,
    offs_pe,
    ARCH: gl.constexpr,
    USE_BUFFER: gl.constexpr,
    HAS_PE: gl.constexpr,
    GATHER_PE: gl.constexpr,
):
    _gather(kv_smem, kv_ptr, slot * stride_kvn, valid, offs_d, ARCH, USE_BUFFER)
    if HAS_PE:
        slot_pe = gl.convert_layout(slot, gl.SliceLayout(1, GATHER_PE))
        valid_pe = gl.convert_layout(valid, gl.SliceLayout(1, GATHER_PE))
        _gather(pe_smem, kpe_ptr, slot_pe * stride_kpen, valid_pe, offs_pe, ARCH, USE_BUFFER)
    _commit(ARCH)


@gluon.jit
def _split_range(indptr_ptr, nnz, pid_r, pid_s, NUM_SPLITS: gl.constexpr, BLOCK_K: gl.constexpr):
    """This split's slot range [lo, hi) of row pid_r's CSR list (int64 positions; splits take
    whole tiles) and its number of BLOCK_K tiles. The row's range is clamped to [0, nnz]
    (``nnz`` = kv_indices.numel()), so no kv_indptr, checked or not, reads outside kv_indices:
    a decreasing pair or a range past nnz leaves the row the in-bounds part of its list."""
    start = gl.load(indptr_ptr + pid_r).to(gl.int64)
    end = gl.load(indptr_ptr + pid_r + 1).to(gl.int64)
    start = gl.minimum(gl.maximum(start, 0), nnz)
    end = gl.minimum(gl.maximum(end, start), nnz)
    chunk = gl.cdiv(gl.cdiv(end - start, NUM_SPLITS), BLOCK_K) * BLOCK_K
    lo = start + pid_s * chunk
    hi = gl.minimum(end, lo + chunk)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_K).to(gl.int32)
    return lo, hi, num_tiles


@gluon.jit
def _softmax_step(qk, m_i, l_i):
    """One tile of the online softmax in base 2: ``qk`` holds scaled logits (-inf where
    masked); returns the tile's probabilities p, the rescale factor alpha for the running
    output, and the new running max and denominator."""
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    # A head with no valid slot yet keeps m = -inf: shift by 0 so exp2 sees -inf, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _epilogue(
    acc, m_i, l_i, pid_r, pid_h, pid_s, sink_ptr, out_ptr, lse_ptr, opart_ptr, lsepart_ptr,
    stride_or, stride_oh, num_heads, count_ptr,
    BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, HAS_SINK: gl.constexpr,
    NUM_SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
    ROW_S: gl.constexpr, ROW_O: gl.constexpr, COL_O: gl.constexpr,
    FUSED_REDUCE: gl.constexpr, RED: gl.constexpr, COMBINERS: gl.constexpr,
):  # fmt: skip
    """The end of every forward kernel, after the last tile: fold in the sink, normalise, store
    the output (and LSE), or with NUM_SPLITS > 1 store this split's normalised partial output
    and base-2 LSE for the reduce step. ``m_i``/``l_i`` are per-head (layout ROW_S, base 2),
    ``acc`` the unnormalised [BLOCK_H, HEAD_DIM] output (rows ROW_O, columns COL_O).

    ``FUSED_REDUCE`` (NUM_SPLITS > 1): the reduce step runs here, in the program of the split
    that arrives last at its (row, head block): every warp's partial stores are issued
    (barrier), then one thread's acq_rel atomic add at GPU scope on the (row, head block)'s
    counter in ``count_ptr`` releases them and tells whether this split is the last; that
    program sets the counter back to 0 (zero at rest: the next launch may use the same
    counters) and combines the partials (layout ``RED``), loading them past L1 (``.cg``: a
    line of another head block's LSE partials may sit there from before they were written).
    With ``COMBINERS`` > 0 the split only arrives (release); the launch's combiner programs
    (:func:`_combiner`) wait for the count and combine the head block in COMBINERS parts."""
    offs_h = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
    h_ok = offs_h < num_heads
    offs_ho = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    offs_do = gl.arange(0, HEAD_DIM, layout=COL_O)
    o_mask = (offs_ho < num_heads)[:, None]
    if NUM_SPLITS == 1:
        m_fin = m_i
        if HAS_SINK:
            # The sink: a virtual column with logit sink_h and a zero value vector.
            sink = gl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * LOG2E
            m_fin = gl.where(m_i > float("-inf"), gl.maximum(m_i, sink), sink)
            # An empty row with a sink of -inf (or one that overflows to -inf once scaled)
            # keeps m = -inf: shift by 0 so alpha is 0, not exp2(-inf + inf) = NaN.
            m_fin = gl.where(m_fin == float("-inf"), 0.0, m_fin)
            alpha = gl.exp2(m_i - m_fin)
            l_i = l_i * alpha + gl.exp2(sink - m_fin)
            # An empty row's acc is 0 and stays 0 whatever the sink (a NaN sink: alpha NaN).
            alpha = gl.where(m_i > float("-inf"), alpha, 0.0)
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        # A row with no valid slot has acc == 0: keep it 0 (not 0/0), with or without a sink.
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        o = acc / gl.convert_layout(l_safe, ROW_O)[:, None]
        o_ptrs = out_ptr + pid_r * stride_or + offs_ho[:, None] * stride_oh + offs_do[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            lse = gl.where(l_i > 0.0, (m_fin + gl.log2(l_safe)) * LN2, float("-inf"))
            gl.store(lse_ptr + pid_r * num_heads + offs_h, lse, mask=h_ok)
    else:
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        o = acc / gl.convert_layout(l_safe, ROW_O)[:, None]
        part = pid_r * NUM_SPLITS + pid_s  # int64
        o_ptrs = opart_ptr + (part * num_heads + offs_ho[:, None]) * HEAD_DIM + offs_do[None, :]
        gl.store(o_ptrs, o, mask=o_mask)
        lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(lsepart_ptr + part * num_heads + offs_h, lse2, mask=h_ok)
        if FUSED_REDUCE:
            gl.thread_barrier()  # every warp's partial stores issued before the arrival
            counter = count_ptr + pid_r * gl.cdiv(num_heads, BLOCK_H) + pid_h
            if COMBINERS > 0:
                gl.atomic_add(counter, 1, sem="release", scope="gpu")
            else:
                arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == NUM_SPLITS - 1:
                    gl.store(counter, 0)
                    _combine(
                        opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lse_ptr, pid_r,
                        pid_h * BLOCK_H, stride_or, stride_oh, num_heads, BLOCK_H, HEAD_DIM, 128,
                        NUM_SPLITS, HAS_SINK, WRITE_LSE, RED, ".cg",
                    )  # fmt: skip


@gluon.jit
def _ticket(count_ptr, groups, num_programs):
    """This program's work ticket, in the order programs start: one relaxed atomic add on the
    ticket counter (``count_ptr[groups]``, after the (row, head block) counters). The program
    that draws the last ticket sets it back to 0: every other program has drawn its own by then,
    and the next launch on the stream starts after this one ends (zero at rest)."""
    t = gl.atomic_add(count_ptr + groups, 1, sem="relaxed", scope="gpu")
    if t == num_programs - 1:
        gl.store(count_ptr + groups, 0)
    return t


@gluon.jit
def _split_ticket(count_ptr, NUM_SPLITS: gl.constexpr, COMBINERS: gl.constexpr):
    """What a program of a split launch with combiners (a 1-D grid of groups x (NUM_SPLITS +
    COMBINERS) programs, one group per (row, head block)) does, by its :func:`_ticket`: the
    first groups x NUM_SPLITS tickets are split programs, of group ``ticket % groups`` and split
    ``ticket // groups``; the rest are combiners, numbered from 0 (:func:`_combiner`). Returns
    (groups, group, split, work: a split program, combiner number)."""
    groups = gl.num_programs(0) // (NUM_SPLITS + COMBINERS)
    ticket = _ticket(count_ptr, groups, gl.num_programs(0))
    first = groups * NUM_SPLITS
    return groups, ticket % groups, ticket // groups, ticket < first, ticket - first


@gluon.jit
def _combiner(
    c, groups, rows, count_ptr, opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lse_ptr, stride_or,
    stride_oh, num_heads, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_SPLITS: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
    RED: gl.constexpr, COMBINERS: gl.constexpr, ROW_FASTEST: gl.constexpr,
):  # fmt: skip
    """Combiner program ``c`` of a split launch with COMBINERS > 0: part ``c % COMBINERS`` (of
    BLOCK_H / COMBINERS heads) of (row, head block) group ``c // COMBINERS``. It drew its ticket
    after every split program had drawn one (:func:`_ticket`), so the splits it waits for are
    running, whatever else holds the GPU: it polls the group's counter (acquire) until all
    NUM_SPLITS have arrived, combines its heads' partials (``.cg``), then arrives itself; the
    group's last combiner to arrive sets the counter back to 0. ``ROW_FASTEST``: the group
    index is row + rows x head block (else head block + blocks x row), as the splits number
    them."""
    g = c // COMBINERS
    part = c % COMBINERS
    num_hb = gl.cdiv(num_heads, BLOCK_H)
    if ROW_FASTEST:
        pid_r = (g % rows).to(gl.int64)
        pid_h = g // rows
    else:
        pid_r = (g // num_hb).to(gl.int64)
        pid_h = g % num_hb
    counter = count_ptr + pid_r * num_hb + pid_h
    seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < NUM_SPLITS:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    SUB: gl.constexpr = BLOCK_H // COMBINERS
    _combine(
        opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lse_ptr, pid_r, pid_h * BLOCK_H + part * SUB,
        stride_or, stride_oh, num_heads, SUB, HEAD_DIM, 128, NUM_SPLITS, HAS_SINK, WRITE_LSE,
        RED, ".cg",
    )  # fmt: skip
    gl.thread_barrier()  # every warp's loads of the partials done before the arrival
    done = gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
    if done == NUM_SPLITS + COMBINERS - 1:
        gl.store(counter, 0)


@gluon.jit(do_not_specialize=["nnz"])
def _mla_fwd_kernel(
    q_ptr,  # [R, H, HEAD_DIM]
    qpe_ptr,  # [R, H, PE_DIM] (unused without HAS_PE)
    kv_ptr,  # [N, HEAD_DIM]
    kpe_ptr,  # [N, PE_DIM] (unused without HAS_PE)
    idx_ptr,  # [nnz] int32 | int64
    indptr_ptr,  # [R + 1]
    sink_ptr,  # [H] fp32 (unused without HAS_SINK)
    out_ptr,  # [R, H, HEAD_DIM]
    lse_ptr,  # [R, H] fp32 (written under WRITE_LSE)
    opart_ptr,  # [R, NUM_SPLITS, H, HEAD_DIM] fp32 (NUM_SPLITS > 1)
    lsepart_ptr,  # [R, NUM_SPLITS, H] fp32, base-2 (NUM_SPLITS > 1)
    count_ptr,  # [R * cdiv(H, BLOCK_H)] int32, zero at rest (FUSED_REDUCE)
    stride_qr,
    stride_qh,
    stride_qper,
    stride_qpeh,
    stride_kvn,
    stride_kpen,
    stride_or,
    stride_oh,
    num_heads,
    num_kv,
    nnz,  # kv_indices.numel(): each row's CSR range is clamped to [0, nnz]
    qk_scale,  # sm_scale * log2(e)
    ARCH: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PE_DIM: gl.constexpr,
    DK: gl.constexpr,
    HAS_PE: gl.constexpr,
    HAS_SINK: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    USE_BUFFER: gl.constexpr,
    K_WIDTH: gl.constexpr,
    MMA_QK: gl.constexpr,
    MMA_PV: gl.constexpr,
    GATHER: gl.constexpr,
    GATHER_PE: gl.constexpr,
    SMEM: gl.constexpr,
    FUSED_REDUCE: gl.constexpr,
    RED: gl.constexpr,
    COMBINERS: gl.constexpr = 0,  # > 0: combiner programs after the splits (_combiner)
):
    """One program per (row, head block, KV split): grid (R, cdiv(H, BLOCK_H), NUM_SPLITS), or
    with ``COMBINERS`` > 0 a 1-D grid of R x blocks x (NUM_SPLITS + COMBINERS) programs whose
    roles come from work tickets in start order: the splits' first, then the combiners'
    (:func:`_ticket`, :func:`_combiner`)."""
    DOT_A_QK: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_QK, k_width=K_WIDTH)
    DOT_B_QK: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA_QK, k_width=K_WIDTH)
    DOT_A_PV: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_PV, k_width=K_WIDTH)
    DOT_B_PV: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA_PV, k_width=K_WIDTH)
    ROW_QK: gl.constexpr = gl.SliceLayout(1, MMA_QK)  # per-head vectors of the S tile
    COL_QK: gl.constexpr = gl.SliceLayout(0, MMA_QK)  # per-slot vectors of the S tile
    ROW_PV: gl.constexpr = gl.SliceLayout(1, MMA_PV)
    COL_PV: gl.constexpr = gl.SliceLayout(0, MMA_PV)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    if COMBINERS > 0:
        num_hb = gl.cdiv(num_heads, BLOCK_H)
        groups, g, pid_s, work, comb = _split_ticket(count_ptr, NUM_SPLITS, COMBINERS)
        rows = groups // num_hb  # groups: R x head blocks
        pid_r = (g % rows).to(gl.int64)
        pid_h = g // rows
    else:
        pid_r = gl.program_id(0).to(gl.int64)
        pid_h = gl.program_id(1)
        pid_s = gl.program_id(2)
        work: gl.constexpr = True  # the branch below is the kernel's only path
    if work:  # (row pid_r, head block pid_h, KV split pid_s)
        # ---- Q (and Q_pe) -> shared memory, once per program.
        offs_hg = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, GATHER))
        q_ptrs = q_ptr + pid_r * stride_qr + offs_hg[:, None] * stride_qh + offs_d[None, :]
        q = gl.load(q_ptrs, mask=(offs_hg < num_heads)[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, HEAD_DIM], SMEM, q)
        kv_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_K, HEAD_DIM], SMEM)
        offs_pe = gl.arange(0, PE_DIM, layout=gl.SliceLayout(0, GATHER_PE))
        if HAS_PE:
            offs_hp = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER_PE))
            qpe_ptrs = (
                qpe_ptr + pid_r * stride_qper + offs_hp[:, None] * stride_qpeh + offs_pe[None, :]
            )
            qpe = gl.load(qpe_ptrs, mask=(offs_hp < num_heads)[:, None], other=0.0)
            qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, PE_DIM], SMEM, qpe)
            pe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_K, PE_DIM], SMEM)
        else:
            qpe_smem = q_smem
            pe_smem = kv_smem

        # ---- This split's slot range [lo, hi) of the row's CSR list (int64 positions).
        lo, hi, num_tiles = _split_range(indptr_ptr, nnz, pid_r, pid_s, NUM_SPLITS, BLOCK_K)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW_QK)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW_QK)
        acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=MMA_PV)

        # ---- Prologue: slot ids and gather of tile 0.
        offs_s = lo + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, GATHER))  # [BLOCK_K] int64
        slot = gl.load(idx_ptr + offs_s, mask=offs_s < hi, other=-1).to(gl.int64)
        valid = (offs_s < hi) & (slot >= 0) & (slot < num_kv)
        _issue_tile(
            kv_smem.index(0), pe_smem.index(0), kv_ptr, kpe_ptr, slot, valid, stride_kvn,
            stride_kpen, offs_d, offs_pe, ARCH, USE_BUFFER, HAS_PE, GATHER_PE,
        )  # fmt: skip

        for it in range(num_tiles):
            buf = it % 2
            # Next tile's ids and gather go out before this tile's math (past hi they are masked).
            offs_n = offs_s + BLOCK_K
            slot_n = gl.load(idx_ptr + offs_n, mask=offs_n < hi, other=-1).to(gl.int64)
            valid_n = (offs_n < hi) & (slot_n >= 0) & (slot_n < num_kv)
            gl.thread_barrier()  # every warp is done reading the buffer about to be overwritten
            _issue_tile(
                kv_smem.index(1 - buf), pe_smem.index(1 - buf), kv_ptr, kpe_ptr, slot_n, valid_n,
                stride_kvn, stride_kpen, offs_d, offs_pe, ARCH, USE_BUFFER, HAS_PE, GATHER_PE,
            )  # fmt: skip
            _wait(1, ARCH)  # this tile's copies have landed (the next tile's may still fly)
            gl.thread_barrier()  # ... for every warp's copies, not only this thread's
            k_tile = kv_smem.index(buf)

            # S = Q K^T over HEAD_DIM in DK-wide chunks (+ Q_pe K_pe^T).
            qk = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=MMA_QK)
            for d0 in gl.static_range(0, HEAD_DIM, DK):
                a = q_smem.slice(d0, DK, dim=1).load(DOT_A_QK)  # [BLOCK_H, DK]
                b = k_tile.slice(d0, DK, dim=1).permute([1, 0]).load(DOT_B_QK)  # [DK, BLOCK_K]
                qk = _mma(a, b, qk, ARCH)
            if HAS_PE:
                a = qpe_smem.load(DOT_A_QK)  # [BLOCK_H, PE_DIM]
                b = pe_smem.index(buf).permute([1, 0]).load(DOT_B_QK)  # [PE_DIM, BLOCK_K]
                qk = _mma(a, b, qk, ARCH)

            valid_qk = gl.convert_layout(valid, COL_QK)
            qk = gl.where(valid_qk[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_K]
            p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i)

            acc = acc * gl.convert_layout(alpha, ROW_PV)[:, None]
            p_op = gl.convert_layout(p.to(dtype), DOT_A_PV)  # [BLOCK_H, BLOCK_K]
            v = k_tile.load(DOT_B_PV)  # [BLOCK_K, HEAD_DIM]
            # p is 0 on invalid slots, but 0 * NaN is NaN: zero those rows of V.
            valid_v = gl.convert_layout(valid, gl.SliceLayout(1, DOT_B_PV))
            v = gl.where(valid_v[:, None], v, gl.zeros_like(v))
            acc = _mma(p_op, v, acc, ARCH)

            offs_s = offs_n
            slot = slot_n
            valid = valid_n
        _wait(0, ARCH)

        _epilogue(
            acc, m_i, l_i, pid_r, pid_h, pid_s, sink_ptr, out_ptr, lse_ptr, opart_ptr, lsepart_ptr,
            stride_or, stride_oh, num_heads, count_ptr, BLOCK_H, HEAD_DIM, HAS_SINK, NUM_SPLITS,
            WRITE_LSE, ROW_QK, ROW_PV, COL_PV, FUSED_REDUCE, RED, COMBINERS,
        )  # fmt: skip
    else:
        _combiner(
            comb, groups, rows, count_ptr, opart_ptr, lsepart_ptr, sink_ptr,
            out_ptr, lse_ptr, stride_or, stride_oh, num_heads, BLOCK_H, HEAD_DIM, NUM_SPLITS,
            HAS_SINK, WRITE_LSE, RED, COMBINERS, True,
        )  # fmt: skip


@gluon.jit
def _lse_part(lsepart_ptr, part, num_heads, offs_h, h_ok, CACHE: gl.constexpr):
    """Split partial ``part``'s base-2 LSE of heads ``offs_h`` (-inf: none, or masked)."""
    return gl.load(
        lsepart_ptr + part * num_heads + offs_h, mask=h_ok, other=float("-inf"),
        cache_modifier=CACHE,
    )  # fmt: skip


@gluon.jit
def _combine(
    opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lse_ptr, pid_r, h0, stride_or, stride_oh,
    num_heads, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr,
    NUM_SPLITS: gl.constexpr, HAS_SINK: gl.constexpr, WRITE_LSE: gl.constexpr,
    LAYOUT: gl.constexpr, CACHE: gl.constexpr, COLS: gl.constexpr = 0,
):  # fmt: skip
    """Combine the split partials of heads [h0, h0 + BLOCK_H) of row ``pid_r``:
    out = sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + sink), CHUNK columns at a time;
    ``CACHE``: the partial loads' cache modifier. ``COLS`` > 0: only the first COLS columns
    (the caller offsets ``opart_ptr`` and ``out_ptr`` to its column block; rows stay
    HEAD_DIM apart)."""
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LAYOUT))
    offs_d = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LAYOUT))
    h_ok = offs_h < num_heads

    m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LAYOUT))
    for s in gl.static_range(NUM_SPLITS):
        lse_s = _lse_part(lsepart_ptr, pid_r * NUM_SPLITS + s, num_heads, offs_h, h_ok, CACHE)
        m = gl.maximum(m, lse_s)
    has_slot = m > float("-inf")  # some split saw a valid slot
    if HAS_SINK:
        sink = gl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * LOG2E
        m = gl.maximum(m, sink)
    m_safe = gl.where(m == float("-inf"), 0.0, m)

    den = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, LAYOUT))
    for s in gl.static_range(NUM_SPLITS):
        lse_s = _lse_part(lsepart_ptr, pid_r * NUM_SPLITS + s, num_heads, offs_h, h_ok, CACHE)
        den += gl.exp2(lse_s - m_safe)
    if HAS_SINK:
        den += gl.exp2(sink - m_safe)
    den_safe = gl.where(den > 0.0, den, 1.0)
    TOTAL: gl.constexpr = HEAD_DIM if COLS == 0 else COLS
    for d0 in gl.static_range(0, TOTAL, CHUNK):
        acc = gl.zeros([BLOCK_H, CHUNK], gl.float32, layout=LAYOUT)
        for s in gl.static_range(NUM_SPLITS):
            part = pid_r * NUM_SPLITS + s
            w = gl.exp2(_lse_part(lsepart_ptr, part, num_heads, offs_h, h_ok, CACHE) - m_safe)
            o_ptrs = (
                opart_ptr + (part * num_heads + offs_h[:, None]) * HEAD_DIM + d0 + offs_d[None, :]
            )
            o_s = gl.load(o_ptrs, mask=h_ok[:, None], other=0.0, cache_modifier=CACHE)
            acc += w[:, None] * o_s
        # A row with no valid slot gets zeros whatever the sink (a NaN sink: m, w and acc NaN).
        o = gl.where(has_slot[:, None], acc / den_safe[:, None], 0.0)
        o_ptrs = out_ptr + pid_r * stride_or + offs_h[:, None] * stride_oh + d0 + offs_d[None, :]
        gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    if WRITE_LSE:
        lse = gl.where(den > 0.0, (m_safe + gl.log2(den_safe)) * LN2, float("-inf"))
        gl.store(lse_ptr + pid_r * num_heads + offs_h, lse, mask=h_ok)


@gluon.jit
def _mla_reduce_kernel(
    opart_ptr,  # [R, NUM_SPLITS, H, HEAD_DIM] fp32, each split normalised by its own sum
    lsepart_ptr,  # [R, NUM_SPLITS, H] fp32, base-2 log-sum-exp of each split (-inf: empty)
    sink_ptr,  # [H] fp32
    out_ptr,  # [R, H, HEAD_DIM]
    lse_ptr,  # [R, H] fp32
    stride_or,
    stride_oh,
    num_heads,
    BLOCK_H: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    HAS_SINK: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    LAYOUT: gl.constexpr,
    COLS: gl.constexpr = 0,
):
    """The reduce step as its own launch (without ``FUSED_REDUCE``): one program per (row,
    head block), or with ``COLS`` > 0 per (row, head block, block of COLS columns), grid
    (R, cdiv(H, BLOCK_H), HEAD_DIM // COLS), combines the split partials (:func:`_combine`).
    Column blocks spread a call of one or two rows over more SMs (``gluon_ws``'s splits); the
    LSE goes with whole rows only."""
    gl.static_assert(not (WRITE_LSE and COLS > 0), "the LSE is written by whole-row programs")
    pid_r = gl.program_id(0).to(gl.int64)
    pid_h = gl.program_id(1)
    CHUNK: gl.constexpr = HEAD_DIM if COLS == 0 else COLS
    if COLS > 0:
        col0 = gl.program_id(2) * COLS
        opart_ptr += col0
        out_ptr += col0
    _combine(
        opart_ptr, lsepart_ptr, sink_ptr, out_ptr, lse_ptr, pid_r, pid_h * BLOCK_H,
        stride_or, stride_oh, num_heads, BLOCK_H, HEAD_DIM, CHUNK, NUM_SPLITS, HAS_SINK,
        WRITE_LSE, LAYOUT, "", COLS,
    )  # fmt: skip
