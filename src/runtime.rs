//! Process set-up shared by the binary and the benchmarks: allocator settings, Candle's thread
//! pool, running the work on a rayon worker and keeping its partners awake. Owns nothing else.

/// The allocator of every nmt program: mimalloc, whose per-thread heaps take no lock and hand
/// a freed block back, still in the cache, to the next allocation of its size. glibc's malloc
/// with one arena serialised the decoding workers on its lock, and with one arena per thread
/// still handed out colder memory (2 cores, int8 greedy search of 1,000 lines, 20 alternating
/// runs: 0.597 s with one glibc arena, 0.486 s with mimalloc; per-thread arenas 3–6 % below
/// one arena).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (v2's `mi_option_e`): how long freed memory waits
/// before it is returned to the kernel, in milliseconds; −1: never.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory in the process instead of returning it to the kernel: training
/// allocates and frees the same large tensors every step, and fresh pages from the kernel cost
/// a page fault and a zeroing each (measured with glibc: ~15 % of a training step; with
/// mimalloc's 10 ms default: yardstick training 2,580–2,840 target tokens/s against 2,965–3,204
/// kept; int8 greedy decoding 0.71 against 0.60 s median). Call first in `main`; the text-only
/// commands, which allocate small strings, leave it out, and those that load a model to decode
/// call [`keep_freed_memory_after_load`] instead.
pub fn keep_freed_memory() {
    // SAFETY: mi_option_set only changes an allocator tunable.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

/// For the commands that load a model and then decode (`translate`, `eval --model`,
/// `serve`), instead of [`keep_freed_memory`] first: returns to the kernel what loading freed
/// (the f32 copies of the layers packed for their kernels), then keeps freed memory from now
/// on. mimalloc keeps a freed page with the thread that freed it, and the decoding threads
/// are others: kept, those pages (~27 MB for the demo model) would stay resident unused.
/// Pages allocated while freed memory is kept are never returned, so this must come before
/// any `keep_freed_memory`. Measured on the demo model, int8, two workers, when the weights
/// file was still read whole: peak RSS 137 → 106 MB.
pub fn keep_freed_memory_after_load() {
    // SAFETY: mi_collect only frees what the allocator holds unused.
    unsafe { libmimalloc_sys::mi_collect(true) };
    keep_freed_memory();
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

/// Runs `f` on this rayon worker while the pool's other workers keep looking for work instead
/// of going to sleep. An idle rayon worker sleeps after ~30 empty rounds (tens of µs), and
/// each parallel section then starts on the calling thread alone until the sleeper is woken
/// and scheduled. A training step or a batch's search is hundreds of parallel sections with
/// short serial work between them, so for its duration each partner runs a job that executes
/// whatever work appears (`rayon::yield_now`) and spins otherwise, as OpenMP's threads
/// (PyTorch's) spin between parallel regions; once idle for a while it spins through
/// `sched_yield`, so that another process's thread still gets the core on a machine with
/// more threads than cores. Measured on 2 cores: training steps 2–12 % faster, `translate
/// --workers 1` 5–12 % (docs/performance.md, hypothesis 19). For work on `device` = the CPU
/// only (elsewhere `f` just runs): the partners' cores are taken while `f` runs.
pub fn with_partners_awake<R>(device: &candle_core::Device, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    thread_local!(static SPINNING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    let (Some(me), partners) = (
        rayon::current_thread_index(),
        rayon::current_num_threads() - 1,
    ) else {
        return f();
    };
    if partners == 0 || SPINNING.get() || !device.is_cpu() {
        return f();
    }
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        for _ in 0..partners {
            s.spawn(|_| {
                // A job left in the caller's own queue (no partner took it in time) or found
                // by a thread that already spins returns at once.
                if rayon::current_thread_index() == Some(me) || SPINNING.get() {
                    return;
                }
                SPINNING.set(true);
                let mut idle = 0u32;
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle = 0;
                    } else if idle < 64 {
                        idle += 1;
                        for _ in 0..32 {
                            std::hint::spin_loop();
                        }
                    } else {
                        // Idle for a while: let any other runnable thread have this core
                        // (returns at once when there is none), as OpenMP's spin does on a
                        // machine with more threads than cores.
                        std::thread::yield_now();
                    }
                }
                SPINNING.set(false);
            });
        }
        let r = f();
        done.store(true, Ordering::Release);
        r
    })
}

