"""Gluon causal prefill / extend for Hopper (sm90) over a paged KV cache: the triton provider's prefill
kernel where Gluon (``triton.experimental.gluon``, Triton 3.6 to 3.8) and an sm90 GPU are present.

Same tile list and GQA packing as :mod:`.prefill` (a program = ``BLOCK_Q`` query tokens x the ``GROUP``
heads of one KV head, ``BLOCK_M = BLOCK_Q * GROUP`` rows: row ``r`` is token ``r // GROUP``, head
``r % GROUP``; program ``p`` takes tile ``num_tiles - 1 - p``, longest causal tiles first). What Gluon
adds over the Triton kernel is explicit control of the Hopper pipeline:

* **Loads**: K and V of a ``BLOCK_N``-key block are gathered row by row through the page table
  (``cp.async``, 16 bytes a copy, rows past ``hi`` zero-filled) into a ``NUM_STAGES``-slot shared-memory
  ring in the wgmma (NVMMA, 128-byte swizzled) layout; ``NUM_STAGES - 1`` blocks are in flight while
  one computes. The page ids of block ``i + NUM_STAGES - 1`` are read while ``Q K^T`` of block ``i``
  runs on the tensor cores (issued asynchronously first).
* **Matmuls**: ``warpgroup_mma`` (wgmma): ``S = Q K^T`` with Q and K from shared memory, ``O += P V``
  with P from registers (fp32 softmax cast to the value dtype) and V from shared memory; fp32 accumulators.
* **Causal block skipping**: keys ``[0, hi)`` only (``hi``: the tile's last row's position + 1); blocks
  below ``free_hi`` (seen by every row) skip all mask work, the diagonal blocks mask ``n > pos[row]``.
* Online softmax in base 2 with the scale folded into one FMA; LSE (natural log) out if asked.

Scope (the provider falls back to :mod:`.prefill` / :mod:`.attention` for anything else): causal, 16-bit
Q/K/V, head_dim 64 / 128 / 256, ``GROUP`` a power of two dividing ``BLOCK_M`` (128), no custom mask,
window, soft cap, sinks, fp8 KV, KV splits or ``kv_start``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# a CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` from 3.7 on
thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

# (head_dim) -> (block_m, block_n, num_stages, num_warps, qk_ahead, loaders, pingpong): the configurations the
# provider launches (``BLOCK_M`` rows over ``num_warps // 4`` compute warpgroups of 64 rows); shared memory: Q
# BLOCK_M x D plus NUM_STAGES x (K + V) blocks of BLOCK_N x D, 16-bit (at most 227 KiB an SM). ``loaders`` > 0:
# the warp-specialized kernel (:func:`gluon_prefill_ws_kernel`), that many gather warps beside the compute warps,
# ``qk_ahead`` implied; ``pingpong``: its warpgroups take turns at the wgmmas. A head dim without an entry (256:
# the Triton kernel is as fast, docs/gluon.md) plans the Triton kernels.
CONFIGS = {64: (128, 128, 4, 8, True, 4, True), 128: (128, 64, 4, 8, True, 4, True)}
# head_dim -> the single-partition kernel's configurations (:func:`gluon_prefill_kernel`; ``QK_AHEAD`` needs 3
# stages): the probe's alternatives, compiled by the sm90 check
SINGLE_PARTITION = {
    64: (128, 128, 4, 8, True, 0, False),
    128: (128, 64, 4, 8, True, 0, False),
    256: (128, 64, 2, 8, False, 0, False),
}
# head_dim -> the warp-specialized configurations the probe times (gluon_prefill_probe.py) and the sm90 check compiles
WS_CANDIDATES = {
    64: [(128, 128, 4, 8, True, 4, True), (128, 128, 4, 8, True, 4, False), (128, 64, 4, 8, True, 4, True)],
    128: [
        (128, 128, 2, 8, True, 4, True),
        (128, 128, 2, 8, True, 4, False),
        (128, 128, 3, 8, True, 4, True),
        (128, 64, 4, 8, True, 4, True),
    ],
    256: [(128, 64, 2, 8, True, 4, True)],
}
LOADER_REGS = 88  # registers a gather thread of the warp-specialized kernel (its 16 row addresses of K and V)


def ws_registers(num_warps: int, loaders: int) -> tuple[int, int, int]:
    """``(maxnreg, compute, loader)`` registers a thread for ``num_warps`` compute + ``loaders`` gather warps:
    the launch's cap (the 64 Ki register file over the CTA, rounded down to 8), the compute warps' share of
    what the loaders leave, and the loaders' :data:`LOADER_REGS`."""
    cap = 65536 // (32 * (num_warps + loaders)) // 8 * 8
    return cap, (cap * (num_warps + loaders) - LOADER_REGS * loaders) // num_warps // 8 * 8, LOADER_REGS


