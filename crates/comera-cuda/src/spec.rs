//! `DeviceSpec`: which device a run trains on, as a config and the CLI write it.
//!
//! Strings: `cpu`, `cuda` (the first GPU, ordinal 0) and `cuda:N` (GPU N, counting from 0 as
//! the driver and `nvidia-smi` do). Parsing is case-sensitive and rejects anything else with a
//! message that lists the accepted forms. Always compiled (no cudarc): the config and the CLI
//! name a device without building the CUDA engine.

use std::fmt;
use std::str::FromStr;

/// A device to run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// The CPU engine (the default).
    #[default]
    Cpu,
    /// CUDA device of this ordinal.
    Cuda(usize),
}

/// A device string that is none of `cpu`, `cuda`, `cuda:N`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("device `{given}` is not one of `cpu`, `cuda` or `cuda:N` (N a GPU number from 0, e.g. `cuda:1`){hint}")]
pub struct ParseDeviceError {
    given: String,
    hint: &'static str,
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// The CUDA ordinal, if this is a CUDA device.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            DeviceSpec::Cpu => None,
            DeviceSpec::Cuda(n) => Some(n),
        }
    }
}

impl fmt::Display for DeviceSpec {
    /// `cpu` or `cuda:N` (always with the ordinal, so it parses back to the same value).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<DeviceSpec, ParseDeviceError> {
        let err = |hint| ParseDeviceError {
            given: s.to_string(),
            hint,
        };
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                // Digits only: no sign, no spaces, no `0x`.
                Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => n
                    .parse()
                    .map(DeviceSpec::Cuda)
                    .map_err(|_| err(": the GPU number is too large")),
                Some(_) => Err(err(": the GPU number must be digits only")),
                None if s.eq_ignore_ascii_case("cpu") || s.eq_ignore_ascii_case("cuda") => {
                    Err(err(": write it in lower case"))
                }
                None if s.starts_with("gpu") => Err(err(": GPUs are named `cuda`")),
                None => Err(err("")),
            },
        }
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<DeviceSpec, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_form() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:0".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:12".parse(), Ok(DeviceSpec::Cuda(12)));
        for d in [DeviceSpec::Cpu, DeviceSpec::Cuda(0), DeviceSpec::Cuda(7)] {
            assert_eq!(d.to_string().parse(), Ok(d));
        }
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::Cuda(2).cuda_ordinal(), Some(2));
        assert!(!DeviceSpec::Cpu.is_cuda());
    }

    #[test]
    fn bad_strings_say_what_is_accepted() {
        for (bad, hint) in [
            ("", ""),
            ("gpu", "named `cuda`"),
            ("gpu:0", "named `cuda`"),
            ("CUDA", "lower case"),
            ("Cpu", "lower case"),
            ("cuda:", "digits only"),
            ("cuda:-1", "digits only"),
            ("cuda:+1", "digits only"),
            ("cuda: 1", "digits only"),
            ("cuda:1x", "digits only"),
            ("cuda:99999999999999999999999", "too large"),
            ("tpu", ""),
        ] {
            let msg = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(msg.contains(&format!("`{bad}`")), "{msg}");
            assert!(msg.contains("`cpu`, `cuda` or `cuda:N`"), "{msg}");
            assert!(msg.contains(hint), "{bad}: {msg}");
        }
    }

    #[test]
    fn round_trips_through_serde_as_a_string() {
        let d: DeviceSpec = serde_json::from_str("\"cuda:1\"").unwrap();
        assert_eq!(d, DeviceSpec::Cuda(1));
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"cuda:1\"");
        let e = serde_json::from_str::<DeviceSpec>("\"gpu\"").unwrap_err();
        assert!(e.to_string().contains("`cpu`, `cuda` or `cuda:N`"), "{e}");
    }
}
