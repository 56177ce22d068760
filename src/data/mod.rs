//! Data: corpus files, the subword tokenizer (ours, or OPUS-MT's SentencePiece models) and (for training) batching.

pub mod batch;
pub mod corpus;
pub mod opus;
pub mod spm;
pub mod tokenizer;
