//! Process set-up shared by the binary and the benchmarks: allocator settings, Candle's thread
//! pool, and running the work on a rayon worker. Owns nothing else.

/// Keeps freed memory in the process instead of returning large blocks to the kernel: training
/// allocates and frees the same large tensors every step, and fresh pages from the kernel cost
/// a page fault and a zeroing each (measured: ~15 % of a training step). All threads share
/// one arena, which serialises allocation-heavy work on many threads: the binary leaves it
/// out for its text-only commands. Call first in `main`, before any other thread starts.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Candle runs its element-wise ops on a thread pool of its own whose idle threads spin on the
/// cores that the matrix products (rayon) need. nmt's hot element-wise work is in its own rayon
/// kernels, so unless the user sets it, Candle's pool is just the calling thread (measured:
/// training ~8 % faster on 2 cores, decoding unchanged). Call first in `main`, before any
/// thread exists that could read the environment.
pub fn one_candle_pool_thread() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// Runs `f` on one of rayon's worker threads. nmt's kernels and the matrix products split
/// their work with rayon; called from the main thread, which is not a worker, every such call
/// is handed over to the pool while the caller sleeps on a latch, a futex round trip per
/// kernel (decoding: ~45,000 futex calls for 500 lines). Called from a worker, a kernel's
/// halves are queued locally: the worker runs one and the other worker steals the rest.
pub fn on_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // Large stacks: Candle's backward pass walks the graph recursively. Fails only if the
    // pool already exists, which then serves as it is.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(64 << 20)
        .build_global();
    rayon::scope(|_| f())
}