@gluon.constexpr_function
def _load_layout(rows, head_dim, num_warps):
    """Blocked layout of a ``[rows, head_dim]`` 16-bit gather: 8 elements (16 bytes) a thread along D."""
    tpw_d = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [num_warps, 1], [1, 0])


@gluon.jit
def _kv_pages(j, kv_indices, page_base, hi, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, LAYOUT: gl.constexpr):
    """Page ids ``[BLOCK_N]`` (rows of ``LAYOUT``) of block ``j``'s keys ``j * BLOCK_N ..``; 0 at or past ``hi``."""
    n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    return gl.load(kv_indices + page_base + n // PAGE_SIZE, mask=n < hi, other=0)


@gluon.jit
def _kv_ptrs(
    K,
    V,
    j,
    page,
    hi,
    kvh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """Pointers ``[BLOCK_N, HEAD_DIM]`` to K and V of block ``j`` (KV head ``kvh``) from its page ids
    (:func:`_kv_pages`), and the mask of the keys below ``hi``."""
    n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    d0 = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT)), 0)
    page = page.to(gl.int64)
    slot = n % PAGE_SIZE
    k_off = gl.multiple_of(page * stride_kp + slot * stride_kt + kvh * stride_kh, 8)  # strides of 8 (provider)
    v_off = gl.multiple_of(page * stride_vp + slot * stride_vt + kvh * stride_vh, 8)
    mask = gl.expand_dims(n < hi, 1) & (d0 < HEAD_DIM)
    return K + (gl.expand_dims(k_off, 1) + d0), V + (gl.expand_dims(v_off, 1) + d0), mask


@gluon.jit
def _issue_block(
    K,
    V,
    k_ring,
    v_ring,
    j,
    num_blocks,
    kv_indices,
    page_base,
    hi,
    kvh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """Start the asynchronous gather of block ``j`` of K and V into ring slot ``j % NUM_STAGES``
    (``[BLOCK_N, HEAD_DIM]`` each; rows at or past ``hi`` zero-filled) and commit it as one cp.async group
    (an empty group from ``num_blocks`` on: the group count stays fixed)."""
    if j < num_blocks:
        k_ptrs, v_ptrs, mask = _kv_ptrs(
            K,
            V,
            j,
            _kv_pages(j, kv_indices, page_base, hi, BLOCK_N, PAGE_SIZE, LAYOUT),
            hi,
            kvh,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            BLOCK_N,
            HEAD_DIM,
            PAGE_SIZE,
            LAYOUT,
        )
        async_copy.async_copy_global_to_shared(k_ring.index(j % NUM_STAGES), k_ptrs, mask=mask)
        async_copy.async_copy_global_to_shared(v_ring.index(j % NUM_STAGES), v_ptrs, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _tile_offsets(
    q_start,
    q0,
    q_len,
    kvh,
    stride_t,
    stride_h,
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    LAYOUT: gl.constexpr,
    ROW0: gl.constexpr = 0,
):
    """Offsets ``[BLOCK_M, HEAD_DIM]`` of the tile's rows ``ROW0 ..`` (row ``r``: token ``q0 + r // GROUP``,
    head ``kvh * GROUP + r % GROUP``) in a ``[T, H, D]`` tensor of strides ``(stride_t, stride_h, 1)``, and the
    mask of the rows inside the request."""
    r = ROW0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))
    tok = q0 + r // GROUP
    rows = gl.multiple_of((q_start + tok).to(gl.int64) * stride_t + (kvh * GROUP + r % GROUP) * stride_h, 8)
    mask = gl.expand_dims(tok < q_len, 1) & gl.expand_dims(d < HEAD_DIM, 0)
    return gl.expand_dims(rows, 1) + gl.expand_dims(d, 0), mask


