//! Untrusted model files and hostile process limits (issue 35, items 8 and 10): a model is
//! bounded before it is read (config sizes, memory estimates, archive members, label maps,
//! float settings), non-finite outputs are errors naming the cause, and a full disk, a file
//! size limit or an address-space limit end with exit status 1 and a message, never a panic,
//! an abort or a signal.

use crate::common::{s, tempdir, write_config, write_data};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

fn comera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_comera"));
    c.args(["--threads", "1"]);
    c
}

/// (exit code, stdout + stderr); -1 when a signal ended the process.
fn status_text(out: &Output) -> (i32, String) {
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn run(args: &[&str]) -> (i32, String) {
    status_text(&comera().args(args).output().unwrap())
}

/// Exit status 1 with `expect` in the output, and no sign of a crash.
fn assert_refused(code: i32, text: &str, expect: &str, case: &str) {
    assert_eq!(code, 1, "{case}: {text}");
    assert!(
        text.contains(expect),
        "{case}: expected `{expect}` in {text}"
    );
    for crash in ["panicked", "memory allocation", "stack backtrace"] {
        assert!(!text.contains(crash), "{case}: {text}");
    }
}

/// A finished small run (dense, 1 layer), its config and its Hugging Face export, made once
/// for all the tests of this file.
struct Base {
    config: PathBuf,
    run: PathBuf,
    hf: PathBuf,
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = tempdir("untrusted-base");
        let (data, vocab) = write_data(&dir);
        let config = write_config(&dir, &data, &vocab, false, "max_steps_per_epoch = 4");
        let (code, text) = run(&["train", "--config", s(&config), "--epochs", "1", "--quiet"]);
        assert_eq!(code, 0, "train: {text}");
        let run_dir = dir.join("run");
        let hf = dir.join("hf");
        let (code, text) = run(&["export", s(&run_dir), "--hf", s(&hf)]);
        assert_eq!(code, 0, "export --hf: {text}");
        Base {
            config,
            run: run_dir,
            hf,
        }
    })
}

/// A copy of directory `from` at `to` (flat: files only).
fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A copy of the base export with `config.json` field `key` set to `value`.
fn hf_with(dir: &Path, key: &str, value: serde_json::Value) -> PathBuf {
    let hf = dir.join(format!("hf-{key}"));
    copy_dir(&base().hf, &hf);
    let path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg[key] = value;
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    hf
}

