//! Data: corpus files, the subword tokenizer (ours, or OPUS-MT's SentencePiece models), the
//! prepared corpus store and (for training) batching.

pub mod batch;
pub mod corpus;
pub mod opus;
pub mod prepare;
pub mod spm;
pub mod store;
pub mod tokenizer;

/// End of sentence, id 0 in nmt's and Marian's vocabularies.
pub const EOS: &str = "</s>";
/// Unknown piece, id 1.
pub const UNK: &str = "<unk>";
/// Padding, the last id; Marian's decoder also starts from it.
pub const PAD: &str = "<pad>";
