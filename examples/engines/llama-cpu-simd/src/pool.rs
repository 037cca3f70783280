//! A persistent team of worker threads for the row-split products and the batched attention.
//!
//! A decode step hands out about 25 products per token, each a few tens of microseconds on two
//! threads. A fork-join pool whose idle workers sleep pays a wake-up (a futex call, several
//! microseconds, more on a virtual machine) per product; here idle workers spin for a while
//! ([`SPIN`]) on the team's state before they park, so that a product issued within that time
//! starts on every thread at once, and the calling thread takes its share of the tasks too.
//!
//! The state is one 64-bit word: epoch (32 bits) | task count (16) | next unclaimed task (16).
//! A participant claims task `i` by a compare-and-swap from `(epoch, n, i)` to `(epoch, n, i + 1)`,
//! so a thread that read an earlier epoch can never run a task of a later one, and the job (a
//! closure on the caller's stack) is read only after a claim, while the caller still waits for
//! that task. The caller returns once every task has finished.
//!
//! Thread count: `RAYON_NUM_THREADS` (the variable profile_engine and the harness set for every
//! engine), else one per CPU.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins on the state before it parks. Longer than the serial work
/// between two products of a step (attention, norms: tens of microseconds), shorter than the gap
/// between requests of a server, so that an idle engine does not hold a core.
const SPIN: Duration = Duration::from_micros(200);

/// Most tasks of one call (the width of the task fields of the state).
pub(crate) const MAX_TASKS: usize = u16::MAX as usize;

/// The job of one epoch: a closure called with every task index in 0..tasks.
struct Job {
    f: *const (dyn Fn(usize) + Sync),
}

struct Shared {
    /// epoch << 32 | tasks << 16 | next.
    state: AtomicU64,
    /// Tasks of the current epoch that have finished.
    done: AtomicUsize,
    /// The current epoch's job (valid while its epoch has unfinished tasks).
    job: AtomicPtr<Job>,
    /// Whether a task of the current epoch panicked.
    panicked: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

fn epoch(s: u64) -> u64 {
    s >> 32
}

fn tasks(s: u64) -> usize {
    ((s >> 16) & 0xffff) as usize
}

fn next(s: u64) -> usize {
    (s & 0xffff) as usize
}

impl Shared {
    /// Claim and run tasks of epoch `e` until none is left unclaimed.
    fn work(&self, e: u64) {
        loop {
            let s = self.state.load(Ordering::Acquire);
            if epoch(s) != e || next(s) >= tasks(s) {
                return;
            }
            if self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue;
            }
            // SAFETY: task next(s) of epoch e is claimed and not finished, so the caller of
            // epoch e is still waiting in `for_each` and its job is alive; the job was stored
            // before the state that this successful claim read.
            let f = unsafe { &*(*self.job.load(Ordering::Acquire)).f };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(next(s)))) {
                self.panicked.store(true, Ordering::Relaxed);
                // Dropping a payload can panic again (`panic_any` of a value whose Drop panics):
                // nothing may unwind between a claim and its count in `done`.
                std::mem::forget(payload);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }

    /// Wait (spin, then park) until the epoch differs from `seen` and return it; None on shutdown.
    fn wait(&self, seen: u64) -> Option<u64> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = epoch(self.state.load(Ordering::Acquire));
            if e != seen {
                return Some(e);
            }
            if self.shutdown.load(Ordering::Relaxed) {
                return None;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(128) && start.elapsed() > SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let e = loop {
            let e = epoch(self.state.load(Ordering::SeqCst));
            if e != seen || self.shutdown.load(Ordering::SeqCst) {
                break e;
            }
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        };
        drop(guard);
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        if self.shutdown.load(Ordering::SeqCst) { None } else { Some(e) }
    }
}

