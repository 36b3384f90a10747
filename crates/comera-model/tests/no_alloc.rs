//! A steady-state training step (forward, loss, backward, the rank objective, clipping, AdamW)
//! allocates nothing:
//! the CPU counterpart of the paper's whole-step CUDA Graph. A counting global allocator
//! watches the steady-state steps (all after the first two).

use comera_model::{Encoder, EncoderConfig, HeadKind, LayerTt};
use comera_optim::{clip_scale_par, AdamW, AdamWConfig, ParamSums, RankConfig, RankController};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set on the pool's worker threads, which run the whole step. Allocations by other threads
    /// (the test harness's bookkeeping) are not the step's and are not counted.
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn count() {
    if COUNTED.with(|c| c.get()) {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn config(tt: bool, pre_ln: bool) -> EncoderConfig {
    EncoderConfig {
        seq_len: 32,
        layers: 2,
        dropout: 0.1,
        pre_ln,
        ..common::small_encoder(tt)
    }
}

/// The step runs on the pool's worker threads (as `comera train` does), so parallel work is
/// scheduled through the workers' own queues rather than injected from outside the pool.
#[test]
fn steady_state_training_steps_allocate_nothing() {
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .start_handler(|_| COUNTED.with(|c| c.set(true)))
            .build()
            .unwrap();
        pool.install(|| steps_allocate_nothing(threads));
    }
}

/// Steps per model: two to warm up, then the steady state.
const STEPS: usize = 8;

fn steps_allocate_nothing(threads: usize) {
    // The last flag fuses q/k/v and the FFN whatever the planner chose (too small here to
    // choose it).
    for (tt, pre_ln, mlm, fuse) in [
        (false, false, false, false),
        (true, false, false, false),
        (true, false, false, true),
        (true, true, false, true),
        (true, true, true, false),
        (false, false, true, false),
    ] {
        let mut cfg = config(tt, pre_ln);
        if mlm {
            cfg.head = HeadKind::Mlm;
            cfg.mlm_decoder_tt = LayerTt::uniform(&[4, 8], &[42, 50], 4);
        }
        let mut model = Encoder::new(&cfg, 1).unwrap();
        let (b, t) = (16usize, cfg.seq_len);
        let mut st = model.state(b);
        if fuse {
            assert_eq!(st.force_fused_qkv(&model), cfg.layers);
            assert_eq!(st.force_fused_ffn(&model), cfg.layers);
        }
        let mut opt = AdamW::new(AdamWConfig::default(), |f| model.visit_params_mut(f));
        let mut sums = ParamSums::default();
        // The rank objective on its gates (TT/TTM; a plain pass zeroing gate gradients for the
        // dense model), with the core-norm term, switching to the late stage at step 2.
        let rank_cfg = RankConfig {
            beta: 0.01,
            late_after_steps: 2,
            ..RankConfig::default()
        };
        let mut rank = RankController::new(&rank_cfg, &model);
        let ids: Vec<u32> = (0..b * t).map(|i| (i * 37 % 2100) as u32).collect();
        let types = vec![0u32; b * t];
        let mask: Vec<u32> = (0..b * t).map(|i| (i % t < t - 3) as u32).collect();
        let labels: Vec<usize> = (0..b).map(|i| i % 3).collect();
        // MLM: 4 labelled positions per sequence.
        let selected: Vec<u32> = (0..b * t)
            .filter(|i| i % t % 7 == 1)
            .map(|i| i as u32)
            .collect();
        let token_labels: Vec<i32> = (0..b * t)
            .map(|i| {
                if i % t % 7 == 1 {
                    (i * 13 % 2000) as i32
                } else {
                    -100
                }
            })
            .collect();
        // Allocations per step, split by phase: (load + zero_grad, forward, backward and the rank
        // objective, clip + AdamW).
        let mut counts = [[0usize; 4]; STEPS];
        for (step, phases) in counts.iter_mut().enumerate() {
            let a0 = ALLOCS.load(Ordering::SeqCst);
            if mlm {
                st.load_mlm(&ids, &mask, &token_labels, &selected).unwrap();
            } else {
                st.load(&ids, &types, &mask, &labels).unwrap();
            }
            model.zero_grad();
            let a1 = ALLOCS.load(Ordering::SeqCst);
            let s = model.forward(&mut st, true, step as u64).unwrap();
            assert!(s.loss.is_finite());
            let a2 = ALLOCS.load(Ordering::SeqCst);
            model.backward(&mut st);
            rank.apply(&mut model, s.loss, step as u64);
            let a3 = ALLOCS.load(Ordering::SeqCst);
            let (scale, _) = clip_scale_par(1.0, &mut model, &mut sums);
            opt.step_par(1.0, scale, &mut model);
            let a4 = ALLOCS.load(Ordering::SeqCst);
            *phases = [a1 - a0, a2 - a1, a3 - a2, a4 - a3];
        }
        let tag = format!("{threads} threads, tt={tt} pre_ln={pre_ln} mlm={mlm} fused qkv={fuse}: allocations per step (load, fwd, bwd, optim) {counts:?}");
        let c0 = ALLOCS.load(Ordering::SeqCst);
        std::hint::black_box(vec![0u8; 64]);
        assert!(
            ALLOCS.load(Ordering::SeqCst) > c0,
            "the counting allocator is in use"
        );
        // The steady state: every step after the first two.
        let per_step: Vec<usize> = counts[2..].iter().map(|c| c.iter().sum()).collect();
        if threads == 1 {
            assert!(per_step.iter().all(|&n| n == 0), "{tag}");
        } else {
            // With two workers the engine runs the same code, but when the threads race (seen
            // only with the machine under load) the scheduler allocates now and then: up to
            // three allocations in a step beside a CPU hog, in no fixed step, not growing with
            // the model. We attribute them to rayon's work stealing (its deques retire buffers
            // through crossbeam-epoch), not verified in detail. An allocation of the engine's
            // own would come back in every step, so the steady state must have steps that
            // allocate nothing, and few strays in all. One thread is exact, above.
            let clean = per_step.iter().filter(|&&n| n == 0).count();
            let stray: usize = per_step.iter().sum();
            assert!(clean >= per_step.len() / 2 && stray <= 8, "{tag}");
        }
    }
}
