//! Config fields held as `f32` (learning rates, dropout, thresholds) are written with the
//! shortest decimal that reads back as the same `f32`: `dropout = 0.1`, not the f32 widened to
//! f64 (`0.10000000149011612`), which is what serialisers write for a plain `f32`.
//!
//! Use on a field: `#[serde(serialize_with = "comera_layers::config_float::shortest_f32")]`.

/// The f64 to write for `v`: the shortest decimal of `v` (Rust's `Display` for f32), unless
/// reading that decimal as f64 and narrowing to f32 would not give `v` back (never seen, but
/// then the exact widening is written).
pub fn shortest_as_f64(v: f32) -> f64 {
    match v.to_string().parse::<f64>() {
        Ok(d) if d as f32 == v => d,
        _ => v as f64,
    }
}

/// `serialize_with` for an `f32` field (see the module docs).
pub fn shortest_f32<S: serde::Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(shortest_as_f64(*v))
}

#[cfg(test)]
mod tests {
    use super::shortest_as_f64;

    #[test]
    fn shortest_decimals_read_back_exactly() {
        assert_eq!(shortest_as_f64(0.1), 0.1f64);
        assert_eq!(shortest_as_f64(1e-3), 1e-3f64);
        assert_eq!(shortest_as_f64(1e-12), 1e-12f64);
        assert_eq!(shortest_as_f64(0.999), 0.999f64);
        // Every f32 from a spread of bit patterns reads back as itself.
        for bits in (0u32..0x7f80_0000).step_by(65_537) {
            let v = f32::from_bits(bits);
            assert_eq!(shortest_as_f64(v) as f32, v, "{v:e}");
            assert_eq!(shortest_as_f64(-v) as f32, -v, "{v:e}");
        }
        assert!(shortest_as_f64(f32::INFINITY).is_infinite());
    }
}
