//! Dense embedding table (baseline of TtmEmbedding), also used for position and token-type embeddings.
