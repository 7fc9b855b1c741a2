"""Neighbourhood attention on the sphere written with PyTorch FlexAttention: what a PyTorch user would write
instead of a dedicated kernel. ``attention.py`` times it as a peer (``flex_*`` columns).

Layout: each grid's points in a 2-D patch order, patches of ``PATCH_ROWS`` x ``PATCH_COLS`` points (one
FlexAttention block of 128 tokens), patches row by row, each patch's points row-major. A grid that is not whole
patches is padded with points no query attends to; their own query rows are dropped (they read nothing, except
in blocks the mask lists as full, which skip the mask_mod). Only the layout is the user's choice here: the
tensors enter already in it, as a PyTorch model would keep them.

Block mask, built on the host from the plan: per query patch, the key patches any of its points reads (partial:
the mask_mod decides per pair) and those every one of its points reads whole (full: no mask_mod). The mask_mod is
the plan's own rule, its forward segment table: point ``(h, w)`` reads ``len_r`` longitudes of a key row from
``lo_r + S * (w // R)`` with ``r = w % R``. The quadrature weights enter as a score_mod adding ``log w`` of the
key's row, so the softmax is the plan's ``w exp(s) / sum w exp(s)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PATCH_ROWS, PATCH_COLS = 8, 16
BLOCK = PATCH_ROWS * PATCH_COLS  # FlexAttention's block size (its default, 128)
# The kernel tiles flex_runs tries in turn: Inductor's choice first; then, where its kernel asks for more shared
# memory than the GPU has (the mask_mod's gathers on 128 x 128 tiles), 64 x 64 forward tiles of two stages, and
# the backward's tiles as well. Each divides BLOCK, as FlexAttention requires.
KERNEL_OPTIONS = (
    None,
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
)


@dataclasses.dataclass(frozen=True)
class PatchLayout:
    """A grid in patch order: per token its latitude and longitude index (0 for padding) and whether it is a
    point of the grid."""

    nlat: int
    nlon: int
    lat: np.ndarray
    lon: np.ndarray
    valid: np.ndarray

    @property
    def patch_cols(self) -> int:
        return -(-self.nlon // PATCH_COLS)

    @property
    def tokens(self) -> int:
        return self.lat.size

    def gather_index(self) -> np.ndarray:
        """Flat grid index ``lat * nlon + lon`` of every token (0 for padding)."""
        return self.lat * self.nlon + self.lon


def patch_layout(nlat: int, nlon: int) -> PatchLayout:
    """The patch order of an ``nlat`` x ``nlon`` grid."""
    rows, cols = -(-nlat // PATCH_ROWS), -(-nlon // PATCH_COLS)
    pr, pc, r, c = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(PATCH_ROWS), np.arange(PATCH_COLS),
                               indexing="ij")  # fmt: skip
    lat, lon = (pr * PATCH_ROWS + r).ravel(), (pc * PATCH_COLS + c).ravel()
    valid = (lat < nlat) & (lon < nlon)
    return PatchLayout(nlat, nlon, np.where(valid, lat, 0), np.where(valid, lon, 0), valid)


def segment_lookup(plan) -> tuple[np.ndarray, np.ndarray]:
    """The forward segments as dense int32 tables ``lo[h, row, r]`` and ``length[h, row, r]`` (length 0 where
    query row ``h`` reads nothing of key row ``row``)."""
    table = plan.forward_segments
    residues = table.residues
    lo = np.zeros((plan.nlat_out, plan.nlat_in, residues), np.int32)
    length = np.zeros_like(lo)
    walk = np.repeat(np.arange(plan.nlat_out), np.diff(table.offsets))
    rows = table.segments[:, 0]
    lo[walk, rows] = table.segments[:, 1 : 1 + residues]
    length[walk, rows] = table.segments[:, 1 + residues :]
    return lo, length


def _column_runs(start: np.ndarray, end: np.ndarray, nlon: int, inner: bool):
    """Patch columns of the key grid that intervals ``[start, end)`` of the unwrapped longitude line touch
    (``inner=False``) or cover whole (``inner=True``, only columns of ``PATCH_COLS`` real points): per interval
    ``(element, column)`` pairs."""
    cols = -(-nlon // PATCH_COLS)
    whole_cols = nlon // PATCH_COLS  # columns without padding
    length = end - start
    elements, columns = [], []
    ring = length >= nlon
    ring_ids = np.flatnonzero(ring)
    every = np.arange(whole_cols if inner else cols)
    elements.append(np.repeat(ring_ids, every.size))
    columns.append(np.tile(every, ring_ids.size))
    part = np.flatnonzero(~ring & (length > 0))
    a = np.mod(start[part], nlon)
    b = a + length[part]
    for lo, hi in ((a, np.minimum(b, nlon)), (np.zeros_like(a), np.maximum(b - nlon, 0))):
        if inner:
            first, last = -(-lo // PATCH_COLS), np.minimum(hi // PATCH_COLS, whole_cols)  # [first, last)
        else:
            first, last = lo // PATCH_COLS, np.where(hi > lo, (hi - 1) // PATCH_COLS + 1, lo // PATCH_COLS)
        count = np.maximum(last - first, 0)
        elements.append(np.repeat(part, count))
        offsets = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        columns.append(np.repeat(first, count) + offsets)
    return np.concatenate(elements), np.concatenate(columns)


@dataclasses.dataclass(frozen=True)
class BlockLists:
    """Per query block, the sorted key blocks it reads in part and in full (FlexAttention's
    ``kv_num_blocks``/``kv_indices`` and ``full_kv_num_blocks``/``full_kv_indices`` for one batch and head)."""

    partial_counts: np.ndarray
    partial_indices: np.ndarray
    full_counts: np.ndarray
    full_indices: np.ndarray


def _lists(q_blocks: np.ndarray, k_blocks: np.ndarray, num_q: int, num_k: int):
    pairs = np.unique(q_blocks.astype(np.int64) * num_k + k_blocks)
    q, k = np.divmod(pairs, num_k)
    counts = np.bincount(q, minlength=num_q).astype(np.int32)
    indices = np.zeros((num_q, num_k), np.int32)  # FlexAttention's shape: padded to every key block
    position = np.arange(q.size) - np.repeat(np.cumsum(counts) - counts, counts)
    indices[q, position] = k
    return counts, indices


def block_lists(plan, q_layout: PatchLayout, k_layout: PatchLayout) -> BlockLists:
    """The block structure of ``plan``'s neighbourhoods in the two patch layouts."""
    lo, length = segment_lookup(plan)
    residues, shift, nlon_k = plan.forward_segments.residues, plan.forward_segments.shift, plan.nlon_in
    # Per (query row h, key row, query patch column): the 16 query longitudes' intervals on the unwrapped line.
    h, row = np.nonzero(length.max(axis=2) > 0)
    w = np.arange(q_layout.patch_cols * PATCH_COLS)
    real = w < plan.nlon_out
    r, step = w % residues, w // residues
    big = np.iinfo(np.int64).max // 4
    start = lo[h, row][:, r].astype(np.int64) + shift * step  # [pairs, w]
    end = start + length[h, row][:, r]
    reads = (length[h, row][:, r] > 0) & real
    ring = end - start >= nlon_k  # a whole ring: no bound on either side
    start, end = np.where(ring, -big, start), np.where(ring, big, end)
    shape = (h.size, q_layout.patch_cols, PATCH_COLS)
    start, end, reads, real = start.reshape(shape), end.reshape(shape), reads.reshape(shape), real.reshape(shape[1:])
    union_start = np.where(reads, start, big).min(axis=2)
    union_end = np.where(reads, end, -big).max(axis=2)
    every_real_reads = (reads | ~real).all(axis=2)
    inner_start = np.where(real, start, -big).max(axis=2)
    inner_end = np.where(real, end, big).min(axis=2)
    inner_end = np.where(every_real_reads, inner_end, inner_start)  # a point reading nothing: no full column
    touched = union_end > union_start
    pair_ids, patch_col = np.nonzero(touched)
    q_block = (h[pair_ids] // PATCH_ROWS) * q_layout.patch_cols + patch_col
    k_row_block = row[pair_ids] // PATCH_ROWS
    element, column = _column_runs(union_start[touched], union_end[touched], nlon_k, inner=False)
    num_q = q_layout.tokens // BLOCK
    num_k = k_layout.tokens // BLOCK
    partial_q, partial_k = q_block[element], k_row_block[element] * k_layout.patch_cols + column
    # Full: every real query of the block covers the column whole on every key row of the block, and the key
    # block has no padding (rows or columns).
    pair_ids, patch_col = np.nonzero(inner_end > inner_start)
    element, column = _column_runs(inner_start[pair_ids, patch_col], inner_end[pair_ids, patch_col], nlon_k, True)
    full_q = ((h[pair_ids] // PATCH_ROWS) * q_layout.patch_cols + patch_col)[element]
    full_k = (row[pair_ids] // PATCH_ROWS)[element] * k_layout.patch_cols + column
    keys, events = np.unique(full_q.astype(np.int64) * num_k + full_k, return_counts=True)
    full_q, full_k = np.divmod(keys, num_k)
    q_rows = np.minimum(plan.nlat_out - full_q // q_layout.patch_cols * PATCH_ROWS, PATCH_ROWS)
    whole = (events == q_rows * PATCH_ROWS) & ((full_k // k_layout.patch_cols + 1) * PATCH_ROWS <= plan.nlat_in)
    full_q, full_k = full_q[whole], full_k[whole]
    is_full = np.isin(partial_q.astype(np.int64) * num_k + partial_k, keys[whole])
    partial_counts, partial_indices = _lists(partial_q[~is_full], partial_k[~is_full], num_q, num_k)
    full_counts, full_indices = _lists(full_q, full_k, num_q, num_k)
    return BlockLists(partial_counts, partial_indices, full_counts, full_indices)


class FlexNeighborhoodAttention:
    """``plan``'s attention on patch-ordered ``[B, H, tokens, D]`` torch tensors by FlexAttention (compiled unless
    ``compile=False``): ``__call__(q, k, v)`` with q in the output grid's layout, k and v in the input grid's;
    ``kernel_options`` (an attribute) go to ``flex_attention`` as they are (None: Inductor's choice)."""

    def __init__(self, plan, device, compile: bool = True):
        import torch
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        self.q_layout = patch_layout(plan.nlat_out, plan.nlon_out)
        self.k_layout = patch_layout(plan.nlat_in, plan.nlon_in)
        lists = block_lists(plan, self.q_layout, self.k_layout)
        lo, length = segment_lookup(plan)
        residues, shift = plan.forward_segments.residues, plan.forward_segments.shift
        nlat_k, nlon_k = plan.nlat_in, plan.nlon_in

        def tensor(x, dtype=None):  # int32 for indices, bool for masks
            dtype = dtype or (torch.bool if x.dtype == bool else torch.int32)
            return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=device)

        q_lat, q_lon, q_valid = (tensor(x) for x in (self.q_layout.lat, self.q_layout.lon, self.q_layout.valid))
        k_lat, k_lon, k_valid = (tensor(x) for x in (self.k_layout.lat, self.k_layout.lon, self.k_layout.valid))
        lo, length = tensor(lo.ravel()), tensor(length.ravel())
        log_weight = tensor(np.log(np.asarray(plan.quad_weights, np.float64)), torch.float32)

        def mask_mod(b, h, q_idx, kv_idx):
            qh, qw, kr = q_lat[q_idx], q_lon[q_idx], k_lat[kv_idx]
            segment = (qh * nlat_k + kr) * residues + qw % residues
            start = lo[segment] + shift * (qw // residues)
            return ((k_lon[kv_idx] - start) % nlon_k < length[segment]) & k_valid[kv_idx] & q_valid[q_idx]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + log_weight[k_lat[kv_idx]]

        def batched(x):
            return tensor(x)[None, None]

        self.block_mask = BlockMask.from_kv_blocks(
            batched(lists.partial_counts), batched(lists.partial_indices),
            batched(lists.full_counts), batched(lists.full_indices),
            BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
            seq_lengths=(self.q_layout.tokens, self.k_layout.tokens),
        )  # fmt: skip
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.kernel_options: dict | None = None
        self._attend = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def __call__(self, q, k, v, scale: float | None = None):
        return self._attend(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask, scale=scale,
                            kernel_options=self.kernel_options)  # fmt: skip

    def to_tokens(self, x, layout: PatchLayout):
        """``[B, nlat, nlon, H, D]`` (torch) -> ``[B, H, tokens, D]`` in ``layout`` (padding: the grid's first
        point)."""
        flat = x.reshape(x.shape[0], -1, *x.shape[3:])
        index = np.asarray(layout.gather_index())
        return flat[:, index].permute(0, 2, 1, 3).contiguous()

    def from_tokens(self, y, layout: PatchLayout):
        """``[B, H, tokens, D]`` -> ``[B, nlat, nlon, H, D]`` (padding dropped)."""
        import torch

        order = np.flatnonzero(layout.valid)
        grid = np.argsort(layout.gather_index()[order], kind="stable")
        picked = y[:, :, torch.as_tensor(order[grid], device=y.device)]
        return picked.permute(0, 2, 1, 3).reshape(y.shape[0], layout.nlat, layout.nlon, y.shape[1], y.shape[3])


def flex_runs(plan, batch: int, heads: int, head_dim: int, dtype: str, reps: int, num_sets: int, time_ms):
    """Forward and forward+backward ms of FlexAttention on ``plan`` (CUDA, ``num_sets`` input sets already in
    patch order), torch's peak allocated bytes over the forward+backward and the KERNEL_OPTIONS entry that
    compiled (the first whose forward and backward do), or None without torch or CUDA; ``time_ms(fn, input_sets,
    reps)`` times a torch callable. Raises the last entry's error when none compiles."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    attention = FlexNeighborhoodAttention(plan, "cuda")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    generator = torch.Generator(device="cuda").manual_seed(0)
    q_real = torch.as_tensor(attention.q_layout.valid, device="cuda")[:, None]

    def randn(tokens, grad):
        x = torch.randn(batch, heads, tokens, head_dim, device="cuda", dtype=torch_dtype, generator=generator)
        return x.requires_grad_(grad)

    input_sets = []
    for _ in range(num_sets):
        q = randn(attention.q_layout.tokens, True)
        k, v = randn(attention.k_layout.tokens, True), randn(attention.k_layout.tokens, True)
        g = randn(attention.q_layout.tokens, False).float() * q_real  # no cotangent on padding rows
        input_sets.append((q, k, v, g))

    def forward(q, k, v, g):
        with torch.no_grad():
            return attention(q, k, v)

    def both(q, k, v, g):
        return torch.autograd.grad((attention(q, k, v).float() * g).sum(), (q, k, v))

    for options in KERNEL_OPTIONS:
        # Each plan and each entry compiles its own static-shape kernels (and stays under dynamo's cache limit).
        torch._dynamo.reset()
        attention.kernel_options = options
        try:  # compiles both here, so that a refusal is caught before the timing
            forward(*input_sets[0])
            both(*input_sets[0])
            torch.cuda.synchronize()
            break
        except Exception as e:  # noqa: BLE001  (Inductor's errors have no common public type)
            if options is KERNEL_OPTIONS[-1]:
                raise
            print(f"flex with kernel options {options}: {type(e).__name__}: {str(e)[:160]}; trying smaller tiles")
    fwd_ms = time_ms(forward, input_sets, reps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    both_ms = time_ms(both, input_sets, reps)
    return fwd_ms, both_ms, torch.cuda.max_memory_allocated(), options
