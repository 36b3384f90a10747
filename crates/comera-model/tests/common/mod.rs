//! What several of this crate's tests share.

use comera_model::{EncoderConfig, LayerTt, Rank, TtmConfig};

/// A small encoder (vocabulary 2,100, d 32, 4 heads, FFN 64, 3 labels) with TT linear layers and
/// a TTM word embedding when `tt`; callers set the sequence length, the depth and the rest.
pub fn small_encoder(tt: bool) -> EncoderConfig {
    EncoderConfig {
        vocab_size: 2100,
        d_model: 32,
        heads: 4,
        ffn: 64,
        num_labels: 3,
        tt_linear: tt,
        ttm_embedding: tt,
        attn_tt: LayerTt::uniform(&[4, 8], &[8, 4], 4),
        ffn_up_tt: LayerTt::uniform(&[4, 8], &[8, 8], 4),
        ffn_down_tt: LayerTt::uniform(&[8, 8], &[8, 4], 4),
        word_ttm: TtmConfig {
            vocab_modes: vec![14, 15, 10],
            dim_modes: vec![2, 4, 4],
            rank: Rank::Uniform(4),
        },
        ..EncoderConfig::default()
    }
}