/// `n` thread pools sharing the cores of the pool this is called from (at least one thread
/// each), built once per process and count. Each runs one search at a time, as Marian's and
/// CTranslate2's CPU workers do: two searches of a batch each on one core beat one search
/// whose every kernel is split across both (measured: greedy decoding 9 %, int8 17 % faster
/// on 2 cores), since a split kernel waits for its slowest half and wakes the other thread.
pub fn worker_pools(n: usize) -> std::io::Result<std::sync::Arc<Vec<rayon::ThreadPool>>> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    type Pools = Arc<Vec<rayon::ThreadPool>>;
    static BUILT: OnceLock<Mutex<HashMap<usize, Pools>>> = OnceLock::new();
    let n = n.max(1);
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(pools) = built.get(&n) {
        return Ok(pools.clone());
    }
    let threads = (rayon::current_num_threads() / n).max(1);
    let pools: Pools = Arc::new(
        (0..n)
            .map(|i| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .stack_size(64 << 20)
                    .thread_name(move |t| format!("nmt-decode-{i}-{t}"))
                    .build()
                    .map_err(std::io::Error::other)
            })
            .collect::<std::io::Result<_>>()?,
    );
    built.insert(n, pools.clone());
    Ok(pools)
}

/// Searches to run at once by default: one per core of the pool this is called from, up to
/// 4 (beyond that, each search's batch is better split across cores than the windows of
/// input across more searches; not measured above 2 cores).
pub fn default_workers() -> usize {
    on_worker(rayon::current_num_threads).min(4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// With the partners awake the work is done as before and they are free afterwards: a
    /// join whose halves wait for each other completes (the spinning partner takes the
    /// other half), nested calls, a one-thread pool and a thread outside any pool run `f`
    /// as it is, and the pool's next job finds the partner.
    #[test]
    fn awake_partners_take_the_work_and_let_go() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let cpu = candle_core::Device::Cpu;
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            let squares = |n: u64| (0..n).into_par_iter().map(|i| i * i).sum::<u64>();
            let both_halves = || {
                let barrier = std::sync::Barrier::new(2);
                rayon::join(|| barrier.wait(), || barrier.wait());
            };
            for _ in 0..20 {
                pool.install(|| with_partners_awake(&cpu, both_halves));
                let sum = pool.install(|| with_partners_awake(&cpu, || squares(100_000)));
                assert_eq!(sum, (0..100_000u64).map(|i| i * i).sum::<u64>());
            }
            let nested =
                pool.install(|| with_partners_awake(&cpu, || with_partners_awake(&cpu, || 7)));
            assert_eq!(nested, 7);
            pool.install(both_halves);
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_eq!(
                one.install(|| with_partners_awake(&cpu, || squares(10))),
                285
            );
            assert_eq!(with_partners_awake(&cpu, || 3), 3);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("the work inside with_partners_awake did not finish within a minute");
    }

    /// `MI_OPTION_PURGE_DELAY` names the purge delay in the mimalloc that is linked: it reads
    /// the delay's default, 10 ms (or what the environment sets), where the options beside it
    /// in v2's list (eager-commit delay, NUMA nodes) default to 1 and 0.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        let expected = ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"]
            .iter()
            .find_map(|v| std::env::var(v).ok()?.parse().ok())
            .unwrap_or(10);
        // SAFETY: mi_option_get only reads an allocator tunable.
        assert_eq!(
            unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) },
            expected
        );
    }
}
