//! Data: corpus files, the subword tokenizer (ours, or OPUS-MT's SentencePiece models), the
//! prepared corpus store and (for training) batching.

pub mod batch;
pub mod corpus;
pub mod opus;
pub mod prepare;
pub mod spm;
pub mod store;
pub mod tokenizer;