@gluon.jit
def _store_out(
    O,
    LSE,
    acc,
    m_i,
    l_i,
    q_start,
    q0,
    q_len,
    kvh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STORE_LSE: gl.constexpr,
    ROW_S: gl.constexpr,
    ROW_O: gl.constexpr,
    LAYOUT: gl.constexpr,
    ROW0: gl.constexpr = 0,
    stage=None,
):
    """``acc / l`` into O's tile rows ``ROW0 ..``; with ``STORE_LSE`` the natural-log LSE (``-inf`` for a row with no
    key). ``acc [BLOCK_M, HEAD_DIM]`` (rows ``ROW_O``), ``m_i``, ``l_i [BLOCK_M]`` (base 2, rows ``ROW_S``).
    ``stage``: a ``[BLOCK_M, HEAD_DIM]`` shared buffer free for reuse, through which the output changes layout
    (else a layout conversion with scratch memory of its own)."""
    has = l_i > 0.0
    l_o = gl.convert_layout(gl.where(has, l_i, 1.0), ROW_O)
    out = (acc / gl.expand_dims(l_o, 1)).to(O.dtype.element_ty)
    if stage is None:
        out = gl.convert_layout(out, LAYOUT)
    else:
        stage.store(out)
        out = stage.load(LAYOUT)
    offs, mask = _tile_offsets(q_start, q0, q_len, kvh, stride_ot, stride_oh, GROUP, BLOCK_M, HEAD_DIM, LAYOUT, ROW0)
    gl.store(O + offs, out, mask=mask)
    if STORE_LSE:
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf")) * 0.6931471805599453
        rs = ROW0 + gl.arange(0, BLOCK_M, layout=ROW_S)
        tok = q0 + rs // GROUP
        l_ptrs = LSE + (q_start + tok).to(gl.int64) * stride_lt + (kvh * GROUP + rs % GROUP) * stride_lh
        gl.store(l_ptrs, lse, mask=tok < q_len)


@gluon.jit
def _tile(qo_indptr, kv_indptr, kv_lens, tile_req, tile_qstart, num_tiles):
    """This program's tile (the list run backwards: longest causal tiles first): ``(q0, q_start, q_len,
    kv_len, page_base)``, its first query token within the request and the request's query start, query
    length, key length and first page-table entry."""
    tile = num_tiles - 1 - gl.program_id(0)
    b = gl.load(tile_req + tile)
    q_start = gl.load(qo_indptr + b)
    return (
        gl.load(tile_qstart + tile),
        q_start,
        gl.load(qo_indptr + b + 1) - q_start,
        gl.load(kv_lens + b),
        gl.load(kv_indptr + b),
    )


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    n0,
    free_hi,
    pos,
    qk_scale,
    BLOCK_N: gl.constexpr,
    dtype: gl.constexpr,
    S_L: gl.constexpr,
    ROW_O: gl.constexpr,
    P_L: gl.constexpr,
):
    """Logits ``s [BLOCK_M, BLOCK_N]`` (``q . k`` of keys ``n0 ..``) into the online softmax (base 2):
    ``(p as the PV wgmma's A operand, alpha [BLOCK_M] in the accumulator's row layout, m_new, l_new)``.
    Blocks reaching ``free_hi`` are on the diagonal: keys past each row's position ``pos`` are hidden."""
    if n0 + BLOCK_N > free_hi:
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        s = gl.where(gl.expand_dims(n, 0) <= gl.expand_dims(pos, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), P_L), gl.convert_layout(alpha, ROW_O), m_new, l_i


