//! Data: corpus files, the subword tokenizer and (for training) batching.

pub mod batch;
pub mod corpus;
pub mod tokenizer;
