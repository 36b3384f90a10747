//! A graceful stop: the first SIGINT (Ctrl-C) or SIGTERM asks the training loop to stop after
//! the step it is running, with a checkpoint at that step (so `--resume` continues bit for bit
//! as if nothing had happened); a second one ends the process at once, with the shell's status
//! for that signal (128 + its number: 130 for SIGINT, 143 for SIGTERM).
//!
//! The library never installs handlers by itself: a front end that owns the process (the CLI)
//! calls [`install`]; an embedding program may instead call [`request`] from its own handler.
//! The loop polls [`requested`] between steps, never inside one, so a step is never cut short.

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal whose stop was asked for (0: none).
static REQUESTED: AtomicI32 = AtomicI32::new(0);

/// Installs the handlers of SIGINT and SIGTERM (once per process; later calls do nothing new).
pub fn install() -> std::io::Result<()> {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    let mut result = Ok(());
    INSTALLED.call_once(|| {
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            // SAFETY: the handler only swaps an atomic and, on a second signal, calls `_exit`
            // (signal_hook's `low_level::exit`): both async-signal-safe.
            let r = unsafe {
                signal_hook::low_level::register(signal, move || {
                    if REQUESTED.swap(signal, Ordering::SeqCst) != 0 {
                        signal_hook::low_level::exit(128 + signal);
                    }
                })
            };
            if let Err(e) = r {
                result = Err(e);
                return;
            }
        }
    });
    result
}

/// Asks the loop to stop after its current step, as the first `signal` would.
pub fn request(signal: i32) {
    REQUESTED.store(signal, Ordering::SeqCst);
}

/// The signal that asked for a stop, if one did.
pub fn requested() -> Option<i32> {
    match REQUESTED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name (`SIGINT`), or its number.
pub fn signal_name(signal: i32) -> String {
    match signal {
        signal_hook::consts::SIGINT => "SIGINT".into(),
        signal_hook::consts::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}
