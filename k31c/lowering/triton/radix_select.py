"""In-register selection for top-k (`topk.py`): the order-preserving key of a float score, a
5-bit-digit radix select over a register tensor, the candidate buffer's select by counting
passes before it (`select_kth_bracketed`), the sample's threshold by a value histogram
(`threshold_by_value`), the gathers that compact live values and the exclusive scans that give
them their slots (`exclusive_scan`), and the one-program exact select over a whole row.

The in-register selects use 5-bit digits: tl.histogram costs about one ballot per bit and one
popcount per owned bin, so 32 bins (one per lane) are ~7x cheaper per key than 256; a counting
pass costs two compares a key, so the large buffer is narrowed by passes and only the few keys
left pay digit levels. The whole-row select (the rare case where a sampled threshold misjudged
the row) reads the row in tiles and uses 8-bit digits, 4 passes.
"""
import triton
import triton.language as tl


@triton.jit
def order_key(x):
    """fp32 → uint32 whose unsigned order is the float order (torch.sort's, NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) | -0x80000000)).to(tl.uint32, bitcast=True)  # negatives: all bits flipped; else the sign
    key = tl.where(x == 0.0, tl.full(key.shape, 0x80000000, tl.uint32), key)  # -0.0 ties with +0.0
    return tl.where(x != x, tl.full(key.shape, 0xFFFFFFFF, tl.uint32), key)


@triton.jit
def key_float(key):
    """The fp32 whose order key is the uint32 `key` (order_key's inverse on the keys it yields;
    the NaN key and the key of no score give a NaN or -0.0)."""
    bits = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bit_length(x):
    """Bits the uint32 scalar x needs (0 for 0)."""
    n = tl.zeros((), tl.int32)
    for s in tl.static_range(5):        # steps of 16, 8, 4, 2, 1 bits
        n = tl.where((x >> (n + (16 >> s)).to(tl.uint32)) != 0, n + (16 >> s), n)
    return tl.where(x != 0, n + 1, 0)


@triton.jit
def _common_bits(val, live, SKIP_COMMON: tl.constexpr):
    """(top, prefix): the low bits the digits must cover and the bits above them, which every
    live value shares (SKIP_COMMON: found by a min and a max; else all 32 bits, prefix 0)."""
    top = tl.full((), 32, tl.int32)
    prefix = tl.zeros((), tl.uint32)
    if SKIP_COMMON:
        lo = tl.min(tl.where(live, val, tl.full(val.shape, 0xFFFFFFFF, tl.uint32)), 0)
        hi = tl.max(tl.where(live, val, tl.zeros_like(val)), 0)
        top = bit_length(lo ^ hi)
        sh = tl.minimum(top, 31).to(tl.uint32)
        prefix = tl.where(top >= 32, tl.zeros_like(lo), (lo >> sh) << sh)
    return top, prefix


@triton.jit
def _radix_level(val, live, krem, prefix, top, level):
    """One 5-bit digit level of `select_kth`: the digit holding the krem-th largest live value.
    Returns (live, krem, prefix, exact, n_best): the values with that digit, what is still to
    take among them, the prefix with the digit, whether all of them are taken, how many."""
    bins = tl.arange(0, 32)
    shift = tl.maximum(top - 5 * (level + 1), 0)    # the last level may hold fewer bits
    mask = (1 << (top - 5 * level - shift)) - 1
    digit = ((val >> shift.to(tl.uint32)) & mask.to(tl.uint32)).to(tl.int32)
    hist = tl.histogram(digit, 32, mask=live)
    suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist        # live values with digit >= d
    best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
    krem -= tl.sum(tl.where(bins > best, hist, 0), 0)
    prefix = prefix | (best.to(tl.uint32) << shift.to(tl.uint32))
    n_best = tl.sum(tl.where(bins == best, hist, 0), 0)
    return live & (digit == best), krem, prefix, n_best == krem, n_best


@triton.jit
def select_kth(val, live, krem, LEVELS: tl.constexpr, SKIP_COMMON: tl.constexpr = False):
    """Radix select over a register tensor of uint32 values, 5-bit digits from the top, LEVELS
    levels (5: the top 25 bits; 7: all 32). Returns (t, krem, exact): exact → exactly krem of
    the live values are >= t (t a digit boundary); else t is the value to LEVELS digits and krem
    of the live values equal to it (to those digits) are still to take. Needs krem <= #live.
    SKIP_COMMON: the digits start below the highest bit where the live values differ (a min and
    a max first; the bits above it are every live value's, so their levels would keep all)."""
    krem = tl.zeros((), tl.int32) + krem       # a tensor: the JIT passes an integer 1 as a constant
    top, prefix = _common_bits(val, live, SKIP_COMMON)
    levels = tl.minimum((top + 4) // 5, LEVELS)
    level = 0
    exact = level < 0
    while (level < levels) & (exact == 0):
        live, krem, prefix, exact, _ = _radix_level(val, live, krem, prefix, top, level)
        level += 1
    return prefix, krem, exact


@triton.jit
def _tail_pivot(a, b, ca, cb, beta, t):
    """The key at or above which about t live keys lie, given ca at or above key a and cb at or
    above key b > a: log-linear in the count between a and b once cb > 0, else an exponential
    tail of mean excess beta above a (the excess over a high threshold is near exponential)."""
    xa = key_float(a.to(tl.uint32))
    xb = key_float(tl.minimum(b, 0xFFFFFFFF).to(tl.uint32))
    ln_t = tl.log(ca.to(tl.float32) / t.to(tl.float32))
    ln_b = tl.log(ca.to(tl.float32) / tl.maximum(cb, 1).to(tl.float32))
    return order_key(xa + tl.where(cb > 0, (xb - xa) * (ln_t / ln_b), beta * ln_t)).to(tl.int64)


@triton.jit
def select_kth_bracketed(x, key, live, n_live, lo, krem, few_ptr, FEW: tl.constexpr, PTX: tl.constexpr,
                         PASSES: tl.constexpr = 4):
    """`select_kth(key, live, krem, 7, SKIP_COMMON=True)` for the order keys `key` of the fp32
    scores `x`, n_live of them live, all at or above the key `lo` (int64; 0: not known, their
    minimum is taken) (a result of the same meaning: an exact t may be another digit boundary),
    priced per candidate buffer slot by counts, not digit histograms. Up to PASSES passes each
    count the live keys at or above two pivots placed about FEW/3 ranks either side of the
    krem-th by an exponential-tail model of the scores (their mean excess over lo), narrowing a
    key interval [a, b) that holds it; once at most FEW live keys lie in it (usually after one
    pass: benchmarks/topk_passes.py) they are gathered through `few_ptr` (FEW int32 of scratch)
    and radix-selected; else 5-bit levels narrow them first. A pass costs per slot two compares where
    a level costs a histogram."""
    krem = tl.zeros((), tl.int32) + krem
    keym = tl.where(live, key, 0)             # dead slots lie below every pivot (pivots > a >= 0)
    ca = tl.zeros((), tl.int32) + n_live      # live keys >= a
    cb = tl.zeros((), tl.int32)               # live keys >= b
    a = tl.zeros((), tl.int64) + lo
    if a == 0:
        a = tl.min(tl.where(live, key, 0xFFFFFFFF), 0).to(tl.int64)
    b = tl.full((), 1 << 32, tl.int64)
    beta = tl.sum(tl.where(live, x, 0.0), 0) / ca.to(tl.float32) - key_float(a.to(tl.uint32))
    n = 0
    while (ca - cb > FEW) & (n < PASSES):
        p1 = _tail_pivot(a, b, ca, cb, beta, tl.minimum(krem + FEW // 3, ca))
        p1 = tl.minimum(tl.maximum(p1, a + 1), b - 1)
        p2 = _tail_pivot(a, b, ca, cb, beta, tl.maximum(krem - FEW // 3, tl.maximum(cb, 1)))
        p2 = tl.minimum(tl.maximum(p2, p1), b - 1)
        c = tl.sum(tl.where(keym >= p1.to(tl.uint32), 1, 0) + tl.where(keym >= p2.to(tl.uint32), 0x10000, 0), 0)
        c1 = c & 0xFFFF                       # two counts of at most 8,192 in one sum
        c2 = c >> 16
        above1 = c1 >= krem
        above2 = c2 >= krem
        b, cb = tl.where(above2, b, tl.where(above1, p2, p1)), tl.where(above2, cb, tl.where(above1, c2, c1))
        a, ca = tl.where(above2, p2, tl.where(above1, p1, a)), tl.where(above2, c2, tl.where(above1, c1, ca))
        n += 1
    live = live & (keym >= a.to(tl.uint32)) & (keym <= (b - 1).to(tl.uint32))
    krem -= cb
    n_live = ca - cb
    t = tl.zeros((), tl.uint32)
    exact = n_live < 0
    gather = n_live <= FEW
    if n_live > FEW:                          # the passes left too many: levels first
        top, prefix = _common_bits(key, live, True)
        levels = tl.minimum((top + 4) // 5, 7)
        level = 0
        while (level < levels) & (exact == 0) & (n_live > FEW):
            live, krem, prefix, exact, n_live = _radix_level(key, live, krem, prefix, top, level)
            level += 1
        t = prefix
        gather = (exact == 0) & (level < levels)
    if gather:                                # at most FEW keys left to tell apart
        few, few_live = gather_live(key, live, scan_slots(live), n_live, few_ptr, FEW, PTX)
        t, krem, exact = select_kth(few, few_live, krem, 7, SKIP_COMMON=True)
    # an exact t is a boundary of the interval's keys alone: keys below a lie below it too
    return tl.maximum(t, a.to(tl.uint32)), krem, exact


@triton.jit
def threshold_by_value(x, rank, N: tl.constexpr, GROUP: tl.constexpr = 4, PASSES: tl.constexpr = 3):
    """A value p with about `rank` of the N fp32 values x above it (rank - rank / 8 to rank +
    rank / 8 of them), priced by one histogram and counts, where the exact select takes five
    digit levels or more: 32 bins linear in value (`_value_bins`). Where rank <= N / (16 GROUP)
    the bins are over the maxima of groups of GROUP values, a GROUP-th of the histogram work:
    the rank largest values then lie in about rank groups (rank^2 (GROUP - 1) / 2N groups hold
    two, under rank / 32). Returns (p, found); not found (a NaN
    or an inf among x, the rank-th among masses of equal values, too few values above the
    mean) leaves the exact select to the caller."""
    ok = (tl.abs(tl.sum(x, 0)) < float("inf")) & (rank > 0)      # a NaN or an inf makes the sum NaN or inf
    if rank * (16 * GROUP) <= N:
        p, found = _value_bins(tl.max(tl.reshape(x, [N // GROUP, GROUP], can_reorder=True), 1), rank, ok,
                               N // GROUP, PASSES)
    else:
        p, found = _value_bins(x, rank, ok, N, PASSES)
    count = tl.sum((x > p).to(tl.int32), 0)
    return p, found & (count >= rank - rank // 8) & (count <= rank + rank // 8)


@triton.jit
def _value_bins(v, rank, ok, N: tl.constexpr, PASSES: tl.constexpr):
    """`threshold_by_value` over the N values v: 32 bins linear in value over [the mean (the
    minimum if rank > N / 4), the maximum], p interpolated inside the bin that holds the
    rank-th largest, then counted; a bin that misjudges it (values bunched inside the bin) is
    zoomed into, up to PASSES histograms."""
    lo = tl.where(4 * rank <= N, tl.sum(v, 0) / N, tl.min(v, 0))
    hi = tl.max(v, 0)
    ok = ok & (hi > lo)
    bins = tl.arange(0, 32)
    p = lo
    found = rank < 0
    n = 0
    while ok & (found == 0) & (n < PASSES):
        w = (hi - lo) / 32
        digit = tl.minimum(tl.maximum(((v - lo) / w).to(tl.int32), 0), 31)
        hist = tl.histogram(digit, 32, mask=v > lo)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist        # values above lo with digit >= d
        best = tl.max(tl.where(suffix >= rank, bins, 0), 0)
        in_best = tl.sum(tl.where(bins == best, hist, 0), 0)
        at_best = tl.sum(tl.where(bins == best, suffix, 0), 0)
        # the bin's values spread evenly: its top (rank - values above it) lie above p
        p = lo + w * (best.to(tl.float32) + (at_best - rank).to(tl.float32) / tl.maximum(in_best, 1).to(tl.float32))
        count = tl.sum((v > p).to(tl.int32), 0)
        found = (at_best >= rank) & (count >= rank - rank // 8) & (count <= rank + rank // 8)
        lo, hi = lo + w * best.to(tl.float32), lo + w * (best + 1).to(tl.float32)    # zoom into the bin
        ok = (at_best >= rank) & (hi > lo)
        n += 1
    return p, found


@triton.jit
def gather_live(val, live, slot, n_live, few_ptr, FEW: tl.constexpr, PTX: tl.constexpr):
    """The n_live <= FEW live uint32 values of a register tensor, compacted through `few_ptr` (FEW
    int32 of scratch) into a FEW-slot tensor, each live value to its `slot` (distinct, below
    n_live: `scan_slots` or `live_slots`): (values, which slots hold one)."""
    store_where(few_ptr + slot, val.to(tl.int32, bitcast=True), live, PTX)
    tl.debug_barrier()       # every thread's gathered values are visible to the block
    j = tl.arange(0, FEW)
    few = tl.load(few_ptr + j, mask=j < n_live, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    return few, j < n_live


@triton.jit
def exclusive_scan(x):
    """Exclusive prefix sums of a 1-D int32 tensor of N (a power of two) elements, as rows of 32:
    a scan along each row, then one over the row totals. Triton's scan of the 1-D tensor has
    every thread add up every warp's partial sums from shared memory; this form reads a few
    (the refine's two 8,192-slot scans: BENCHMARKS.md, top-k)."""
    N: tl.constexpr = x.shape[0]
    C: tl.constexpr = min(N, 32)
    x2 = tl.reshape(x, [N // C, C])
    tot = tl.sum(x2, 1)
    y2 = (tl.cumsum(tot, 0) - tot)[:, None] + tl.cumsum(x2, 1) - x2
    return tl.reshape(y2, [N])


@triton.jit
def scan_slots(live):
    """Slots 0 .. (live count - 1) for the live elements of a 1-D tensor, in their order (an
    exclusive scan)."""
    return exclusive_scan(live.to(tl.int32))


def warp_slots_ptx(live: str, counter: str, slot: str) -> str:
    """PTX that gives the warp's lanes with predicate `live` distinct slots (into register `slot`)
    from the u32 counter at address operand `counter`: one ballot ranks them, the first live lane
    takes their slots with one atomic add and shuffles the base to the others. In a scope of its
    own, so callers can embed it (indexer_ws_filter's overflow path)."""
    return f"""{{
    .reg .pred lead;
    .reg .b32 b, below, rank, n, base, first;
    vote.sync.ballot.b32 b, {live}, 0xffffffff;
    mov.u32 below, %lanemask_lt;
    and.b32 below, below, b;
    popc.b32 rank, below;
    popc.b32 n, b;
    brev.b32 first, b;
    bfind.shiftamt.u32 first, first;
    setp.eq.and.u32 lead, rank, 0, {live};
    mov.u32 base, 0;
    @lead atom.global.add.u32 base, [{counter}], n;
    shfl.sync.idx.b32 base, base, first, 0x1f, 0xffffffff;
    add.u32 {slot}, base, rank;
    }}"""


# $0: a distinct slot for each lane whose $2 is not 0, from the counter at $1
WARP_SLOTS_PTX = tl.constexpr("""{
    .reg .pred p;
    setp.ne.b32 p, $2, 0;
    """ + warp_slots_ptx("p", "$1", "$0") + """
}""")


@triton.jit
def live_slots(live, ctr_ptr, PTX: tl.constexpr):
    """Distinct slots 0 .. (live count - 1) for the live elements of a tensor, in no set order,
    taken from an int32 counter at `ctr_ptr` that it zeroes first (every thread of the program
    calls it): an atomic add per live element, or under PTX one per warp and register (a ballot
    ranks the warp's live lanes). For sparse masks (the plan's ~90 of 16K sampled keys), where
    `scan_slots`' cross-warp step costs per register held whether live or not; with many live
    the adds queue on the one address and the scan is faster (BENCHMARKS.md)."""
    tl.store(ctr_ptr, 0)
    tl.debug_barrier()       # the zero reaches every thread's adds
    live_i = live.to(tl.int32)
    ctr = ctr_ptr + tl.zeros_like(live_i)
    if PTX:
        return tl.inline_asm_elementwise(WARP_SLOTS_PTX, "=r,l,r", [ctr, live_i], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        return tl.atomic_add(ctr, 1, mask=live, sem="relaxed")


@triton.jit
def sample_position(i, n, SAMPLES: tl.constexpr, RUN: tl.constexpr):
    """Position of sample i of a row of n keys: runs of RUN spread evenly (a row shorter than
    the sample repeats positions)."""
    return tl.minimum((i // RUN).to(tl.int64) * n // (SAMPLES // RUN) + i % RUN, n - 1).to(tl.int32)


@triton.jit
def store_where(ptr, val, mask, PTX: tl.constexpr):
    """Store int32 `val` at `ptr` where `mask`. PTX: as an inline st.global, an elementwise op, so
    the operands keep their register layout (Triton lays a tl.store whose addresses are data out
    one element a thread, which costs a trip through shared memory per operand)."""
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def write_selected(out_row, base, pos, sel, PTX: tl.constexpr = False):
    """Write the selected positions of a tile to out_row[base:], in order; returns how many."""
    seli = sel.to(tl.int32)
    store_where(out_row + base + exclusive_scan(seli), pos, sel, PTX)
    return tl.sum(seli, 0)


@triton.jit
def take_top_ties(row, lo, hi, thresh, take, out_row, base, src_ptr, src_stride, TILE: tl.constexpr):
    """Write the `take` highest positions in [lo, hi) whose key == thresh to out_row[base:]
    (one program, reading tiles from the top down); returns the new base."""
    top = hi
    while (take > 0) & (top > lo):
        pos = top - TILE + tl.arange(0, TILE)
        live = (pos >= lo) & (pos < top)
        key = order_key(tl.load(src_ptr + row.to(tl.int64) * src_stride + pos, mask=live, other=0.0))
        tie = (live & (key == thresh)).to(tl.int32)
        sel = (tie > 0) & (tl.sum(tie, 0) - tl.cumsum(tie, 0) < take)    # ties above it in the tile
        n = write_selected(out_row, base, pos, sel)
        base += n
        take -= n
        top -= TILE
    return base


@triton.jit
def select_from_row(row, n, k, out_row, src_ptr, src_stride, TILE: tl.constexpr):
    """Exact top-k of a whole row by one program: 4 passes of 8-bit digit histograms find the
    k-th key, one pass writes the keys above it, the ties at it come from the top down."""
    src_row = src_ptr + row.to(tl.int64) * src_stride
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.uint32)
    krem = k
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        hist = tl.zeros([256], tl.int32)
        for start in range(0, n, TILE):
            pos = start + tl.arange(0, TILE)
            key = order_key(tl.load(src_row + pos, mask=pos < n, other=0.0))
            match = pos < n
            if level > 0:
                match = match & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        best = tl.max(tl.where(suffix >= krem, bins, 0), 0)
        krem -= tl.sum(tl.where(bins > best, hist, 0), 0)
        prefix = prefix | (best.to(tl.uint32) << shift)
    base = 0
    for start in range(0, n, TILE):       # prefix is the k-th key: everything above it
        pos = start + tl.arange(0, TILE)
        key = order_key(tl.load(src_row + pos, mask=pos < n, other=0.0))
        sel = (pos < n) & (key > prefix)
        base += write_selected(out_row, base, pos, sel)
    take_top_ties(row, 0, n, prefix, krem, out_row, base, src_ptr, src_stride, TILE)