#[test]
fn absurd_or_inconsistent_configs_are_refused_naming_the_field() {
    let dir = tempdir("untrusted-config");
    let cases = [
        ("hidden_size", serde_json::json!(1u64 << 40), "hidden_size"),
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000_000u64),
            "num_hidden_layers",
        ),
        // Within the width limit, beyond any machine's memory: refused with the figure.
        ("hidden_size", serde_json::json!(65536), "needs about"),
        ("id2label", serde_json::json!({}), "id2label"),
        ("id2label", serde_json::json!({"0": "neg"}), "id2label"),
        (
            "id2label",
            serde_json::json!({"1": "neg", "01": "pos"}),
            "id2label",
        ),
        (
            "id2label",
            serde_json::json!({"0": "neg", "2": "pos"}),
            "id2label",
        ),
        ("num_labels", serde_json::json!(3), "num_labels"),
        ("layer_norm_eps", serde_json::json!(1e30), "layer_norm_eps"),
        ("layer_norm_eps", serde_json::json!(1e-60), "layer_norm_eps"),
    ];
    for (key, value, expect) in cases {
        let case = format!("{key} = {value}");
        let hf = hf_with(&dir, key, value);
        let out = dir.join("imported");
        let (code, text) = run(&["import", "hf", s(&hf), "--out", s(&out)]);
        assert_refused(code, &text, expect, &case);
        assert!(text.contains("config.json"), "{case}: {text}");
        assert!(!out.exists(), "{case}: nothing written");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_saved_model_too_large_for_memory_or_without_labels_is_refused_before_it_is_built() {
    let dir = tempdir("untrusted-saved");
    let meta = std::fs::read_to_string(base().run.join("model.toml")).unwrap();
    // A model.toml claiming a width whose weights (4 TiB) exceed any machine's memory.
    let wide = dir.join("wide");
    copy_dir(&base().run, &wide);
    assert!(meta.contains("d_model = 16\n") && meta.contains("heads = 2\n"));
    std::fs::write(
        wide.join("model.toml"),
        meta.replace("d_model = 16\n", "d_model = 1048576\n"),
    )
    .unwrap();
    for args in [
        vec!["inspect", s(&wide)],
        vec!["eval", s(&wide)],
        vec!["predict", s(&wide), "good"],
    ] {
        let (code, text) = run(&args);
        assert_refused(code, &text, "needs about", &args.join(" "));
        assert!(text.contains("available"), "{args:?}: {text}");
    }
    // A classifier with no label names: refused naming the field, not an index panic.
    let unlabelled = dir.join("unlabelled");
    copy_dir(&base().run, &unlabelled);
    let start = meta.find("labels = [").unwrap();
    let end = start + meta[start..].find(']').unwrap() + 1;
    let text = format!("{}labels = []{}", &meta[..start], &meta[end..]);
    std::fs::write(unlabelled.join("model.toml"), text).unwrap();
    for args in [
        vec!["predict", s(&unlabelled), "good"],
        vec!["inspect", s(&unlabelled)],
    ] {
        let (code, text) = run(&args);
        assert_refused(code, &text, "labels", &args.join(" "));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// CRC-32 (IEEE) of `len` zero bytes followed by nothing, or of `data`.
fn crc32(data: impl Iterator<Item = u8>) -> u32 {
    let table: Vec<u32> = (0..256u32)
        .map(|i| {
            (0..8).fold(i, |c, _| {
                if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                }
            })
        })
        .collect();
    !data.fold(!0u32, |c, b| {
        table[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8)
    })
}

/// A raw deflate stream (one fixed-Huffman block) of `1 + 258·runs` zero bytes: a literal 0,
/// then `runs` copies of length 258 at distance 1 (13 bits each).
fn deflated_zeros(runs: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut n) = (0u32, 0u32);
    let mut bit = |b: u32, out: &mut Vec<u8>| {
        acc |= b << n;
        n += 1;
        if n == 8 {
            out.push(acc as u8);
            acc = 0;
            n = 0;
        }
    };
    // Huffman codes go most significant bit first, header fields least significant first.
    let code = |c: u32, len: u32, out: &mut Vec<u8>, bit: &mut dyn FnMut(u32, &mut Vec<u8>)| {
        for i in (0..len).rev() {
            bit((c >> i) & 1, out);
        }
    };
    bit(1, &mut out); // BFINAL
    bit(1, &mut out); // BTYPE = 01 (fixed Huffman), low bit first
    bit(0, &mut out);
    code(0x30, 8, &mut out, &mut bit); // literal 0
    for _ in 0..runs {
        code(0xC5, 8, &mut out, &mut bit); // length 258 (symbol 285)
        code(0, 5, &mut out, &mut bit); // distance 1
    }
    code(0, 7, &mut out, &mut bit); // end of block (symbol 256)
    for _ in 0..7 {
        bit(0, &mut out);
    }
    out
}

/// A zip archive of `(name, method, crc, compressed bytes, uncompressed size)` entries.
fn zip_archive(entries: &[(&str, u16, u32, Vec<u8>, u32)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, method, crc, data, size) in entries {
        let offset = out.len() as u32;
        let header = |sig: u32, central: bool| {
            let mut h = sig.to_le_bytes().to_vec();
            if central {
                h.extend(20u16.to_le_bytes()); // made by
            }
            h.extend(20u16.to_le_bytes()); // needed
            h.extend(0u16.to_le_bytes()); // flags
            h.extend(method.to_le_bytes());
            h.extend(0u16.to_le_bytes()); // time
            h.extend(0x21u16.to_le_bytes()); // date: 1980-01-01
            h.extend(crc.to_le_bytes());
            h.extend((data.len() as u32).to_le_bytes());
            h.extend(size.to_le_bytes());
            h.extend((name.len() as u16).to_le_bytes());
            h.extend(0u16.to_le_bytes()); // extra
            if central {
                h.extend([0u8; 6]); // comment length, disk, internal attributes
                h.extend(0u32.to_le_bytes()); // external attributes
                h.extend(offset.to_le_bytes());
            }
            h.extend(name.as_bytes());
            h
        };
        out.extend(header(0x0403_4b50, false));
        out.extend(data);
        central.extend(header(0x0201_4b50, true));
    }
    let (cd_offset, cd_size) = (out.len() as u32, central.len() as u32);
    out.extend(central);
    out.extend(0x0605_4b50u32.to_le_bytes());
    out.extend([0u8; 4]);
    out.extend((entries.len() as u16).to_le_bytes());
    out.extend((entries.len() as u16).to_le_bytes());
    out.extend(cd_size.to_le_bytes());
    out.extend(cd_offset.to_le_bytes());
    out.extend(0u16.to_le_bytes());
    out
}

#[test]
fn oversized_weights_in_a_zip_or_a_directory_are_refused_before_they_are_read() {
    let dir = tempdir("untrusted-bomb");
    let stored = |name: &'static str| {
        let bytes = std::fs::read(base().hf.join(name)).unwrap();
        let len = bytes.len() as u32;
        (name, 0u16, crc32(bytes.iter().copied()), bytes, len)
    };
    // 32 MiB of zeros as model.safetensors, about 420 KB deflated: far more than the tiny
    // config.json describes.
    let runs = 130_000;
    let size = 1 + 258 * runs;
    let bomb = (
        "model.safetensors",
        8u16,
        crc32(std::iter::repeat_n(0u8, size)),
        deflated_zeros(runs),
        size as u32,
    );
    let zip = dir.join("bomb.zip");
    std::fs::write(
        &zip,
        zip_archive(&[stored("config.json"), stored("vocab.txt"), bomb]),
    )
    .unwrap();
    let out = dir.join("imported");
    let (code, text) = run(&["import", "hf", s(&zip), "--out", s(&out)]);
    assert_refused(code, &text, "model.safetensors", "zip");
    assert!(text.contains("bytes allowed"), "zip: {text}");
    assert!(!out.exists());
    // The same in a directory: a sparse file, refused by its size before a byte is read.
    let hf = dir.join("hf");
    copy_dir(&base().hf, &hf);
    std::fs::File::create(hf.join("model.safetensors"))
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let (code, text) = run(&["import", "hf", s(&hf), "--out", s(&out)]);
    assert_refused(code, &text, "model.safetensors", "directory");
    assert!(text.contains("bytes allowed"), "directory: {text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn finite_weights_that_overflow_give_an_error_naming_the_cause() {
    let dir = tempdir("untrusted-overflow");
    let hf = dir.join("hf");
    copy_dir(&base().hf, &hf);
    // Every weight of the pooler and the classifier 3e38: finite, but sums of two overflow.
    let path = hf.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for name in ["bert.pooler.dense.weight", "classifier.weight"] {
        let range = &header[name]["data_offsets"];
        let (a, b) = (
            range[0].as_u64().unwrap() as usize,
            range[1].as_u64().unwrap() as usize,
        );
        for w in bytes[8 + n + a..8 + n + b].chunks_exact_mut(4) {
            w.copy_from_slice(&3e38f32.to_le_bytes());
        }
    }
    std::fs::write(&path, bytes).unwrap();
    let out = dir.join("imported");
    let (code, text) = run(&[
        "import",
        "hf",
        s(&hf),
        "--out",
        s(&out),
        "--config",
        s(&base().config),
    ]);
    assert_eq!(code, 0, "import: {text}");
    for args in [vec!["predict", s(&out), "good"], vec!["eval", s(&out)]] {
        let (code, text) = run(&args);
        assert_refused(code, &text, "not finite", &args.join(" "));
        assert!(text.contains("3.0e38"), "{args:?}: {text}");
        assert!(!text.contains("NaN\t"), "{args:?}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `comera --threads 1 ARGS` with standard output into `stdout`, run under `limit` (a resource
/// and its soft and hard value) when given.
fn run_limited(
    args: &[&str],
    stdout: std::fs::File,
    limit: Option<(libc::__rlimit_resource_t, u64)>,
) -> (i32, String) {
    let mut cmd = comera();
    cmd.args(args)
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::piped());
    if let Some((resource, value)) = limit {
        // SAFETY: setrlimit is async-signal-safe; it only lowers this child's own limit.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: value,
                    rlim_max: value,
                };
                if libc::setrlimit(resource, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    status_text(&cmd.output().unwrap())
}

fn dev_full() -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap()
}

#[test]
fn a_full_disk_under_standard_output_is_an_error_not_a_panic() {
    let dir = tempdir("untrusted-full");
    let r = s(&base().run);
    let cfg = dir.join("run.toml");
    let train_out = dir.join("run");
    std::fs::write(
        &cfg,
        std::fs::read_to_string(&base().config)
            .unwrap()
            .replace(s(&base().run), s(&train_out)),
    )
    .unwrap();
    let cases: [Vec<&str>; 4] = [
        vec!["predict", r, "good"],
        vec!["eval", r],
        vec!["inspect", r],
        vec!["train", "--config", s(&cfg), "--epochs", "1"],
    ];
    for args in cases {
        let (code, text) = run_limited(&args, dev_full(), None);
        assert_refused(
            code,
            &text,
            "error: standard output: No space left on device",
            &args.join(" "),
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_file_size_limit_is_a_write_error_not_a_signal() {
    let dir = tempdir("untrusted-fsize");
    let r = s(&base().run);
    // Standard output into a file past `ulimit -f`.
    let out = std::fs::File::create(dir.join("out.txt")).unwrap();
    let (code, text) = run_limited(&["inspect", r], out, Some((libc::RLIMIT_FSIZE, 0)));
    assert_refused(code, &text, "standard output: File too large", "inspect");
    // A file comera writes itself: the error names it.
    let export = dir.join("export.safetensors");
    let (code, text) = run_limited(
        &["export", r, "--compressed", s(&export)],
        std::fs::File::create(dir.join("export.txt")).unwrap(),
        Some((libc::RLIMIT_FSIZE, 1000)),
    );
    assert_refused(code, &text, "File too large", "export");
    assert!(text.contains("export.safetensors"), "export: {text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_address_space_limit_too_low_for_the_threads_says_so() {
    let dir = tempdir("untrusted-as");
    let out = std::fs::File::create(dir.join("out.txt")).unwrap();
    // Room to load the binary (its size, plus about 4 MiB for the C library, the loader and
    // the heap) but not for a worker thread's 8 MiB stack; a fixed figure broke each time the
    // binary grew.
    let binary = std::fs::metadata(env!("CARGO_BIN_EXE_comera"))
        .unwrap()
        .len();
    let limit = binary + 4 * 1024 * 1024;
    let (code, text) = run_limited(
        &["inspect", s(&base().run)],
        out,
        Some((libc::RLIMIT_AS, limit)),
    );
    assert_refused(code, &text, "cannot start", "ulimit -v");
    assert!(text.contains("ulimit -v"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 47, item 10: a small stack (`ulimit -s 64`) is not the command's (it runs on a thread
/// of its own): `eval` and `inspect` work every time, whatever the start of the stack holds.
#[test]
fn a_small_main_thread_stack_does_not_overflow() {
    let dir = tempdir("untrusted-stack");
    for i in 0..6 {
        for cmd in ["eval", "inspect"] {
            let out = std::fs::File::create(dir.join("out.txt")).unwrap();
            let (code, text) = run_limited(
                &[cmd, s(&base().run)],
                out,
                Some((libc::RLIMIT_STACK, 64 * 1024)),
            );
            assert_eq!(code, 0, "{cmd} #{i} under ulimit -s 64: {text}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 47, item 10: under any address-space limit (`ulimit -v`) a command ends with its
/// result or an error that says what ran out (status 1), never an abort or a crash.
#[test]
fn an_address_space_limit_ends_in_a_result_or_an_error_never_an_abort() {
    let dir = tempdir("untrusted-as-range");
    let binary = std::fs::metadata(env!("CARGO_BIN_EXE_comera"))
        .unwrap()
        .len();
    let mut succeeded = false;
    // Every MiB over the first 48 (where the threads' stacks and the allocator's reservations
    // run out one after another: today's main aborted at 18-20 MiB over the binary), then a
    // few larger limits.
    for extra_mib in (8u64..=48).chain([64, 96, 128, 192, 256, 384]) {
        let limit = binary + (extra_mib << 20);
        for cmd in ["eval", "inspect"] {
            let out = std::fs::File::create(dir.join("out.txt")).unwrap();
            let (code, text) =
                run_limited(&[cmd, s(&base().run)], out, Some((libc::RLIMIT_AS, limit)));
            let case = format!("{cmd} under ulimit -v of the binary + {extra_mib} MiB");
            match code {
                0 => succeeded = true,
                1 => assert!(text.contains("error: "), "{case}: {text}"),
                _ => panic!("{case}: status {code} (a signal or abort): {text}"),
            }
        }
    }
    assert!(
        succeeded,
        "no limit up to the binary + 384 MiB let a command run"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn dlrm_predict_and_eval_on_an_empty_file_name_the_file() {
    let dir = tempdir("untrusted-dlrm-empty");
    let synth = |name: &str, rows: &str| {
        let p = dir.join(name);
        let (code, text) = run(&[
            "synth-criteo",
            "--out",
            s(&p),
            "--rows",
            rows,
            "--total-rows",
            "2000",
        ]);
        assert_eq!(code, 0, "synth-criteo: {text}");
        p
    };
    let (train, valid) = (synth("train.tsv", "300"), synth("valid.tsv", "100"));
    let cfg = dir.join("dlrm.toml");
    std::fs::write(
        &cfg,
        format!(
            "[dlrm]\nembedding_dim = 4\nbottom_mlp = [8]\ntop_mlp = [8]\n\n[data]\nsource = \"criteo\"\ntrain = \"{}\"\nvalid = \"{}\"\ntotal_rows = 2000\n\n[train]\nepochs = 1\nbatch_size = 50\nout_dir = \"{}\"\n",
            s(&train),
            s(&valid),
            s(&dir.join("run"))
        ),
    )
    .unwrap();
    let (code, text) = run(&["train", "--config", s(&cfg), "--quiet"]);
    assert_eq!(code, 0, "train: {text}");
    let empty = dir.join("empty.tsv");
    std::fs::write(&empty, "").unwrap();
    let r = dir.join("run");
    for args in [
        vec!["predict", s(&r), s(&empty)],
        vec!["eval", s(&r), "--data", s(&empty)],
    ] {
        let (code, text) = run(&args);
        assert_refused(code, &text, "the input file is empty", &args.join(" "));
        assert!(text.contains("empty.tsv"), "{args:?}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