/// A team of `size - 1` worker threads plus whichever thread calls [`Team::for_each`].
pub(crate) struct Team {
    shared: Arc<Shared>,
    size: usize,
    /// One caller at a time; a call while another runs (or from inside a task) runs serially.
    caller: Mutex<()>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Team {
    /// A team of `size` threads (the caller counts as one; `size` 0 is taken as 1).
    pub(crate) fn new(size: usize) -> Team {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let size = size.max(1);
        // Built first, so that a failed spawn (a panic below) drops it and stops the workers
        // already started.
        let mut team = Team { shared, size, caller: Mutex::new(()), workers: Vec::with_capacity(size - 1) };
        for i in 1..size {
            let shared = Arc::clone(&team.shared);
            let worker = std::thread::Builder::new()
                .name(format!("engine-worker-{i}"))
                .spawn(move || {
                    let mut seen = 0;
                    while let Some(e) = shared.wait(seen) {
                        seen = e;
                        shared.work(e);
                    }
                })
                .expect("cannot start an engine worker thread");
            team.workers.push(worker);
        }
        team
    }

    /// Threads of the team, the caller included.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Call `f(i)` for every i in 0..tasks, spread over the team; returns when all have run.
    /// Tasks are claimed in index order by whichever thread is free.
    ///
    /// # Panics
    /// When a task panicked (after every task has finished), or when `tasks > MAX_TASKS`.
    pub(crate) fn for_each(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(tasks <= MAX_TASKS, "pool: at most {MAX_TASKS} tasks per call, got {tasks}");
        let guard = if self.size == 1 || tasks < 2 {
            None
        } else {
            match self.caller.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        };
        let Some(_guard) = guard else {
            (0..tasks).for_each(f);
            return;
        };
        let sh = &*self.shared;
        // SAFETY (lifetime): the job is read only by a thread that has claimed a task of this
        // epoch, and this call returns only after every task has finished.
        let f: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let mut job = Job { f };
        sh.job.store(&mut job, Ordering::Relaxed);
        sh.done.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        let e = epoch(sh.state.load(Ordering::Relaxed)).wrapping_add(1) & 0xffff_ffff;
        sh.state.store(e << 32 | (tasks as u64) << 16, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        sh.work(e);
        let start = Instant::now();
        let mut spins = 0u32;
        while sh.done.load(Ordering::Acquire) < tasks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(128) && start.elapsed() > SPIN {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        sh.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        assert!(!sh.panicked.load(Ordering::Relaxed), "pool: a task panicked");
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The process's team: `RAYON_NUM_THREADS` threads, else one per CPU; started on first use.
pub(crate) fn global() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Team::new(threads)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once_over_many_calls() {
        let team = Team::new(3);
        for tasks in [0, 1, 2, 3, 7, 64] {
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                team.for_each(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{tasks} tasks");
            }
        }
    }

    #[test]
    fn calls_after_the_workers_parked_still_run_every_task() {
        let team = Team::new(2);
        for _ in 0..3 {
            std::thread::sleep(SPIN * 5);
            let sum = AtomicUsize::new(0);
            team.for_each(10, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 45);
        }
    }

    #[test]
    fn concurrent_and_nested_callers_run_serially_and_correctly() {
        let team = Team::new(2);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        let sum = AtomicUsize::new(0);
                        team.for_each(8, &|i| {
                            let inner = AtomicUsize::new(0);
                            team.for_each(4, &|j| {
                                inner.fetch_add(j, Ordering::Relaxed);
                            });
                            sum.fetch_add(i + inner.load(Ordering::Relaxed), Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 28 + 8 * 6);
                    }
                });
            }
        });
    }

    /// A panic payload whose own Drop panics.
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("payload drop panics");
        }
    }

    /// A task on the calling thread that panics with such a payload: the call still returns only
    /// after the other thread's task (which reads the caller's stack) has finished.
    #[test]
    fn a_payload_that_panics_when_dropped_does_not_end_the_call_early() {
        let team = Team::new(2);
        let caller = std::thread::current().id();
        let (returned, late) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (r2, l2) = (returned.clone(), late.clone());
        let r = catch_unwind(AssertUnwindSafe(|| {
            let on_stack = [1u64; 16];
            team.for_each(2, &|_| {
                if std::thread::current().id() == caller {
                    std::thread::sleep(Duration::from_millis(5));
                    std::panic::panic_any(Bomb);
                } else {
                    std::thread::sleep(Duration::from_millis(100));
                    l2.store(r2.load(Ordering::SeqCst), Ordering::SeqCst);
                    std::hint::black_box(&on_stack);
                }
            });
        }));
        returned.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(200));
        assert!(r.is_err());
        assert!(!late.load(Ordering::SeqCst), "the call returned while a task still ran");
        // The same on whichever thread claims task 1 (the worker, mostly, while the caller sleeps
        // in task 0): reported, not a worker lost with its task uncounted (a hang).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let team = Team::new(2);
            let r = catch_unwind(AssertUnwindSafe(|| {
                team.for_each(2, &|i| {
                    if i == 1 {
                        std::panic::panic_any(Bomb);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                })
            }));
            let _ = tx.send(r.is_err());
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)), Ok(true), "the call did not finish");
    }

    #[test]
    fn a_panicking_task_is_reported_after_the_others_finish() {
        let team = Team::new(2);
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.for_each(6, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 3, "task 3 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 6);
        let sum = AtomicUsize::new(0);
        team.for_each(4, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 6, "the team works after a panic");
    }
}
