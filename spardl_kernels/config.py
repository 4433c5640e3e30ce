"""Every tunable of the kernels, in one place.

The CPU wrappers read these names at call time and pass them to the compiled workers as
arguments, so a test can patch them (``monkeypatch.setattr(config, "SMALL_N_CUTOFF", 0)``) and
reach the code path it wants without recompiling. The CUDA twins read the ``CUDA_*`` names.
"""

# --- radix select (topk_abs, kth_largest_abs) -------------------------------------------------
# The select works on "keys": the bit pattern of |x| as a signed integer of x's width, sign bit
# cleared (so -0.0 -> 0), every NaN mapped to one key just above +inf. Keys sort like |x|.
# Digit widths from the most significant key bit down; they add up to the key width
# (15 bits for float16, 31 for float32, 63 for float64). The first digit is histogrammed over
# all of x; later digits only over the candidates that share the winning first digit, which is
# why the first digit is chosen to cover the exponent (plus a few mantissa bits): gradients span
# a few dozen binades, so the winning bucket holds a small fraction of x.
RADIX_DIGITS = {
    "float16": (10, 5),
    "float32": (11, 10, 10),
    "float64": (12, 13, 13, 13, 12),
}
# Independent sub-histograms for the first pass: consecutive elements land in different
# counter arrays, so runs of equal keys (exact zeros are common in gradients) do not serialise
# on one counter's store-to-load latency.
HIST_LANES = 4
# At or below this n, topk_abs/kth_largest_abs use a stable sort of the keys instead of the radix
# passes (zeroing the histograms would cost more than the work).
SMALL_N_CUTOFF = 512

# Sampled window (Floyd-Rivest style) in front of the radix select: a strided sample of
# clamp(n // 128, WINDOW_SAMPLE_MIN, WINDOW_SAMPLE_MAX) keys brackets the k-th largest key by
# the sample ranks k*s/n -/+ (WINDOW_SIGMAS * sqrt(k*s/n + 1) + 2); then ONE pass over x writes
# the indices above the bracket and collects the few inside it. The bracket is verified exactly
# (count above < k <= count above + inside); if it missed, the exact radix passes run instead,
# so the result never depends on the sample, only the time does.
WINDOW_SELECT = True
WINDOW_MIN_N = 1 << 15
WINDOW_SAMPLE_MIN = 1024
WINDOW_SAMPLE_MAX = 16384
WINDOW_SIGMAS = 4.0

# --- streaming stores (accumulate_topk, accumulate_above) --------------------------------------
# From this many bytes of X, the summing pass writes X = g + E with non-temporal stores, in
# blocks of 64 sums from X's first 64-byte boundary on: the stores go to
# memory without first reading each line into the cache, one stream of the pass's four fewer
# (an error-feedback step at n = 25 M float32 took 0.77-0.80 of its time with them,
# docs/performance.md, "An AVX-512 machine").
# Below it X is written normally and stays in the cache for the reads that follow it (where the
# break-even lies was not measured; 32 MiB is far above an L2 and below the n = 25 M tested).
STREAM_STORE_MIN_BYTES = 32 << 20

# --- CPU threads (select_above, count_above, merge_add) -----------------------------------------
# Threads of the multithreaded CPU workers. None: Numba's current setting (numba.get_num_threads(),
# NUMBA_NUM_THREADS by default), capped under an MPI launcher at the process's cores divided by
# the ranks on its node (cpu._common.node_share: ranks x threads above the core count makes every
# parallel call wait on descheduled threads); an int is used as given, capped by
# NUMBA_NUM_THREADS. Each thread takes one contiguous part of the input and the parts are joined
# in order, so results are identical for every thread count.
CPU_THREADS = None
# Below these sizes the serial workers run (waking the thread pool costs more than it saves):
# n for select_above/count_above, len(ia) + len(ib) for merge_add.
SELECT_PARALLEL_MIN_N = 1 << 18
# The threaded merge_add is off by default (2**62): on a 2-core machine its merge
# loop took 0.5 ms for 2 x 250,000 pairs against 1.0 ms on one thread, but waking the pool and
# moving the parts over the gaps made whole calls slower than the serial path (docs/performance.md,
# "Kernels"). Set e.g. 1 << 16 on a machine with idle cores.
MERGE_PARALLEL_MIN = 1 << 62

# --- select_above ------------------------------------------------------------------------------
# select_above writes (index, value) pairs in one pass, chunk by chunk, with a branch-free store;
# room in the output buffer is checked once per chunk of this many elements.
SELECT_CHUNK = 4096
# Capacity of the output buffer of each part, as a fraction of its length (plus one chunk). When
# a part holds more hits, the call is redone once with room for every element (lazily committed).
SELECT_INITIAL_FRACTION = 1.0 / 32.0

# --- estimate_threshold ------------------------------------------------------------------------
# DGC (arXiv 1712.01887) samples 0.1%-1% of the gradient. Default sample size:
# max(THRESHOLD_SAMPLE_MIN, ceil(THRESHOLD_SAMPLE_FRACTION * n)), capped at n (then exact).
THRESHOLD_SAMPLE_FRACTION = 0.01
THRESHOLD_SAMPLE_MIN = 4096

# --- CUDA twins (read by spardl_kernels.cuda) --------------------------------------------------
CUDA_THREADS_PER_BLOCK = 256
# Threads per block of the histogram kernels of the radix select (one shared-memory histogram
# per block).
CUDA_HIST_THREADS_PER_BLOCK = 512
# Upper bound on blocks launched by grid-stride kernels (0 = as many as the data needs).
CUDA_MAX_BLOCKS = 1024
# Elements per thread in the tiled CUDA kernels (compaction of select_above/topk_abs, scans):
# a block handles tiles of CUDA_THREADS_PER_BLOCK * CUDA_ITEMS_PER_THREAD elements.
CUDA_ITEMS_PER_THREAD = 8
# Digit width (bits) of the CUDA radix select: one histogram pass over x per digit, from the
# most significant key bit down (float32 keys: 31 bits = 7 + 8 + 8 + 8, four passes).
CUDA_RADIX_BITS = 8
# Digit width (bits) of the stable LSD radix sort of indices used by the CUDA coalesce,
# scatter_add and balanced_bounds; passes = ceil(bit_length(max index) / this).
CUDA_SORT_RADIX_BITS = 8
