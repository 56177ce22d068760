//! Checkpoints and models on disk: finding the model a user names (a checkpoint or run folder,
//! or a Hugging Face Hub repo id), loading it, writing checkpoint folders crash-safely, and
//! averaging checkpoints. Training and translation both go through here; this module knows
//! nothing of the training loop or of search.

pub mod average;
pub mod folder;
pub mod hub;

pub use average::average;
pub use folder::{list_checkpoints, point, Checkpoint, TrainerState};
pub use hub::{load, load_as, resolve, LoadedModel};
