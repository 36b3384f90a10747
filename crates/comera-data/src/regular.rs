//! Opening the files comera reads as input: regular files only.
//!
//! A path a user names (a data file, a vocabulary, a config, a model, a checkpoint, the metrics
//! log) may be a FIFO, a device or a socket: reading a FIFO blocks until a writer comes (forever,
//! for a resume), and `/dev/zero` never ends (a vocabulary read from it fills memory). Every read
//! of such a path goes through [`open_regular`], which opens without blocking and then refuses
//! anything that is not a regular file (symlinks are followed), saying what it is.
//!
//! The errors are `std::io::Error`s of kind `InvalidInput`, so callers that already add the path
//! to an I/O error need nothing else.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// What a non-regular file is, in words ("a FIFO (named pipe)", "a directory", …).
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// The error for a path that is not a regular file.
fn not_regular(meta: &std::fs::Metadata) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("is {}, not a regular file", file_kind(meta)),
    )
}

/// Opens `path` for reading if it is a regular file (after following symlinks); a FIFO, device,
/// socket or directory is refused without blocking.
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer. It is cleared again
    // below for a regular file (where it has no effect on reads anyway).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    set_blocking(&file)?;
    Ok(file)
}

/// Clears `O_NONBLOCK` on an open file.
fn set_blocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns; F_GETFL/F_SETFL take no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The bytes of the regular file `path` ([`open_regular`]).
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The text of the regular file `path` ([`open_regular`]); not UTF-8 is an `InvalidData` error.
pub fn read_regular_to_string(path: &Path) -> io::Result<String> {
    let mut file = open_regular(path)?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("comera-regular-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_a_device_and_a_directory_are_refused_without_blocking() {
        let dir = scratch("special");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path made above.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read_regular(&fifo).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("FIFO"), "{err}");
        let err = read_regular_to_string(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let err = read_regular(&dir).unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
        // A symlink to a regular file is read through.
        std::fs::write(dir.join("a.txt"), "hello").unwrap();
        std::os::unix::fs::symlink(dir.join("a.txt"), dir.join("link")).unwrap();
        assert_eq!(read_regular_to_string(&dir.join("link")).unwrap(), "hello");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