@gluon.jit
def gluon_prefill_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    tile_req,
    tile_qstart,
    num_tiles,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    STORE_LSE: gl.constexpr,
    QK_AHEAD: gl.constexpr = True,
):
    """Grid ``(num_tiles, Hkv)``, causal (bottom-right aligned), launched with ``BLOCK_M // 16`` warps (a
    warpgroup for each 64 rows). Q ``[T, Hq, D]`` 16-bit; K/V paged caches (strides given, page
    ``PAGE_SIZE``, Q's dtype); O ``[T, Hq, D]``; LSE ``[T, Hq]`` float32 natural log (``STORE_LSE``).
    ``qo_indptr [B+1]``, ``kv_indptr [B+1]``, ``kv_indices``, ``kv_lens [B]``, ``tile_req`` /
    ``tile_qstart [num_tiles]`` int32."""
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = Q.dtype.element_ty
    LOAD: gl.constexpr = _load_layout(BLOCK_N, HEAD_DIM, NW)
    QLOAD: gl.constexpr = _load_layout(BLOCK_M, HEAD_DIM, NW)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

    kvh = gl.program_id(1)
    q0, q_start, q_len, kv_len, page_base = _tile(qo_indptr, kv_indptr, kv_lens, tile_req, tile_qstart, num_tiles)

    q_offs, q_mask = _tile_offsets(q_start, q0, q_len, kvh, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, QLOAD)
    q = gl.load(Q + q_offs, mask=q_mask, other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], Q_SMEM, value=q)  # wgmma operand A

    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], SMEM)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], SMEM)

    pos0 = kv_len - q_len + q0  # the tile's first row: keys [0, pos0] are visible to every row
    hi = gl.minimum(kv_len, pos0 + BLOCK_Q)
    free_hi = (pos0 + 1) // BLOCK_N * BLOCK_N
    num_blocks = gl.cdiv(hi, BLOCK_N)

    # prologue: the first blocks in flight (every slot with QK_AHEAD, which refills a slot once its P V is
    # done; all but one otherwise, refilled while the block's Q K^T runs)
    PROLOGUE: gl.constexpr = NUM_STAGES if QK_AHEAD else NUM_STAGES - 1
    for j in gl.static_range(PROLOGUE):
        _issue_block(
            K,
            V,
            k_ring,
            v_ring,
            j,
            num_blocks,
            kv_indices,
            page_base,
            hi,
            kvh,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            BLOCK_N,
            HEAD_DIM,
            PAGE_SIZE,
            NUM_STAGES,
            LOAD,
        )

    rs = gl.arange(0, BLOCK_M, layout=ROW_S)
    pos = kv_len - q_len + q0 + rs // GROUP  # absolute position of each row
    qk_scale = sm_scale * 1.4426950408889634
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_S)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW_S)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_L)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)

    if QK_AHEAD:
        # per block i: issue Q K_i^T, rescale O, issue P_{i-1} V_{i-1}; wait for S_i only, so the softmax of
        # block i runs while P_{i-1} V_{i-1} is on the tensor cores; then wait for O. Only finished values
        # cross the loop edge (an in-flight accumulator there makes ptxas serialize the wgmmas).
        async_copy.wait_group(NUM_STAGES - 1)  # block 0 has landed (this thread's copies)
        fence_async_shared()  # Q's store and the cp.async writes (generic proxy) before wgmma (async proxy)
        thread_barrier()  # ... of every thread
        s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
        p_op, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, free_hi, pos, qk_scale, BLOCK_N, dtype, S_L, ROW_O, P_L)
        for i in range(1, num_blocks):
            async_copy.wait_group(NUM_STAGES - 2)  # block i has landed (0 .. i + NUM_STAGES - 2 issued)
            fence_async_shared()
            thread_barrier()
            s_tok = warpgroup_mma(
                q_smem, k_ring.index(i % NUM_STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            acc = acc * gl.expand_dims(alpha, 1)
            acc_tok = warpgroup_mma(p_op, v_ring.index((i - 1) % NUM_STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_i done; P_{i-1} V_{i-1} runs on
            p_op, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, i * BLOCK_N, free_hi, pos, qk_scale, BLOCK_N, dtype, S_L, ROW_O, P_L
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
            thread_barrier()  # both warpgroups are done with block i - 1's slot
            _issue_block(
                K,
                V,
                k_ring,
                v_ring,
                i - 1 + NUM_STAGES,
                num_blocks,
                kv_indices,
                page_base,
                hi,
                kvh,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                NUM_STAGES,
                LOAD,
            )
        acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(p_op, v_ring.index((num_blocks - 1) % NUM_STAGES), acc)
    else:
        for i in range(num_blocks):
            slot = i % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 2)  # block i has landed (this thread's copies)
            fence_async_shared()  # cp.async / Q stores (generic proxy) before the wgmma (async proxy) reads
            thread_barrier()  # ... every thread's
            k_slot = k_ring.index(slot)
            v_slot = v_ring.index(slot)
            s = warpgroup_mma(q_smem, k_slot.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # meanwhile: block i + NUM_STAGES - 1 into the slot block i - 1 used (its wgmmas have completed)
            _issue_block(
                K,
                V,
                k_ring,
                v_ring,
                i + NUM_STAGES - 1,
                num_blocks,
                kv_indices,
                page_base,
                hi,
                kvh,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                BLOCK_N,
                HEAD_DIM,
                PAGE_SIZE,
                NUM_STAGES,
                LOAD,
            )
            s, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, k_slot))
            p_op, alpha, m_i, l_i = _softmax_step(
                s, m_i, l_i, i * BLOCK_N, free_hi, pos, qk_scale, BLOCK_N, dtype, S_L, ROW_O, P_L
            )
            acc = acc * gl.expand_dims(alpha, 1)
            acc = warpgroup_mma(p_op, v_slot, acc, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_slot))
    async_copy.wait_group(0)
    _store_out(
        O,
        LSE,
        acc,
        m_i,
        l_i,
        q_start,
        q0,
        q_len,
        kvh,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_lh,
        GROUP,
        BLOCK_M,
        HEAD_DIM,
        STORE_LSE,
        ROW_S,
        ROW_O,
        QLOAD,
    )


@gluon.jit
def _ws_loader(
    K,
    V,
    k_ring,
    v_ring,
    k_ready,
    v_ready,
    empty,
    num_blocks,
    kv_indices,
    page_base,
    hi,
    kvh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The gather partition: block ``j`` of K and V into slot ``j % NUM_STAGES`` once the compute partitions
    have released it (``empty``), block ``j + 1``'s page ids read meanwhile; each thread's copies arrive on
    ``k_ready`` / ``v_ready`` as they land (``cp.async.mbarrier.arrive.noinc``: a barrier completes when every
    gather thread's copies have)."""
    LAYOUT: gl.constexpr = _load_layout(BLOCK_N, HEAD_DIM, gl.num_warps())
    pages = _kv_pages(0, kv_indices, page_base, hi, BLOCK_N, PAGE_SIZE, LAYOUT)
    for j in range(num_blocks):
        slot = j % NUM_STAGES
        page = pages
        pages = _kv_pages(j + 1, kv_indices, page_base, hi, BLOCK_N, PAGE_SIZE, LAYOUT)  # in flight while it waits
        mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        k_ptrs, v_ptrs, mask = _kv_ptrs(
            K,
            V,
            j,
            page,
            hi,
            kvh,
            stride_kp,
            stride_kt,
            stride_kh,
            stride_vp,
            stride_vt,
            stride_vh,
            BLOCK_N,
            HEAD_DIM,
            PAGE_SIZE,
            LAYOUT,
        )
        async_copy.async_copy_global_to_shared(k_ring.index(slot), k_ptrs, mask=mask)
        async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
        async_copy.async_copy_global_to_shared(v_ring.index(slot), v_ptrs, mask=mask)
        async_copy.mbarrier_arrive(v_ready.index(slot), increment_count=False)


@gluon.jit
def _ws_rows(
    rows,
    GROUP: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    STORE_LSE: gl.constexpr,
    PINGPONG: gl.constexpr,
    WG: gl.constexpr,
):
    """One compute warpgroup: rows ``64 WG .. 64 WG + 63`` of the tile, start to end (its own softmax state
    and epilogue). ``rows``: the run-time arguments it reads, as :func:`gluon_prefill_ws_kernel` packs them (the
    constexprs come apart: in a tuple they would not stay constexpr). Per block ``i``: ``Q K_i^T`` and
    ``P_{i-1} V_{i-1}`` in flight together, the softmax of block ``i`` under the latter, then its share of slot
    ``i - 1`` released (``empty`` counts both warpgroups). ``PINGPONG``: the two warpgroups take turns issuing
    their wgmmas (``turn``), so that one's softmax runs while the other's matmuls do."""
    O, LSE, q_smem, k_ring, v_ring, k_ready, v_ready, empty, turn, q_start, q0, q_len, kv_len, kvh = rows[0]
    num_blocks, sm_scale, stride_ot, stride_oh, stride_lt, stride_lh = rows[1]
    NW: gl.constexpr = gl.num_warps()
    HEAD_DIM: gl.constexpr = q_smem.type.shape[1]
    ROWS: gl.constexpr = 16 * NW
    dtype: gl.constexpr = q_smem.dtype
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    q_rows = q_smem.slice(WG * ROWS, ROWS, dim=0)
    pos0 = kv_len - q_len + q0
    free_hi = (pos0 + 1) // BLOCK_N * BLOCK_N
    pos = pos0 + (WG * ROWS + gl.arange(0, ROWS, layout=ROW_S)) // GROUP  # absolute position of each row
    qk_scale = sm_scale * 1.4426950408889634
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=ROW_S)
    l_i = gl.zeros([ROWS], gl.float32, layout=ROW_S)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=O_L)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_L)

    if PINGPONG:  # the k-th turn of warpgroup 0 waits for warpgroup 1's (k - 1)-th (its first is free)
        mbarrier.wait(turn.index(WG), WG ^ 1)
    mbarrier.wait(k_ready.index(0), 0)
    fence_async_shared()  # the gather's cp.async writes (generic proxy) before the wgmma (async proxy) reads
    s_tok = warpgroup_mma(q_rows, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    p_op, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, free_hi, pos, qk_scale, BLOCK_N, dtype, S_L, ROW_O, P_L)
    for i in range(1, num_blocks):
        slot = i % NUM_STAGES
        prev = (i - 1) % NUM_STAGES
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (i & 1) ^ WG ^ 1)
        mbarrier.wait(k_ready.index(slot), (i // NUM_STAGES) & 1)
        fence_async_shared()
        s_tok = warpgroup_mma(q_rows, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((i - 1) // NUM_STAGES) & 1)
        fence_async_shared()
        acc = acc * gl.expand_dims(alpha, 1)
        acc_tok = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        p_op, alpha, m_i, l_i = _softmax_step(
            s, m_i, l_i, i * BLOCK_N, free_hi, pos, qk_scale, BLOCK_N, dtype, S_L, ROW_O, P_L
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        thread_barrier()  # the warpgroup is done with slot prev (the arrive is one thread's)
        mbarrier.arrive(empty.index(prev), count=1)
    last = (num_blocks - 1) % NUM_STAGES
    mbarrier.wait(v_ready.index(last), ((num_blocks - 1) // NUM_STAGES) & 1)
    fence_async_shared()
    acc = warpgroup_mma(p_op, v_ring.index(last), acc * gl.expand_dims(alpha, 1))
    _store_out(
        O,
        LSE,
        acc,
        m_i,
        l_i,
        q_start,
        q0,
        q_len,
        kvh,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_lh,
        GROUP,
        ROWS,
        HEAD_DIM,
        STORE_LSE,
        ROW_S,
        ROW_O,
        _load_layout(ROWS, HEAD_DIM, NW),
        WG * ROWS,
        q_rows,  # its last reader, the last Q K^T, has completed
    )


@gluon.jit
def gluon_prefill_ws_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    tile_req,
    tile_qstart,
    num_tiles,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    STORE_LSE: gl.constexpr,
    LOADERS: gl.constexpr,
    COMPUTE_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """:func:`gluon_prefill_kernel`'s arguments and result, warp-specialized, launched with 4 warps (``BLOCK_M``
    128): warpgroup 0 (these warps) and a second warpgroup compute rows 0-63 and 64-127 of the tile, each on its
    own (:func:`_ws_rows`); ``LOADERS`` gather warps fill the K/V ring through the page table. The ring's
    slots are handed over by mbarriers; no barrier spans the partitions. Registers a thread:
    ``COMPUTE_REGS`` / ``LOADER_REGS``; launch with ``maxnreg`` from :func:`ws_registers`."""
    NW: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = Q.dtype.element_ty
    QLOAD: gl.constexpr = _load_layout(BLOCK_M, HEAD_DIM, NW)
    SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    gl.static_assert(BLOCK_M == 2 * 16 * NW, "two compute warpgroups of 64 rows")

    kvh = gl.program_id(1)
    q0, q_start, q_len, kv_len, page_base = _tile(qo_indptr, kv_indptr, kv_lens, tile_req, tile_qstart, num_tiles)
    hi = gl.minimum(kv_len, kv_len - q_len + q0 + BLOCK_Q)  # keys the tile's last row sees
    num_blocks = gl.cdiv(hi, BLOCK_N)

    q_offs, q_mask = _tile_offsets(q_start, q0, q_len, kvh, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, QLOAD)
    q = gl.load(Q + q_offs, mask=q_mask, other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], Q_SMEM, value=q)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], SMEM)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], SMEM)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(st), count=32 * LOADERS)
        mbarrier.init(v_ready.index(st), count=32 * LOADERS)
        mbarrier.init(empty.index(st), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()  # Q's store before the wgmmas read it
    thread_barrier()  # ... every thread's, and the barriers' init

    rows = (
        (O, LSE, q_smem, k_ring, v_ring, k_ready, v_ready, empty, turn, q_start, q0, q_len, kv_len, kvh),
        (num_blocks, sm_scale, stride_ot, stride_oh, stride_lt, stride_lh),
    )
    gl.warp_specialize(
        [
            (_ws_rows, (rows, GROUP, BLOCK_N, NUM_STAGES, STORE_LSE, PINGPONG, 0)),
            (_ws_rows, (rows, GROUP, BLOCK_N, NUM_STAGES, STORE_LSE, PINGPONG, 1)),
            (
                _ws_loader,
                (
                    K,
                    V,
                    k_ring,
                    v_ring,
                    k_ready,
                    v_ready,
                    empty,
                    num_blocks,
                    kv_indices,
                    page_base,
                    hi,
                    kvh,
                    stride_kp,
                    stride_kt,
                    stride_kh,
                    stride_vp,
                    stride_vt,
                    stride_vh,
                    BLOCK_N,
                    HEAD_DIM,
                    PAGE_SIZE,
                    NUM_STAGES,
                ),
            ),
        ],
        [NW, LOADERS],
        [COMPUTE_REGS, LOADER_REGS],
    )
